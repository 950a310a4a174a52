"""The risk path on the real broker: a ``surge worker --role risk`` subprocess, events in, decisions
out, every decision's features checked against the brute-force recomputation from the events each
stage read (windows at their edges, out-of-order and late events, re-keying by every entity, bad
events), rule updates without a restart, and recovery from the changelog after a SIGKILL."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from agents.risk import changelog_topic, ensure_risk_topics, feature_config, repartition_topic
from pipeline.client import partitions_of
from pipeline.devtools.bench.risk_check import check_decisions, read_arrivals
from pipeline.metrics import scrape
from pipeline.records import now_ms
from pipeline.risk.records import RiskDecision
from pipeline.risk.rules import DEFAULT_RULES, Rule, RuleBook, RuleSet
from pipeline.risk.simulate import SimConfig, as_event, disorder, simulate
from pipeline.risk.stages import REKEYED_KINDS, partition_for
from pipeline.risk_client import RiskClient, publish_rules, read_rule_records
from pipeline.riskops import RISK_READY

pytestmark = pytest.mark.integration

T0 = 1_767_225_600_000  # 2026-01-01T00:00Z, a multiple of every tile size
PARTITIONS = 4


def on_partition(prefix: str, p: int, n: int = 1) -> list[str]:
    """``n`` ids starting with ``prefix`` that Kafka's default partitioner puts on partition ``p``."""
    out, i = [], 0
    while len(out) < n:
        if partition_for(f"{prefix}{i}", PARTITIONS) == p:
            out.append(f"{prefix}{i}")
        i += 1
    return out


def event(eid: str, account: str, t: int, **kw: Any) -> dict[str, Any]:
    e = {
        "event_id": eid,
        "type": "payment",
        "account": account,
        "card": f"card-{account}",
        "device": None,
        "ip": None,
        "amount": 20.0,
        "currency": "EUR",
        "merchant": "m1",
        "country": "DE",
        "event_time_ms": t,
    }
    e.update(kw)
    return e


async def risk_client(d: Any) -> RiskClient:
    """A started client of ``d``'s risk topics, closed with the deployment."""
    c = RiskClient(
        d.bootstrap,
        events_topic=d.topics.risk_events,
        decisions_topic=d.topics.risk_decisions,
        rules_topic=d.topics.risk_rules,
    )
    await c.start()
    d.clients.append(c)
    return c


async def undecided_report(d: Any, missing: list[str], total: int) -> str:
    """Where the events without a decision are: on the events topic (partition@offset) or not, and
    whether a decision for them is on the decisions topic after all (the client missed it)."""
    where: dict[str, list[str]] = {eid: [] for eid in missing}
    for topic, kind in ((d.topics.risk_events, "event"), (d.topics.risk_decisions, "decision")):
        for r in await d.read_topic(topic, timeout_s=5):
            with contextlib.suppress(ValueError, AttributeError):
                eid = json.loads(r.value).get("event_id")
                if eid in where:
                    where[eid].append(f"{kind} at {r.partition}@{r.offset}")
    # the hops between: each repartition record holds items (``e``: the event, ``o``: where the
    # stage before read it), so a report says at which stage an event stopped
    for kind in REKEYED_KINDS:
        for r in await d.read_topic(repartition_topic(d.settings, kind), timeout_s=5):
            with contextlib.suppress(ValueError, AttributeError, KeyError, TypeError):
                for item in json.loads(r.value)["items"]:
                    eid = item["e"].get("event_id")
                    if eid in where:
                        where[eid].append(f"by-{kind} at {r.partition}@{r.offset} from {item.get('o')}")
    logs = "\n".join(f"--- {w.name} ({w.log_path}):\n{w.tail(4000)}" for w in d.workers)
    return f"{len(missing)} of {total} events without a decision after the crash: {where}\n{logs}"


async def assert_all_decided_as_recomputed(d: Any, c: RiskClient, futs: dict[str, Any]) -> dict[str, Any]:
    """Every event sent (``futs``) gets a decision within 120 s, and every decision, repeats after a
    crash included, holds the features the brute-force recomputation gives (nothing late wrongly);
    the check's report."""
    _, pending = await asyncio.wait(futs.values(), timeout=120)
    unsent = {eid: f.exception() for eid, f in futs.items() if f.done() and f.exception() is not None}
    assert not unsent, f"events the broker never took (the test's producer, not the worker): {unsent}"
    if pending:
        missing = [eid for eid, f in futs.items() if f in pending]
        raise AssertionError(await undecided_report(d, missing, len(futs)))
    await asyncio.sleep(2)  # repeats of decisions made before the crash arrive too
    decisions = [dec for dec, _ in c.decisions]
    report = check_decisions(await read_arrivals(d.settings), decisions, feature_config(d.settings), futs)
    assert report["missing"] == 0 and report["repeats_differing"] == 0, report
    assert report["mismatched_decisions"] == 0, report["mismatch_examples"]
    assert report["late_wrong"] == 0
    return report


