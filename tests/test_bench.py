"""The benchmarks keep working: each scenario in ``--quick`` mode against the real broker.

These assert that every arm ran and that the numbers are sane (everything answered, positive
throughputs, ordered percentiles, plausible counts), never the performance targets: quick runs on a
shared 2-core box are too small and too noisy for that.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from pipeline.dedup import normalize
from pipeline.devtools.bench import SCENARIOS, run_bench
from pipeline.devtools.bench.common import BenchError, target
from pipeline.devtools.bench.merging import build_workload, light_edit
from pipeline.devtools.broker import EmbeddedKafka
from pipeline.stats import percentile
from tests.conftest import SHARED_DATA

BANKING77 = SHARED_DATA / "banking77" / "train.csv"


def _run(scenario: str, kafka: EmbeddedKafka, tmp_path: Path, **options: Any) -> dict[str, Any]:
    out = tmp_path / f"{scenario}.json"
    rc = run_bench(scenario, quick=True, json_path=out, broker=kafka, **options)
    assert rc == 0
    assert out.with_suffix(".png").stat().st_size > 1000, "the plot was written"
    result = json.loads(out.read_text())
    assert result["scenario"] == scenario and result["quick"] is True
    for t in result["targets"]:
        assert set(t) >= {"name", "value", "goal", "met", "missed_by"}
        assert t["met"] or t["missed_by"] is None or t["missed_by"] > 0
    return result


def _sane_latency(lat: dict[str, Any]) -> None:
    assert lat["count"] > 0
    assert 0 < lat["p50_ms"] <= lat["p99_ms"] <= lat["p999_ms"] <= lat["max_ms"]


# ---- pure helpers (no broker) -------------------------------------------------------------------
def test_percentile_interpolates_and_target_reports_the_shortfall() -> None:
    assert percentile([], 50) is None
    assert percentile([5.0], 99) == 5.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(range(101)), 99) == 99.0
    import pipeline.devtools.bench.common
    import pipeline.devtools.demo

    assert (
        pipeline.devtools.demo.percentile is pipeline.devtools.bench.common.percentile is percentile
    )  # one definition
    missed = target("x", 0.3, ">=", 0.5)
    assert missed["met"] is False and missed["missed_by"] == pytest.approx(0.2)
    met = target("y", 120.0, "<=", 200.0)
    assert met["met"] is True and met["missed_by"] == 0.0


def test_merging_workload_has_the_requested_mix_and_edits_keep_the_intent() -> None:
    rows = [(f"How do I do thing number {i} with my card?", f"intent_{i % 7}") for i in range(400)]
    items = build_workload(rows, 100)
    kinds = [it.kind for it in items]
    assert len(items) == 200
    assert kinds.count("unique") == 100 and kinds.count("repeat") == 60 and kinds.count("edit") == 40
    for i, it in enumerate(items):
        if it.kind != "unique":
            assert it.source is not None and it.source < i, "a copy follows its original"
            assert items[it.source].kind == "unique" and it.intent == items[it.source].intent
        if it.kind == "repeat":
            assert it.text == items[it.source].text
    assert len({normalize(it.text) for it in items if it.kind == "unique"}) == 100


def test_light_edit_changes_only_surface_form() -> None:
    import random

    rng = random.Random(3)
    base = "Why was my card payment declined?"
    edits = {light_edit(base, rng) for _ in range(50)}
    assert len(edits) > 5
    for e in edits:
        assert "declined" in e.lower() and "card" in e.lower()


def test_merging_fails_clearly_without_the_data(tmp_path: Path) -> None:
    with pytest.raises(BenchError, match="banking77 CSV not found"):
        run_bench("merging", quick=True, json_path=tmp_path / "m.json", banking77_csv=tmp_path / "nope.csv")


def test_unknown_scenario_is_refused() -> None:
    with pytest.raises(ValueError, match="one of batching"):
        run_bench("speed", quick=True)
    assert SCENARIOS == (
        "batching",
        "merging",
        "priority",
        "overhead",
        "gateway",
        "surge",
        "failover",
        "risk",
        "replay",
        "hostile",
    )


# ---- quick runs against the real broker -----------------------------------------------------------
@pytest.mark.integration
@pytest.mark.heavy
def test_overhead_quick(kafka: EmbeddedKafka, tmp_path: Path) -> None:
    r = _run("overhead", kafka, tmp_path)
    for arm in ("surge", "plain"):
        a = r["arms"][arm]
        assert a["answered"] == a["sent"] > 0 and a["errors"] == 0 and a["lost"] == 0
        assert a["throughput_rps"] > 0
        _sane_latency(a["latency_idle"])
    assert r["throughput_ratio_surge_vs_plain"] > 0
    assert r["added_p50_latency_ms"] is not None


@pytest.mark.integration
@pytest.mark.heavy
def test_hostile_quick_state_stays_bounded(kafka: EmbeddedKafka, tmp_path: Path) -> None:
    """Requests built to grow a worker's state (random model names, new users, system messages and
    tenants): each gets one reply, idle rate-limit buckets are swept, many one-answer scopes cost
    little, and the worker's memory stays under the bound the benchmark states."""
    r = _run("hostile", kafka, tmp_path)
    n = r["plan"]["requests"]
    assert r["answered"] == n and r["repeats"] == 0
    assert r["codes"]["invalid_request"] == n * 4 // 10, "every random model name is refused"
    assert r["codes"]["ok"] == n * 6 // 10
    status = r["status"]
    assert status["ratelimit_buckets_swept"] > 0, "idle buckets of one-off users are deleted"
    assert status["cache"]["scopes"] > n // 10, "new system messages and tenants made scopes"
    rss = r["rss_mib"]
    assert rss["start"] > 100 and rss["peak"] <= rss["stated_bound"]


