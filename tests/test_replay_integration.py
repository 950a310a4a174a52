"""``surge replay`` and ``surge shadow`` against the real broker (docs/architecture.md, "Replay"):
the range by timestamp, isolation from live state, determinism, the report's numbers on a recorded
history with known differences, and shadow outputs that never reach a reply topic."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from pipeline.admin import changelog_topics
from pipeline.client import partitions_of
from pipeline.records import now_ms
from pipeline.replay import compare, plan
from pipeline.replay.runner import ReplayOptions, run_replay
from pipeline.replay.shadow import Shadow, ShadowOptions
from tests.conftest import RELAXED, request

pytestmark = pytest.mark.integration

#: the live deployments of these tests: the echo model without caches, so no embedder loads
LIVE = {"cache_enabled": "false", "dedup_enabled": "false", **RELAXED}


async def _end_offsets(bootstrap: str, topics: list[str]) -> dict[str, int]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await consumer.start()
    try:
        out = {}
        for t in topics:
            # the consumer's own metadata, refreshed until it knows the topic (``topics()`` fetches
            # the names into a metadata object of its own: every topic read as empty)
            parts = await partitions_of(consumer, t)
            assert parts, f"no topic {t}"
            ends = await consumer.end_offsets([TopicPartition(t, p) for p in parts])
            out[t] = sum(ends.values())
        return out
    finally:
        await consumer.stop()


async def _live_state(d: Any) -> dict[str, Any]:
    """Committed offsets of the live group, and the end of every live topic and changelog."""
    s = d.settings
    admin = AIOKafkaAdminClient(bootstrap_servers=d.bootstrap)
    await admin.start()
    try:
        committed = await admin.list_consumer_group_offsets(s.app_id)
        topics = sorted(
            t for t in await admin.list_topics() if t.startswith((s.topic_prefix, f"{s.app_id}-"))
        )
    finally:
        await admin.close()
    return {
        "committed": {f"{tp.topic}/{tp.partition}": m.offset for tp, m in committed.items()},
        "ends": await _end_offsets(d.bootstrap, topics),
    }


async def _topics(bootstrap: str) -> set[str]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap)
    await consumer.start()
    try:
        return set(await consumer.topics())
    finally:
        await consumer.stop()


async def test_replay_finds_its_range_leaves_live_state_alone_and_repeats_itself(
    deployment, tmp_path: Path
) -> None:
    d = deployment(**LIVE)
    d.worker()
    c = await d.client()

    async def send(reqs: list[dict[str, Any]]) -> None:
        futs = [await c.submit(r) for r in reqs]
        await c.producer.flush()
        await d.replies(futs, 60)

    await send([request(f"before-{i}", f"u{i % 3}") for i in range(6)])
    await asyncio.sleep(1.2)
    from_ms = now_ms()
    inside = [request(f"in-{i}", f"u{i % 3}", f"question {i}", priority="batch") for i in range(12)]
    # a free-tier burst: the replay must refuse the same requests (buckets charged at created_at)
    inside += [
        request(f"burst-{i}", "free-user", "burst", tier="free", priority="offline") for i in range(14)
    ]
    inside.append(request("tight", "u1", "tight deadline", deadline_ms=1, created_at=now_ms() - 50))
    inside.append(request("bad-reply-to", "u2", "hi", reply_to=d.topics.work("realtime")))
    await send(inside)
    # written without a key: the live intake sends it on to its user's partition, so the range holds
    # it twice (as written, and as sent on); the replay asks the model once, as live traffic did
    unkeyed = request("unkeyed", "u0", "a question written without a key", created_at=now_ms())
    unkeyed["reply_to"] = c.reply_topic
    fut = c.expect(unkeyed["request_id"])
    await c.send_raw(None, json.dumps(unkeyed).encode())
    await d.replies([fut], 60)
    inside.append(unkeyed)
    await c.send_raw(b"u1", b"not json at all")
    await asyncio.sleep(1.2)
    to_ms = now_ms()
    await asyncio.sleep(0.3)
    await send([request(f"after-{i}", f"u{i % 3}") for i in range(5)])
    await asyncio.sleep(1.5)  # the live worker commits what it finished
    live_replies = {r.request_id: r for r in c.replies}
    assert sum(r.error is not None and r.error.code == "rate_limited" for r in live_replies.values()) >= 3
    assert (
        live_replies["r-tight"].error is not None
        and live_replies["r-tight"].error.code == "deadline_exceeded"
    )
    before = await _live_state(d)

    results = []
    out = tmp_path / "replay"
    for n in (1, 2):
        # both into one --out folder: the second worker must not take the tables the first left
        # there for its own (their changelogs are gone; Faust would refuse to start on them)
        opts = ReplayOptions(
            topic="requests",
            from_ms=from_ms,
            to_ms=to_ms,
            out_dir=out,
            replay_id=f"t{n}",
            quiet=True,
        )
        results.append(await run_replay(opts, d.settings))
        assert any((out / "state").rglob("*.db")), "the replay worker kept its tables in its folder"
    first, second = results

    # the range by timestamp: exactly the requests sent inside it
    keys = {k[1] for k in first.replies}
    assert keys == {r["request_id"] for r in inside}
    rep = first.report
    # and the record that is not JSON; the unkeyed request's original is left out (its copy is in)
    assert rep["replay"]["records"] == len(inside) + 1
    assert rep["counts"] == {
        "replayed": len(inside),
        "joined": len(inside),
        "missing_live": 0,
        "missing_replay": 0,
    }
    # unchanged model and settings: live answers reproduced, the one difference explained
    assert rep["agreement"]["differing"] == 1 and rep["differences_by_cause"] == {"live_deadline_exceeded": 1}
    assert rep["agreement"]["unexplained"] == 0
    assert json.loads(first.report_path.read_text())["agreement"]["same_outcome"] == len(inside) - 1
    assert first.plot_path.stat().st_size > 10_000

    # determinism: the same range twice gives the same answers and decisions
    assert first.replies.keys() == second.replies.keys()
    for k, r in first.replies.items():
        other = second.replies[k]
        assert compare.outcome(r) == compare.outcome(other), k
        assert r.get("model_version") == other.get("model_version")

    # isolation: the live group's committed offsets, live topics and table changelogs are unchanged
    after = await _live_state(d)
    assert after == before
    assert set(changelog_topics(d.settings)) <= set(before["ends"])
    topics = await _topics(d.bootstrap)
    assert not any(first.names.owns(t) or second.names.owns(t) for t in topics), "replay topics are deleted"


async def test_replay_copies_only_committed_rules(deployment) -> None:
    """The live rules are read as the risk workers read them (``read_committed``): a rule written in
    a transaction that was aborted was never applied live, and the replay does not copy it."""
    from agents.risk import ensure_risk_topics
    from pipeline.replay.runner import read_live_rules

    d = deployment()
    await ensure_risk_topics(d.settings)
    topic = d.topics.risk_rules
    plain = AIOKafkaProducer(bootstrap_servers=d.bootstrap, acks="all")
    tx = AIOKafkaProducer(bootstrap_servers=d.bootstrap, transactional_id=f"{d.settings.app_id}-abort")
    await plain.start()
    await tx.start()
    try:
        await plain.send_and_wait(topic, b'{"rule": "before"}', key=b"before", partition=0)
        await tx.begin_transaction()
        await tx.send_and_wait(topic, b'{"rule": "aborted"}', key=b"aborted", partition=0)
        await tx.abort_transaction()
        # the abort marker last on the partition: read to its end, without the aborted rule
        rules = await asyncio.wait_for(read_live_rules(d.settings, topic), 30)
        assert [k for k, _ in rules] == [b"before"]
        await plain.send_and_wait(topic, b'{"rule": "after"}', key=b"after", partition=0)
    finally:
        await tx.stop()
        await plain.stop()
    assert [k for k, _ in await read_live_rules(d.settings, topic)] == [b"before", b"after"]


async def test_report_on_a_recorded_history_with_known_differences(deployment, tmp_path: Path) -> None:
    """A recorded history written by hand: requests on the live topic, and live replies as they were
    (a template, a deadline miss, another model version, a cached answer of another question, an
    answer missing), then one replay with the echo model."""
    d = deployment(**LIVE)
    s = d.settings
    from pipeline.admin import ensure_topics

    # the history written here is dated by hand: the request topic keeps the producer's timestamps
    # (a live one is stamped by the broker, and its history is dated as it arrived)
    await ensure_topics(s, broker_time=False)
    producer = AIOKafkaProducer(bootstrap_servers=d.bootstrap, acks="all")
    await producer.start()
    t0 = now_ms() - 60_000
    texts = {f"h{i}": f"history question {i}" for i in range(10)}
    try:
        for i, (rid, text) in enumerate(texts.items()):
            req = request(rid, "alice", text, priority="offline", created_at=t0 + i * 100)
            await producer.send_and_wait(
                d.topics.requests, json.dumps(req).encode(), key=b"alice", timestamp_ms=t0 + i * 100
            )

        def reply(rid: str, **kw: Any) -> dict[str, Any]:
            base = {
                "request_id": f"r-{rid}",
                "user_id": "alice",
                "status": "ok",
                "answer": texts[rid],
                "finish_reason": "stop",
                "served_from": "model",
                "model_version": "echo-1",
                "timings": {"total_ms": 20.0},
            }
            return {**base, **kw}

        live = [reply(f"h{i}") for i in range(5)]
        live += [
            reply(
                "h5",
                answer="We are busy",
                served_from="template",
                finish_reason="template",
                degradation_level=3,
            ),
            {
                "request_id": "r-h6",
                "user_id": "alice",
                "status": "error",
                "error": {"code": "deadline_exceeded", "message": "late"},
                "timings": {"total_ms": 900.0},
            },
            reply("h7", answer="history question 7, older model", model_version="echo-0"),
            reply("h8", answer="history question 3", served_from="cache"),
        ]
        for i, r in enumerate(live):  # h9's reply was never recorded
            await producer.send_and_wait(
                d.topics.replies, json.dumps(r).encode(), key=b"alice", timestamp_ms=t0 + 2000 + i
            )
    finally:
        await producer.stop()
    opts = ReplayOptions(topic="requests", from_ms=t0, to_ms=t0 + 1000, out_dir=tmp_path / "r", quiet=True)
    res = await run_replay(opts, s)
    rep = res.report
    assert rep["counts"] == {"replayed": 10, "joined": 9, "missing_live": 1, "missing_replay": 0}
    assert rep["agreement"]["same_outcome"] == 5 and rep["agreement"]["rate"] == pytest.approx(
        5 / 9, abs=1e-6
    )
    assert rep["differences_by_cause"] == {
        "live_deadline_exceeded": 1,
        "live_degraded": 1,
        "model_version_differs": 1,
        "live_shared_answer": 1,
    }
    assert rep["answers"]["both_ok"] == 8 and rep["answers"]["exact_match"] == 5
    assert rep["served_from_shift"] == {
        "cache->model": 1,
        "model->model": 6,
        "none->model": 1,
        "template->model": 1,
    }
    ed = sorted(rep["_series"]["edit_distance"])
    expected = compare.normalized_edit_distance("history question 7, older model", "history question 7")
    assert ed[-1] == 1.0 and pytest.approx(expected) in ed
    assert rep["latency_ms"]["live_created_to_reply"]["p50_ms"] == 20.0
    assert rep["replay"]["speed_factor"] > 0 and rep["replay"]["records"] == 10
    assert set(json.loads(res.report_path.read_text())) >= {
        "agreement",
        "answers",
        "differences_by_cause",
        "replay",
    }
    # a replay whose worker cannot start fails with the worker's error and leaves no topic behind
    from pipeline.exceptions import SurgeError

    bad = ReplayOptions(
        topic="requests",
        from_ms=t0,
        to_ms=t0 + 1000,
        out_dir=tmp_path / "bad",
        replay_id="bad",
        model="hf",
        sets={"model_path": str(tmp_path / "no-such-model")},
        quiet=True,
        start_timeout_s=120,
    )
    with pytest.raises(SurgeError, match="exited"):
        await run_replay(bad, s)
    assert not any(
        plan.ReplayNames(s.app_id, s.topic_prefix, "bad").owns(t) for t in await _topics(d.bootstrap)
    )


async def test_shadow_outputs_never_reach_a_reply_topic(deployment, tmp_path: Path) -> None:
    d = deployment(**LIVE)
    d.worker()
    c = await d.client()
    s = d.settings
    gateway_topic = f"{d.topics.replies}.gw-1"
    from pipeline.admin import ensure_topics

    await ensure_topics(s, extra=[gateway_topic])
    opts = ShadowOptions(
        percent=50, out_dir=tmp_path / "shadow", shadow_id="s1", delete_topics=True, quiet=True
    )
    shadow = Shadow(opts, s, partitions=s.partitions)
    task = asyncio.create_task(shadow.run())
    deadline = time.monotonic() + 180
    while not (tmp_path / "shadow" / "READY").exists():
        assert not task.done(), task.exception()
        assert time.monotonic() < deadline, "shadow not ready"
        await asyncio.sleep(0.2)
    reqs = [request(f"s-{i}", f"u{i % 4}", f"shadow question {i}") for i in range(40)]
    reqs.append(request("s-gw", "u9", "via a gateway topic", reply_to=f"{d.topics.replies}.gw-1"))
    futs = [await c.submit(r) for r in reqs[:-1]]
    await c.send_raw(b"u9", json.dumps(reqs[-1]).encode())
    await c.producer.flush()
    await d.replies(futs, 60)
    want = {(r["user_id"], r["request_id"]) for r in reqs if plan.sampled(r["request_id"], 50)}
    assert 5 < len(want) < 36
    await shadow.collector.wait_for(want, 60)
    await asyncio.sleep(1.0)
    shadow.stop.set()
    report = await asyncio.wait_for(task, 60)

    assert report["shadow"]["sampled"] == len(want)
    assert report["counts"]["joined"] == len(want) and report["agreement"]["rate"] == 1.0
    on_file = json.loads((tmp_path / "shadow" / "shadow.json").read_text())
    assert on_file["shadow"]["final"] and on_file["counts"]["replayed"] == len(want)
    # every live reply topic holds exactly the live replies: one per request, none from the shadow
    live = await d.read_topic(d.topics.replies, min_count=40, timeout_s=5)
    ids = [json.loads(r.value)["request_id"] for r in live]
    assert sorted(ids) == sorted(r["request_id"] for r in reqs[:-1])
    gw = await d.read_topic(gateway_topic, min_count=1, timeout_s=5)
    assert [json.loads(r.value)["request_id"] for r in gw] == ["r-s-gw"]
    # the shadow read with its own group; the live group is untouched by it, and its topics are gone
    admin = AIOKafkaAdminClient(bootstrap_servers=d.bootstrap)
    await admin.start()
    try:
        groups = {g[0] for g in await admin.list_consumer_groups()}
    finally:
        await admin.close()
    assert shadow.group_id in groups and shadow.group_id != s.app_id
    assert not any(shadow.names.owns(t) for t in await _topics(d.bootstrap))


async def _ready_shadow(shadow: Shadow) -> asyncio.Task[dict[str, Any]]:
    """``shadow`` running, once its READY file says it mirrors."""
    task = asyncio.create_task(shadow.run())
    deadline = time.monotonic() + 180
    while not shadow.ready_path.exists():
        assert not task.done(), task.exception()
        assert time.monotonic() < deadline, "shadow not ready"
        await asyncio.sleep(0.2)
    return task


async def _joined(shadow: Shadow, want: set[tuple[str, str]]) -> None:
    """Until ``shadow`` holds the candidate's and the live reply of every request of ``want``."""
    await shadow.collector.wait_for(want, 60)
    for _ in range(150):  # the live replies, read from the time the sampler resumed at
        if want <= set(shadow.live):
            return
        await asyncio.sleep(0.2)