async def start(deployment: Any, **env: Any) -> tuple[Any, Any, RiskClient]:
    d = deployment(**env)
    await ensure_risk_topics(d.settings)
    w = d.worker(role="risk", wait=False)
    await asyncio.to_thread(w.wait_ready, RISK_READY, 180)
    return d, w, await risk_client(d)


async def decide_all(
    c: RiskClient, events: list[dict[str, Any]], timeout_s: float = 90.0
) -> dict[str, RiskDecision]:
    futs = {e["event_id"]: await c.send(e) for e in events}
    await c.producer.flush()
    _, pending = await asyncio.wait(futs.values(), timeout=timeout_s)
    assert not pending, f"{len(pending)} of {len(futs)} events got no decision in {timeout_s:.0f} s"
    return {eid: f.result() for eid, f in futs.items()}


async def test_features_at_window_edges_out_of_order_late_rekeyed_and_bad_events(deployment: Any) -> None:
    d, w, c = await start(deployment)
    # three accounts on three different partitions share one device and one ip
    a = [on_partition("acct-", p)[0] for p in (0, 1, 2)]
    shared = {"device": "dev-shared", "ip": "ip-shared"}
    crafted = [
        event("x1", a[0], T0, **shared),
        event("x2", a[0], T0 + 59_999, **shared),  # same 1 min window as x1 (5 tiles on)
        event("x3", a[0], T0 + 60_000, **shared),  # x1's tile has just left the 1 min window
        event("x4", a[1], T0 + 60_001, **shared),
        event("x5", a[2], T0 + 60_002, **shared, type="transfer", card=None, merchant="benef-1"),
        event("x6", a[0], T0 + 56_000, **shared),  # 4 s behind its account: out of order, in grace
        event("x7", a[0], T0 + 50_000, **shared),  # 10 s behind: late
        event("x8", a[1], T0 + 3_660_001, **shared),  # 1 h later: x4's 5 min tile has left the hour
        event("x9", a[1], T0 + 3_660_001, **shared, type="login", amount=0.0, card=None, merchant=None),
    ]
    sim = [as_event(e) for e in simulate(SimConfig(customers=40, days=1, seed=5, fraud_scale=30))][:250]
    sim = disorder(sim, share=0.05, late_share=0.02, grace_ms=5_000, seed=9)
    bad = [
        (a[0].encode(), b"{not json"),
        (b"someone-else", json.dumps(event("b1", a[0], T0)).encode()),  # key differs from account
        (a[0].encode(), json.dumps(event("b2", a[0], T0, amount=-5)).encode()),
        (
            a[0].encode(),
            json.dumps({k: v for k, v in event("b3", a[0], T0).items() if k != "event_id"}).encode(),
        ),
        (a[0].encode(), json.dumps(event("b4", a[0], T0, type="login")).encode()),  # a login with an amount
        # an event id that decodes to a lone surrogate: no error decision can carry it (UTF-8 cannot
        # write it), so a dead letter only, and the worker goes on (it stopped on it, every redelivery)
        (a[0].encode(), json.dumps(event("b5\ud800", a[0], T0, amount=-5)).encode()),
    ]
    errors = {eid: c.expect(eid) for eid in ("b1", "b2", "b4")}
    decisions = {}
    for e in crafted:  # one at a time, so that every stage sees them in this order
        decisions[e["event_id"]] = await c.decide(e)
    # an event dated a day after the worker's clock is refused; accepted, it would have moved a[2]'s
    # latest event a day ahead, and x10, on time after x5, would have been late
    ahead = await c.decide(event("b6", a[2], now_ms() + 86_400_000, **shared))
    on_time = event("x10", a[2], T0 + 60_003, **shared)
    crafted.append(on_time)
    decisions["x10"] = await c.decide(on_time)
    for key, raw in bad:
        await c.send_raw(key, raw)
    decisions |= await decide_all(c, sim)
    err = {eid: await asyncio.wait_for(f, 30) for eid, f in errors.items()}
    err["b6"] = ahead

    f = {eid: decisions[eid].features for eid in ("x1", "x2", "x3", "x6", "x8", "x9")}
    assert f["x1"]["account_count_1m"] == 0 and f["x1"]["account_since_last_s"] is None
    assert f["x2"]["account_count_1m"] == 1 and f["x2"]["card_amount_1m"] == 20.0
    assert f["x3"]["account_count_1m"] == 1 and f["x3"]["account_count_1h"] == 2
    assert f["x6"]["account_count_1m"] == 2 and f["x6"]["account_since_last_s"] == 0  # x1 + x2
    # re-keyed: the shared ip and device saw all three accounts, whatever their partitions
    assert decisions["x5"].features["ip_distinct_account_1m"] == 2  # x1..x4 from a0 and a1
    assert (
        decisions["x5"].features["device_count_1m"] == 3 and decisions["x5"].features["card_count_1m"] is None
    )
    assert f["x8"]["ip_count_1h"] == 0 and f["x8"]["ip_count_24h"] == 6  # x1-x6 (x7 was late)
    assert f["x9"]["ip_count_1m"] == 1 and f["x9"]["account_since_last_s"] == 0
    assert decisions["x7"].late and decisions["x7"].decision == "review" and not decisions["x7"].features
    assert "late_event" in decisions["x7"].reasons[0]

    for eid, dec in err.items():
        assert dec.decision == "error" and dec.error is not None and dec.error.code == "invalid_request", eid
    assert "differs from account" in err["b1"].error.message  # type: ignore[union-attr]
    assert "amount" in err["b2"].error.message and "login carries no amount" in err["b4"].error.message  # type: ignore[union-attr]
    assert "after this worker's clock; at most 5000 ms" in err["b6"].error.message  # type: ignore[union-attr]
    assert not decisions["x10"].late and decisions["x10"].features["account_count_1m"] == 1  # x5

    arrivals = await read_arrivals(d.settings)
    report = check_decisions(
        arrivals, decisions.values(), feature_config(d.settings), [e["event_id"] for e in crafted + sim]
    )
    assert report["mismatched_decisions"] == 0, report["mismatch_examples"]
    assert report["missing"] == 0 and report["late_wrong"] == 0
    assert report["late_expected"] >= 2 and report["feature_values_checked"] > 10_000
    late = await d.read_topic(d.topics.risk_late, min_count=report["late_expected"])
    assert {json.loads(r.value)["event"]["event_id"] for r in late} == {
        eid for eid, dec in decisions.items() if dec.late
    }
    dead = await d.read_topic(d.topics.deadletter, min_count=len(bad) + 1)
    assert len(dead) == len(bad) + 1 and all(json.loads(r.value)["reason"] == "invalid_request" for r in dead)

    m = scrape(w.metrics())
    decided = sum(v for (n, _), v in m.items() if n == "surge_risk_decisions_total")
    assert decided == len(decisions) + len(err)
    assert m[("surge_risk_late_events_total", ())] == report["late_expected"]
    assert m[("surge_risk_decision_latency_seconds_count", ())] == len(decisions)
    hits = sum(
        v for (n, lab), v in m.items() if n == "surge_risk_feature_cache_total" and ("result", "hit") in lab
    )
    assert hits > 0