@pytest.mark.integration
@pytest.mark.heavy
def test_batching_quick(kafka: EmbeddedKafka, tmp_path: Path) -> None:
    r = _run("batching", kafka, tmp_path)
    assert set(r["arms"]) == {"surge", "surge_b1", "limit"}
    for arm in ("surge", "surge_b1"):
        a = r["arms"][arm]
        assert a["answered"] == a["sent"] > 0 and a["errors"] == 0
        _sane_latency(a["latency"])
    assert r["arms"]["surge_b1"]["mean_batch_size"] == 1.0, "batch size one means one request per call"
    assert r["arms"]["surge"]["mean_batch_size"] > 1.0
    assert r["arms"]["limit"]["throughput_rps"] > 0
    assert r["throughput_ratio_surge_vs_b1"] > 0 and r["throughput_ratio_surge_vs_limit"] > 0


@pytest.mark.integration
@pytest.mark.skipif(not BANKING77.is_file(), reason="banking77 data not present")
@pytest.mark.heavy
def test_merging_quick(kafka: EmbeddedKafka, tmp_path: Path) -> None:
    r = _run("merging", kafka, tmp_path, banking77_csv=BANKING77)
    on, off = r["arms"]["surge"], r["arms"]["off"]
    n = r["data"]["requests"]
    for a in (on, off):
        assert a["answered"] == a["sent"] == n and a["errors"] == 0
    assert off["model_items"] == n, "with merging and caching off every request reaches the model"
    assert off["served_from"] == {"model": n}
    assert on["model_items"] == on["served_from"].get("model", 0) < n
    assert sum(on["served_from"].values()) == n
    assert on["merged_pairs_checked"] + on["merged_pairs_unverifiable"] == n - on["model_items"]
    # repeats and edits alone could save half; merging different questions that mean the same may
    # save more (the learned decision does on the full workload), but never every call
    assert r["model_calls_saved_by_repeats_alone"] == pytest.approx(0.5, abs=0.01)
    assert 0 < r["model_calls_saved"] < 1
    assert 0 <= on["wrong_intent_rate"] <= 1


@pytest.mark.integration
@pytest.mark.heavy
def test_priority_quick(kafka: EmbeddedKafka, tmp_path: Path) -> None:
    r = _run("priority", kafka, tmp_path)
    assert r["capacity_rps"] > 0
    for arm in ("edf", "fifo"):
        a = r["arms"][arm]
        assert a["offered_rps"] == pytest.approx(1.5 * r["capacity_rps"], rel=0.01)
        assert a["answered"] == a["sent"] > 0
        classes = a["classes"]
        assert set(classes) == {"realtime", "interactive", "batch"}
        assert sum(c["sent"] for c in classes.values()) == a["sent"]
        assert 0.05 < classes["realtime"]["sent"] / a["sent"] < 0.16
        for c in classes.values():
            assert c["misses"] == c["deadline_exceeded"] + c["late_ok"] + c["lost"]
            assert 0 <= c["miss_rate"] <= 1