async def test_a_restarted_shadow_joins_the_requests_it_catches_up_on(deployment, tmp_path: Path) -> None:
    """A shadow restarted with the same id and folder resumes from its sampler's committed offsets,
    so it copies the requests sent while it was down; their live replies are read from the time it
    resumes at (not from the end), so every one is joined. Its READY file is gone whenever it is not
    running."""
    d = deployment(**LIVE)
    d.worker()
    c = await d.client()
    s = d.settings
    opts = ShadowOptions(percent=100, out_dir=tmp_path / "shadow", shadow_id="again", quiet=True)
    first = Shadow(opts, s, partitions=s.partitions)
    task = await _ready_shadow(first)
    before = [request(f"a-{i}", f"u{i % 4}", f"before the restart {i}") for i in range(4)]
    await d.replies([await c.submit(r) for r in before], 60)
    await _joined(first, {(r["user_id"], r["request_id"]) for r in before})
    first.stop.set()
    report = await asyncio.wait_for(task, 60)
    assert report["counts"]["joined"] == len(before)
    assert not first.ready_path.exists()
    # while no shadow runs, live traffic goes on
    during = [request(f"b-{i}", f"u{i % 4}", f"while it was down {i}") for i in range(8)]
    await d.replies([await c.submit(r) for r in during], 60)
    again = Shadow(opts, s, partitions=s.partitions)
    task = await _ready_shadow(again)
    await _joined(again, {(r["user_id"], r["request_id"]) for r in during})
    again.stop.set()
    report = await asyncio.wait_for(task, 60)
    assert report["shadow"]["sampled"] == len(during) and report["counts"]["replayed"] == len(during)
    assert report["counts"]["joined"] == len(during) and report["agreement"]["rate"] == 1.0
    assert report["shadow"]["error"] is None and not again.ready_path.exists()