async def test_rule_update_applies_on_every_partition_within_a_second(deployment: Any) -> None:
    _, _, c = await start(deployment)
    accounts = [on_partition("rules-", p)[0] for p in range(PARTITIONS)]
    before = await c.decide(event("r0", accounts[0], T0, type="transfer", card=None, amount=150.0))
    assert before.decision == "approve" and before.rule_version
    rule = Rule(
        rule_id="big_transfer",
        version=1,
        action="decline",
        points=5,
        description="test",
        when=[("event.type", "==", "transfer"), ("event.amount", ">=", 100)],
    )
    await c.publish_rules([rule])
    published = time.monotonic()
    n, seen_at, probes = 0, None, []
    while seen_at is None and time.monotonic() - published < 10:
        n += 1
        sent = time.monotonic()
        dec = await c.decide(
            event(f"p{n}", accounts[n % PARTITIONS], T0 + n, type="transfer", card=None, amount=150.0)
        )
        probes.append(dec)
        if dec.rule_version != before.rule_version:
            seen_at = sent
    assert seen_at is not None, "the new rule never took effect"
    assert seen_at - published <= 1.0, f"took {seen_at - published:.2f} s"
    new_version = probes[-1].rule_version
    after = await decide_all(
        c,
        [
            event(f"q{i}", acc, T0 + 1000 + i, type="transfer", card=None, amount=150.0)
            for i, acc in enumerate(accounts)
        ],
    )
    for dec in after.values():
        assert dec.rule_version == new_version and dec.decision == "decline"
        assert any(
            r.startswith("rule big_transfer@1: event.type=transfer == transfer, event.amount=150")
            for r in dec.reasons
        )
    await c.delete_rule("big_transfer")
    # each probe from an account of its own, as "before" was: the model, not only the rules, reads a
    # burst of transfers from one account (velocity), and this test is about the rules
    fresh = on_partition("after-delete-", 0, 50)
    for i in range(50):
        dec = await c.decide(
            event(f"z{i}", fresh[i], T0 + 5000 + i, type="transfer", card=None, amount=150.0)
        )
        if dec.rule_version == before.rule_version:
            break
        await asyncio.sleep(0.1)
    assert dec.rule_version == before.rule_version and dec.decision == "approve"  # same content, same version
    assert not any(r.startswith("rule big_transfer") for r in dec.reasons)