@pytest.mark.integration
@pytest.mark.heavy
def test_gateway_quick(kafka: EmbeddedKafka, tmp_path: Path) -> None:
    pytest.importorskip("pipeline.gateway")
    r = _run("gateway", kafka, tmp_path)
    for arm in ("surge", "sync"):
        a = r["arms"][arm]
        assert a["requests"] > 0
        assert a["ok"] >= 0.9 * a["requests"], a["error_samples"]
        assert a["requests_per_s"] > 0
        _sane_latency(a["latency_ok"])


# ---- surge and failover: pure parts ----------------------------------------------------------------
def _sent(rid: str, priority: str = "interactive", tier: str = "standard", acked: bool | None = True) -> Any:
    from pipeline.devtools.bench.surge import Sent

    return Sent(
        rid,
        0,
        priority,
        tier,
        "default",
        "unique",
        created_ms=1_000_000,
        lag_ms=0.0,
        step="s",
        partition=0,
        acked=acked,
    )


def _seen(rid: str, after_ms: float, **reply: Any) -> Any:
    from pipeline.devtools.bench.surge import Seen

    return Seen(rid, (1_000_000 + after_ms) / 1000, 0, 0, 0, {"request_id": rid, **reply})


@pytest.mark.skipif(not BANKING77.is_file(), reason="banking77 data not present")
def test_surge_workload_asks_only_unseen_questions_in_the_merging_mix() -> None:
    from pipeline.devtools.bench.surge import QuestionStream, unseen_questions
    from pipeline.guard import guard_allows

    holdout, trained = unseen_questions(BANKING77)
    stream = QuestionStream(holdout, exclude=trained)
    assert stream.excluded > 0, "held-out rows that repeat a training question are left out"
    items = [stream.next() for _ in range(4 * len(stream.pool))]  # two passes over the held-out pool
    kinds = [it.kind for it in items]
    assert abs(kinds.count("unique") / len(items) - 0.5) < 0.03
    assert abs(kinds.count("repeat") / len(items) - 0.3) < 0.03
    assert not [it.text for it in items if normalize(it.text) in trained], (
        "never a question it was trained on"
    )
    uniques = [it for it in items if it.kind == "unique"]
    assert len({normalize(u.text) for u in uniques}) == len(uniques), "unique means unique after normalising"
    for it in items:
        if it.kind != "unique":
            src = items[it.source]
            assert src.kind == "unique" and src.intent == it.intent and src.tenant == it.tenant
        if it.kind == "repeat":
            assert it.text == items[it.source].text
    # a second pass asks the same question with a customer's own number: the dedup guard keeps them apart
    later = uniques[len(stream.pool) :]
    assert later and all(any(ch.isdigit() for ch in u.text) for u in later)
    first = {u.intent: u.text for u in uniques[: len(stream.pool)] if not any(ch.isdigit() for ch in u.text)}
    pairs = [(first[u.intent], u.text) for u in later[:50] if u.intent in first]
    assert pairs and not any(guard_allows(a, b)[0] for a, b in pairs if a.split()[:3] == b.split()[:3])


def test_surge_users_stay_within_their_rate_at_the_peak() -> None:
    from collections import Counter

    from pipeline.devtools.bench.surge import TIER_MIX, Population, tenants_for
    from pipeline.settings import Settings

    s = Settings()
    peak, seconds = 300.0, 60
    pop = Population.for_rate(peak, s)
    picks = [pop.pick("default") for _ in range(int(peak * seconds))]
    per_user = Counter(user for _, _, user in picks)
    tier_of = {user: tier for tier, _, user in picks}
    for user, n in per_user.items():
        assert n / seconds <= 0.5 * getattr(s, f"user_rate_per_s_{tier_of[user]}"), user
    share = Counter(tier for tier, _, _ in picks)
    total = sum(w for _, w in TIER_MIX)
    for tier, w in TIER_MIX:
        assert abs(share[tier] / len(picks) - w / total) < 0.02
    classes = Counter(c for _, c, _ in picks)
    assert (
        abs(classes["realtime"] / len(picks) - 0.1) < 0.02 and abs(classes["batch"] / len(picks) - 0.4) < 0.02
    )
    assert tenants_for(peak, s) == 1 and tenants_for(10 * s.tenant_rate_per_s, s) >= 10