async def test_risk_replay_warms_windows_and_compares_decisions(deployment, tmp_path: Path) -> None:
    """Risk events: the 24 h before --from warm the windows (not compared), the live rules are
    copied, decisions are joined on event_id with flips, score deltas, feature mismatches and recall."""
    from agents.risk import ensure_risk_topics
    from pipeline.risk.simulate import as_event
    from pipeline.risk_client import RiskClient
    from pipeline.riskops import RISK_READY, demo_events

    d = deployment(**RELAXED)
    await ensure_risk_topics(d.settings)
    w = d.worker(role="risk", wait=False)
    await asyncio.to_thread(w.wait_ready, RISK_READY, 180)
    c = RiskClient(d.bootstrap, events_topic=d.topics.risk_events, decisions_topic=d.topics.risk_decisions)
    await c.start()
    d.clients.append(c)
    events = demo_events(300, seed=5)

    async def decide(batch: list[dict[str, Any]]) -> None:
        futs = [await c.send(as_event(e)) for e in batch]
        await c.producer.flush()
        await d.replies(futs, 90)

    await decide(events[:100])
    await asyncio.sleep(1.2)
    from_ms = now_ms()
    await decide(events[100:])
    await asyncio.sleep(1.2)
    to_ms = now_ms()
    labels = tmp_path / "labels.jsonl"
    labels.write_text(
        "".join(json.dumps({"event_id": e["event_id"], "label": e["label"]}) + "\n" for e in events)
    )
    opts = ReplayOptions(
        topic="risk-events",
        from_ms=from_ms,
        to_ms=to_ms,
        out_dir=tmp_path / "risk",
        labels_path=labels,
        quiet=True,
    )
    res = await run_replay(opts, d.settings)
    rep = res.report
    assert rep["replay"]["records"] == 200 and rep["replay"]["warmup_records"] == 100
    assert set(res.replies) == {e["event_id"] for e in events[100:]}
    assert rep["counts"]["joined"] == 200 and rep["counts"]["missing_replay"] == 0
    # the same rules (copied) and the same model: decisions agree but for named causes
    assert rep["agreement"]["rate"] >= 0.95, rep["differences_by_cause"]
    assert "unexplained" not in rep["differences_by_cause"]
    assert {d["rule_version"] for d in res.replies.values()} == {
        json.loads(r.value)["rule_version"]
        for r in await d.read_topic(d.topics.risk_decisions, min_count=300)
    }
    assert set(rep) >= {"decision_flips", "score_delta", "feature_mismatches", "recall_at_1pct_fpr"}
    assert rep["score_delta"]["abs"]["p95"] is not None