async def test_default_rules_published_whole_in_one_transaction_by_workers_starting_together(
    deployment: Any,
) -> None:
    """Risk workers that start together on an empty rules topic publish the default rules each in
    one transaction, and no reader sees part of a set: each worker's first version is the whole
    set's (docs/architecture.md, "Risk: rules")."""
    d = deployment()
    await ensure_risk_topics(d.settings)
    topic = d.topics.risk_rules
    full = RuleSet(DEFAULT_RULES).version
    # the race itself, on the real broker: two publishers that both find the topic empty
    outcomes = await asyncio.gather(
        *(publish_rules(d.bootstrap, topic, DEFAULT_RULES, only_if_empty=True) for _ in "ab")
    )
    assert any(outcomes)
    assert len(await read_rule_records(d.bootstrap, topic)) == len(DEFAULT_RULES) * sum(outcomes)
    # a reader applying what each read brings never holds part of the set
    book = RuleBook()
    consumer = AIOKafkaConsumer(bootstrap_servers=d.bootstrap, isolation_level="read_committed")
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in await partitions_of(consumer, topic)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        versions = []
        while len(versions) < 20 and book.current.version != full:
            batch = await consumer.getmany(timeout_ms=500)
            book.apply_many([(r.key, r.value) for recs in batch.values() for r in recs])
            versions.append(book.current.version)
    finally:
        await consumer.stop()
    assert set(versions) <= {RuleBook().current.version, full}, versions
    # and on a second, empty topic, the workers themselves
    d2 = deployment()
    await ensure_risk_topics(d2.settings)
    workers = [
        d2.worker(role="risk", wait=False, worker_id=name, data_dir=str(d2.tmp / f"data-{name}"))
        for name in "ab"
    ]
    for w in workers:
        await asyncio.to_thread(w.wait_ready, RISK_READY, 180)
    published = len(await read_rule_records(d2.bootstrap, d2.topics.risk_rules))
    assert published in (len(DEFAULT_RULES), 2 * len(DEFAULT_RULES)), published  # whole sets only
    for w in workers:
        assert (await asyncio.to_thread(w.status))["rules_version"] == full
        ready = [line for line in w.log_path.read_text().splitlines() if line.startswith("surge risk ready")]
        assert ready and f"rules {full} ({len(DEFAULT_RULES)})" in ready[0], ready