def test_surge_templates_are_judged_by_class_tier_and_level() -> None:
    from pipeline.devtools.bench.surge import settled_after, template_violation

    tpl = {"status": "ok", "served_from": "template", "finish_reason": "template", "degradation_level": 3}
    assert template_violation(tpl, _sent("a", "batch")) is None
    assert template_violation(tpl, _sent("a", "offline", "premium")) is None
    assert template_violation(tpl, _sent("a", "interactive", "free")) is None
    assert (
        template_violation(tpl, _sent("a", "interactive", "standard"))
        == "interactive standard-tier templated"
    )
    assert template_violation(tpl, _sent("a", "realtime", "free")) == "realtime templated"
    assert template_violation({**tpl, "degradation_level": 2}, _sent("a", "batch")) == "template at level 2"
    assert template_violation({"status": "ok", "served_from": "model"}, _sent("a", "realtime")) is None
    points = [(0.0, False), (1.0, True), (2.0, False), (3.0, True), (4.0, True)]
    assert settled_after(points, 0.5) == 2.5, "settled from the first point after the last bad one"
    assert settled_after(points, 3.0) == 0.0
    assert settled_after([*points, (5.0, False)], 0.0) is None, "not settled at the end: None"


def test_surge_class_summary_counts_each_kind_of_miss_once() -> None:
    from collections import defaultdict

    from pipeline.devtools.bench.surge import class_summary, exactly_once

    recs = [_sent(f"r{i}") for i in range(5)] + [_sent("failed", acked=False)]
    by_rid: dict[str, list[Any]] = defaultdict(list)
    by_rid["r0"] += [_seen("r0", 100, status="ok", served_from="model")]
    by_rid["r1"] += [_seen("r1", 900, status="ok", served_from="cache")]  # late
    by_rid["r2"] += [_seen("r2", 50, status="error", error={"code": "deadline_exceeded"})]
    by_rid["r3"] += [
        _seen("r3", 80, status="ok", served_from="template", finish_reason="template"),
        _seen("r3", 2000, status="ok", served_from="template", finish_reason="template"),
    ]
    c = class_summary(recs, by_rid, 500)  # r4: no reply
    counts = [c[k] for k in ("offered", "produce_failed", "answered", "missing", "duplicated")]
    assert counts == [6, 1, 4, 1, 1]
    assert (c["ok"], c["template"], c["errors"]) == (3, 1, {"deadline_exceeded": 1})
    assert (c["deadline_exceeded"], c["late_ok"], c["misses"], c["miss_rate"]) == (1, 1, 3, 0.6)
    assert c["latency_ok"]["max_ms"] == 900.0, "latency counts to the first reply"
    no_deadline = class_summary(recs, by_rid, None)
    assert (no_deadline["late_ok"], no_deadline["misses"]) == (0, 2), "no deadline: nothing is late"
    assert exactly_once(recs, by_rid) == {"acked": 5, "missing": 1, "duplicated": 1, "extra_replies": 1}


def test_failover_lists_each_realtime_miss_with_its_distance_to_a_window() -> None:
    from pipeline.devtools.bench.failover import realtime_misses

    recs = [_sent(f"r{k}", priority="realtime") for k in range(4)]
    for r, created in zip(recs, (995_000, 1_000_000, 1_008_000, 1_020_000), strict=True):
        r.created_ms = created
    by_rid = {
        "r0": [_seen("r0", after_ms=-4_900, status="ok")],  # 100 ms after it was sent: no miss
        "r1": [_seen("r1", after_ms=350, status="ok")],  # 350 ms: late
        "r3": [_seen("r3", after_ms=-19_900, status="error", error={"code": "deadline_exceeded"})],
    }  # r2 never answered
    spans = [(1_001.0, 1_005.0)]  # a window from 1 s to 5 s after r1 was sent
    out = realtime_misses(recs, by_rid, 200, spans, t0=1_000.0)
    assert [(m["at_s"], m["from_window_s"], m["code"]) for m in out] == [
        (0.0, -1.0, "late_ok"),
        (8.0, 3.0, "lost"),
        (20.0, 15.0, "deadline_exceeded"),
    ]
    assert out[0]["latency_ms"] == 350.0 and out[1]["latency_ms"] is None