async def test_rules_publish_and_show_from_the_command_line(deployment: Any, tmp_path: Path) -> None:
    """``surge risk rules publish --file`` writes a set in one transaction; ``show`` reads the
    committed records as a worker does, leaving a bad record out with a message."""
    d = deployment()
    await ensure_risk_topics(d.settings)
    env = {**os.environ, **d.env}
    rules = [r.model_dump(mode="json") for r in DEFAULT_RULES[:3]]
    (tmp_path / "rules.json").write_text(json.dumps(rules))

    def cli(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pipeline.cli", "risk", "rules", *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )

    published = await asyncio.to_thread(cli, "publish", "--file", str(tmp_path / "rules.json"))
    assert published.returncode == 0, published.stderr
    c = await risk_client(d)
    await c.producer.send_and_wait(d.topics.risk_rules, key=b"broken", value=b"{}")
    shown = await asyncio.to_thread(cli, "show")
    assert shown.returncode == 0, shown.stderr
    out = json.loads(shown.stdout)
    assert out["version"] == RuleSet(DEFAULT_RULES[:3]).version
    assert [r["rule_id"] for r in out["rules"]] == [r["rule_id"] for r in rules]
    assert "broken" in shown.stderr


async def test_sigkill_under_load_then_recovery_from_the_changelog(deployment: Any, tmp_path: Path) -> None:
    d, w, c = await start(deployment)
    events = [as_event(e) for e in simulate(SimConfig(customers=60, days=1, seed=13, fraud_scale=20))][:900]
    events = disorder(events, share=0.05, late_share=0.01, grace_ms=5_000, seed=2)
    # the kill comes halfway through the stream (it once waited for event 400 of a stream of 367, and
    # so never came)
    kill_at = len(events) // 2
    assert kill_at >= 150, len(events)
    # the tables hold state once most of the first part is decided; the kill then comes right after a
    # burst of events is on the broker, so some are in flight however fast the worker decides
    warm_at = kill_at - 100
    futs = {}
    w2 = None
    for i, e in enumerate(events):
        futs[e["event_id"]] = await c.send(e)
        if i == warm_at:
            await c.producer.flush()
            while len(c.decisions) < warm_at * 0.6:  # noqa: ASYNC110 - the tables hold state
                await asyncio.sleep(0.05)
        elif i == kill_at:
            await c.producer.flush()
            in_flight_at_kill = kill_at + 1 - len(c.decisions)
            w.kill()  # SIGKILL
            shutil.rmtree(d.env["SURGE_DATA_DIR"], ignore_errors=True)  # no local store: the changelog only
            w2 = d.worker(role="risk", wait=False)
            await asyncio.to_thread(w2.wait_ready, RISK_READY, 180)
        elif i % 50 == 0 and not warm_at < i < kill_at:  # the burst before the kill goes unpaced
            await asyncio.sleep(0.05)
    await c.producer.flush()
    assert w2 is not None, "the worker was never killed"
    assert in_flight_at_kill > 0, "nothing was in flight at the kill"
    await assert_all_decided_as_recomputed(d, c, futs)
    # the stuck-send timer runs on the risk role too (agents/acks.report_stuck), and found nothing here
    status = await asyncio.to_thread(w2.status)
    assert status["sends_reported_stuck"] == 0, status


#: where Faust's RocksDB store keeps a partition's last changelog offset
OFFSET_KEY = b"__faust\0offset__"


def _local_store(data_dir: Path, name: str) -> dict[bytes, bytes]:
    """Every entry of the one partition database called ``name`` under ``data_dir``."""
    from rocksdict import AccessType, Rdict

    found = sorted(data_dir.rglob(name))
    assert len(found) == 1, (name, found)
    db = Rdict(str(found[0]), access_type=AccessType.read_only())
    try:
        return dict(db.items())
    finally:
        db.close()


async def test_states_reach_the_store_and_the_changelog_with_the_changelog_offset(deployment: Any) -> None:
    """Each stage writes its changed states to its local store and sends their changelog records
    itself (not through the table's own write path): after a clean stop, every partition's store holds
    the latest changelog value of every key, keyed as the table keys it, and remembers the changelog's
    last offset, where the next start's recovery begins reading."""
    from agents.risk import table_name

    d, w, c = await start(deployment)
    events = [as_event(e) for e in simulate(SimConfig(customers=40, days=1, seed=21))][:300]
    assert len(events) >= 200, len(events)
    await decide_all(c, events)
    await asyncio.sleep(1.0)  # the last batches' changelog acknowledgements
    w.stop()
    data_dir = Path(d.env["SURGE_DATA_DIR"])
    for kind in ("account", "card", "device", "ip"):
        name = changelog_topic(d.settings, kind)
        ends: dict[int, int] = dict.fromkeys(range(PARTITIONS), 0)
        latest: dict[int, dict[bytes, bytes]] = {p: {} for p in range(PARTITIONS)}
        for r in await d.read_topic(name):
            ends[r.partition] = max(ends[r.partition], r.offset + 1)
            latest[r.partition][r.key] = r.value
        assert sum(ends.values()) > 0, f"nothing on {name}"
        for p in range(PARTITIONS):
            if not ends[p]:
                continue
            stored = _local_store(data_dir, f"{table_name(kind)}-{p}.db")
            assert stored.pop(OFFSET_KEY, None) == str(ends[p] - 1).encode(), (kind, p, ends[p])
            assert stored == latest[p], (kind, p, len(stored), len(latest[p]))
            assert all(json.loads(k) for k in stored), "keys serialised as the table serialises them"
    # decisions, sent as whole batches, are keyed by account on the partition the producer's own
    # partitioner gives the key
    decisions = await d.read_topic(d.topics.risk_decisions)
    assert len(decisions) >= len(events)
    for r in decisions:
        assert r.key == json.loads(r.value)["account"].encode()
        assert r.partition == partition_for(r.key.decode(), PARTITIONS), (r.key, r.partition)