def test_a_request_in_flight_at_a_kill_belongs_to_the_kill_s_window() -> None:
    from pipeline.devtools.bench.failover import in_failover

    spans = [(1_000.0, 1_010.0)]  # a kill at 1,000 s, recovered (with the margin) at 1,010 s

    def at(created_s: float, priority: str = "realtime") -> Any:
        r = _sent("r", priority=priority)
        r.created_ms = int(created_s * 1000)
        return r

    assert in_failover(at(999.9), 200, spans), "sent 100 ms before the kill, due 100 ms after it"
    assert in_failover(at(999.8), 200, spans), "due at the very kill"
    assert not in_failover(at(999.7), 200, spans), "due 100 ms before the kill: the steady state's"
    assert in_failover(at(1_005.0), 200, spans) and not in_failover(at(1_010.0), 200, spans)
    assert in_failover(at(996.0, "batch"), 5_000, spans), "a batch request's deadline is 5 s"
    assert not in_failover(at(999.9, "offline"), None, spans), "no deadline: where it was sent"
    assert in_failover(at(1_000.0, "offline"), None, spans)


def test_lag_sampler_sums_and_peaks_by_topic() -> None:
    from pipeline.devtools.bench.surge import LagSampler

    lag = LagSampler("127.0.0.1:1", "g", ["p.requests", "p.work.batch"])
    lag.samples = [
        (1.0, {"p.requests": 5, "p.work.batch": 1}),
        (2.0, None),
        (3.0, {"p.requests": 2, "p.work.batch": 9}),
    ]
    assert lag.totals() == [(1.0, 6), (3.0, 11)], "a failed sample (None) is left out"
    assert lag.peak_by_topic() == {"requests": 5, "work.batch": 9}
    assert lag.peak_by_topic(2.0, 4.0) == {"requests": 2, "work.batch": 9}


@pytest.mark.parametrize("scenario", ["surge", "failover"])
def test_surge_and_failover_fail_clearly_without_the_data(scenario: str, tmp_path: Path) -> None:
    with pytest.raises(BenchError, match="banking77 CSV not found"):
        run_bench(scenario, quick=True, json_path=tmp_path / "x.json", banking77_csv=tmp_path / "nope.csv")


# ---- surge and failover: quick runs against the real broker ---------------------------------------
@pytest.mark.integration
def test_reply_reader_counts_replies_it_had_not_read_live(kafka: EmbeddedKafka) -> None:
    """A load generator starved of CPU reads replies late; the run's count must not depend on it."""
    import asyncio
    import json as json_

    from aiokafka import AIOKafkaProducer

    from pipeline.admin import ensure_topics
    from pipeline.devtools.bench.surge import ReplyReader
    from pipeline.devtools.deployment import deployment_env, load_settings
    from pipeline.topics import TopicNames

    env = deployment_env(kafka.bootstrap, prefix="catchup.", app_id="catchup", data_dir="/tmp/unused")
    t = TopicNames("catchup.")

    async def main() -> tuple[int, int, dict[str, int], list[int]]:
        await ensure_topics(load_settings(env))
        p = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap)
        await p.start()
        try:
            await p.send_and_wait(t.replies, json_.dumps({"request_id": "before"}).encode(), key=b"x")
            reader = ReplyReader(kafka.bootstrap, t.replies)
            await reader.start()  # from the end: "before" is not this run's
            await p.send_and_wait(t.replies, json_.dumps({"request_id": "live"}).encode(), key=b"a")
            for _ in range(100):
                if "live" in reader.by_rid:
                    break
                await asyncio.sleep(0.1)
            await reader.stop()
            sent_ms = []
            for rid in ("r1", "r2", "r2"):  # r2 twice: a repeat stays a repeat
                md = await p.send_and_wait(
                    t.replies, json_.dumps({"request_id": rid}).encode(), key=rid.encode()
                )
                sent_ms.append(md.timestamp)
        finally:
            await p.stop()
        added = await reader.catch_up()
        again = await reader.catch_up()
        recv = [int(s.recv * 1000) for s in reader.by_rid["r1"] + reader.by_rid["r2"]]
        return (
            added,
            again,
            {k: len(v) for k, v in reader.by_rid.items()},
            [r - s for r, s in zip(recv, sent_ms, strict=True)],
        )

    added, again, counts, skew_ms = asyncio.run(main())
    assert counts == {"live": 1, "r1": 1, "r2": 2}, "this run's replies, each once, none from before"
    assert added == 3 and again == 0
    assert all(abs(x) <= 1 for x in skew_ms), "a reply read afterwards is timed by when it was produced"


@pytest.mark.integration
def test_trace_finds_where_an_unanswered_request_went(kafka: EmbeddedKafka) -> None:
    import asyncio
    import base64
    import json as json_

    from aiokafka import AIOKafkaProducer

    from pipeline.admin import ensure_topics
    from pipeline.devtools.bench.surge import trace_requests
    from pipeline.devtools.deployment import deployment_env, load_settings
    from pipeline.topics import TopicNames

    env = deployment_env(kafka.bootstrap, prefix="trace.", app_id="trace", data_dir="/tmp/unused")
    t = TopicNames("trace.")

    async def main() -> dict[str, Any]:
        await ensure_topics(load_settings(env))
        p = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap)
        await p.start()
        try:
            for rid in ("q1", "q2", "q3", "q4"):
                await p.send_and_wait(t.requests, json_.dumps({"request_id": rid}).encode(), key=b"u")
            await p.send_and_wait(t.work("batch"), json_.dumps({"request": {"request_id": "q2"}}).encode())
            raw = base64.b64encode(json_.dumps({"request_id": "q3"}).encode()).decode()
            await p.send_and_wait(
                t.deadletter, json_.dumps({"reason": "undecodable", "raw_b64": raw}).encode()
            )
            await p.send_and_wait(t.replies, json_.dumps({"request_id": "q4", "status": "ok"}).encode())
        finally:
            await p.stop()
        return await trace_requests(kafka.bootstrap, t, ["q1", "q2", "q3", "q4", "q10"])

    r = asyncio.run(main())
    s = r["summary"]
    assert s["traced"] == 5 and s["not on the request topic"] == 1, "q10 was never sent (and q1 is not q10)"
    assert s["never forwarded to a work topic, no reply"] == 1 and s["on a work topic, no reply"] == 1
    assert s["dead-lettered"] == 1 and s["reply_found_on_rescan (missed by the live reader)"] == 1
    assert r["requests"]["q3"]["deadletter"][0].endswith("undecodable")
    assert len(r["requests"]["q2"]["work"]) == 1 and r["requests"]["q2"]["work"][0].startswith(
        "trace.work.batch["
    )


@pytest.mark.integration
@pytest.mark.skipif(not BANKING77.is_file(), reason="banking77 data not present")
@pytest.mark.heavy
def test_surge_quick(kafka: EmbeddedKafka, tmp_path: Path) -> None:
    r = _run("surge", kafka, tmp_path, banking77_csv=BANKING77)
    limit = r["limit_rps"]
    assert limit > 0 and r["limit"]["batch_size"] > 1
    assert list(r["steps"]) == ["0.5L", "0.8L", "2L", "0.5L-after"]
    assert r["workload"]["holdout_rows_left_out_as_seen_in_training"] > 0
    total_sent = 0
    for name, step in r["steps"].items():
        mult = {"0.5L": 0.5, "0.8L": 0.8, "2L": 2.0, "0.5L-after": 0.5}[name]
        assert step["offered_rps"] == pytest.approx(mult * limit * r["plan"]["rate_scale"], rel=0.01)
        assert step["sent"] == pytest.approx(step["offered_rps"] * step["duration_s"], abs=1)
        total_sent += step["sent"]
        classes = step["classes"]
        assert set(classes) == {"realtime", "interactive", "batch", "offline"}
        assert sum(c["offered"] for c in classes.values()) == step["sent"]
        for c in classes.values():
            assert c["answered"] == c["offered"] - c["produce_failed"] - c["missing"]
            assert c["ok"] + sum(c["errors"].values()) == c["answered"]
            assert c["misses"] == c["deadline_exceeded"] + c["late_ok"] + c["missing"]
            if c["ok"]:
                _sane_latency(c["latency_ok"])
        assert step["scrapes"] > 0 and step["peak_rss_mib"] > 100, "the worker was watched"
        # a worker answering requests is busy, and each answer costs it some CPU (not a whole second)
        assert 0 < step["worker_cpu_cores"] <= (os.cpu_count() or 1) * 1.1
        assert 0 < step["worker_cpu_ms_per_answer"] < 1000
        assert step["max_degradation_level"] in (0, 1, 2, 3)
    # nothing lost on the quick path: every request answered exactly once, templates only where allowed
    assert r["replies"]["acked"] == total_sent and r["replies"]["produce_failed"] == 0
    assert r["replies"]["missing"] == 0, (r["trace_of_unanswered"].get("summary"), r.get("worker_log_tail"))
    assert r["replies"]["duplicated"] == 0 and r["replies"]["unexpected_reply_records"] == 0
    assert r["templates"]["violations"] == {}
    assert sum(r["kinds"].values()) == total_sent and r["kinds"]["unique"] > 0.35 * total_sent
    assert r["recovery"]["requests_before_surge_end_unanswered"] == 0
    assert r["recovery"]["backlog_replies_drained_after_s"] is not None
    names = {t["name"] for t in r["targets"]}
    assert {
        "0.8L error replies",
        "2L realtime miss rate",
        "peak RSS drift, second 0.5L step vs first",
    } <= names


@pytest.mark.integration
@pytest.mark.skipif(not BANKING77.is_file(), reason="banking77 data not present")
@pytest.mark.heavy
def test_failover_quick(kafka: EmbeddedKafka, tmp_path: Path) -> None:
    from pipeline.devtools.broker import _run_sync, metadata_answers

    bootstrap = kafka.bootstrap
    r = _run("failover", kafka, tmp_path, banking77_csv=BANKING77)
    assert kafka.bootstrap == bootstrap and r["broker_same_address_after_restart"]
    assert _run_sync(metadata_answers(kafka.bootstrap)), "the shared broker is back for the other tests"
    assert [e["kind"] for e in r["events"]] == ["sigkill", "sigterm", "broker"], "no worker exited by itself"
    for e in r["events"]:
        assert e["recovered_after_s"] is not None, e
        assert e["every_partition_served_after_s"] is not None and e["every_partition_served_after_s"] >= 0
        assert e["back_after_s"] is not None and e["back_after_s"] > 0
    assert r["events"][1]["exit_code"] == 0, "a worker exits cleanly on SIGTERM"
    # issue 10: served again within the session timeout + 3 s; at the default 6 s session that is 9 s
    # (the 10 s session before it gave 10.4-10.9 s here, 14-19 s in the overloaded full run)
    assert r["settings"]["session_timeout_s"] == 6.0
    assert r["events"][0]["every_partition_served_after_s"] <= 9.0, r["events"][0]
    assert r["partitions_with_traffic"] == [0, 1, 2, 3]
    assert r["baseline_assigned"] and r["baseline_assigned"] > 0
    # nothing lost on the quick path, through a SIGKILL, a SIGTERM and a broker restart
    assert r["acked"] == r["sent"] > 0 and r["produce_failed"] == 0
    assert r["lost"] == 0, (r["lost_examples"], r["trace_of_lost"].get("summary"))
    assert r["answered"] == r["acked"]
    assert r["repeats_that_differ"] == 0 and r["repeats"] < 0.1 * r["sent"]
    for where in ("inside_windows", "outside_windows"):
        for c in r["classes"][where].values():
            assert c["misses"] == c["deadline_exceeded"] + c["late_ok"] + c["missing"]
    offered = sum(c["offered"] for w in r["classes"].values() for c in w.values())
    assert offered == r["sent"], "each request in one of the windows, outside them, or the warm-up"
    assert sum(c["offered"] for c in r["classes"]["warm_up"].values()) > 0, "a warm-up load came first"
    assert len(r["windows"]) == 3 and all(b > a for a, b in r["windows"])
