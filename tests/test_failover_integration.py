"""Failover on the real broker: redeliveries answered identically, SIGTERM without duplicates, a broker
restart under load, and two workers sharing the load through a kill."""

from __future__ import annotations

import asyncio
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaProducer

from pipeline.devtools.broker import EmbeddedKafka
from pipeline.devtools.procs import WorkerProcess
from pipeline.metrics import scrape
from tests.conftest import Deployment, request

pytestmark = [pytest.mark.integration, pytest.mark.heavy]

ECHO = {
    "model": "echo",
    "rate_limit_enabled": "false",
    "deadline_realtime_ms": "60000",
    "deadline_interactive_ms": "60000",
    "deadline_batch_ms": "120000",
    "deadline_offline_ms": "120000",
}


def repeats(replies: list[Any]) -> tuple[int, list[str]]:
    """(how many replies were repeats, request_ids whose repeats differ from the first reply)."""
    by_id: dict[str, list[Any]] = defaultdict(list)
    for r in replies:
        by_id[r.request_id].append(r)
    extra = sum(len(rs) - 1 for rs in by_id.values())
    differing = [rid for rid, rs in by_id.items() if any(x != rs[0] for x in rs[1:])]
    return extra, differing


async def locate(d: Deployment, request_ids: list[str]) -> dict[str, object]:
    """Where unanswered requests are: their work-topic records and the group's committed offsets."""
    from aiokafka.admin import AIOKafkaAdminClient

    found: dict[str, object] = {}
    for prio in ("realtime", "interactive", "batch", "offline"):
        for r in await d.read_topic(d.topics.work(prio), timeout_s=3):
            for rid in request_ids:
                if f'"request_id":"{rid}"'.encode() in (r.value or b""):
                    found.setdefault(rid, []).append(f"{r.topic}[{r.partition}]@{r.offset}")  # type: ignore[union-attr]
    admin = AIOKafkaAdminClient(bootstrap_servers=d.bootstrap)
    await admin.start()
    try:
        offsets = await admin.list_consumer_group_offsets(d.env["SURGE_APP_ID"])
    finally:
        await admin.close()
    found["committed"] = {
        f"{tp.topic}[{tp.partition}]": m.offset for tp, m in offsets.items() if "work" in tp.topic
    }
    return found


async def test_a_request_read_again_gets_the_recorded_reply(deployment) -> None:
    """A redelivery (the same request record, or its work item, read again after a crash) re-sends
    the recorded reply instead of computing a new one."""
    d = deployment(**ECHO, echo_delay_ms="5")
    d.worker()
    c = await d.client()
    first = await c.request(request("once", "alice", "what is my balance?"), timeout_s=60)
    assert first.status == "ok"
    # the same request record again: intake answers from the reply book
    again = c.expect("r-once")
    await c.send_raw(b"alice", json.dumps(request("once", "alice", "what is my balance?")).encode())
    assert (await asyncio.wait_for(again, 30)) == first
    # its work item again (as if intake had forwarded it twice): inference answers from the book
    items = await d.read_topic(d.topics.work("interactive"), min_count=1)
    assert len(items) == 1
    again = c.expect("r-once")
    producer = AIOKafkaProducer(bootstrap_servers=d.bootstrap)
    await producer.start()
    try:
        await producer.send_and_wait(d.topics.work("interactive"), items[0].value, key=items[0].key)
    finally:
        await producer.stop()
    assert (await asyncio.wait_for(again, 30)) == first
    assert "surge_replies_repeated_total 2.0" in d.workers[0].metrics()
    # what was alive at start-up is out of the collector's reach: Faust's gc.collect() per table on
    # every rebalance no longer walks it with the event loop stopped (agents/lifecycle.py)
    status = d.workers[0].status()
    frozen = status["gc_frozen_objects"]
    assert isinstance(frozen, int) and frozen > 50_000, frozen
    # young collections only every 50,000 allocations (SURGE_GC_YOUNG_THRESHOLD_OBJECTS)
    assert status["gc_thresholds"][0] == 50_000
    # a worker started with the defaults runs its event loop on uvloop (SURGE_EVENT_LOOP)
    assert status["event_loop"] == "uvloop"
    # and every collection since is timed (surge_gc_pause_seconds): young ones are rare with the
    # worker's threshold, but Faust's stores collect once per table on each assignment
    samples = scrape(d.workers[0].metrics())
    timed = sum(samples[("surge_gc_pause_seconds_count", (("generation", str(g)),))] for g in range(3))
    assert timed > 0, "no garbage collection was timed"


async def test_a_request_read_again_while_in_flight_gets_one_reply(deployment) -> None:
    """A rebalance whose drain timed out hands a worker its own partition back: it reads records
    again whose first copies are still in the model. Each is acked with its first copy's reply and
    gets no second reply record (a repeat every such rebalance used to send)."""
    d = deployment(**ECHO, echo_delay_ms="3000", cache_enabled="false", dedup_enabled="false")
    d.worker()
    c = await d.client()
    fut = await c.submit(request("slow", "alice", "a question the model takes its time over"))
    await c.producer.flush()
    items = await d.read_topic(d.topics.work("interactive"), min_count=1)
    producer = AIOKafkaProducer(bootstrap_servers=d.bootstrap)
    await producer.start()
    try:  # the same work item again while the first copy is in the model
        await producer.send_and_wait(d.topics.work("interactive"), items[0].value, key=items[0].key)
    finally:
        await producer.stop()
    (first,) = await d.replies([fut], 60)
    assert first.status == "ok"
    await asyncio.sleep(2.0)  # a second reply would be sent with the first
    on_topic = [
        r for r in await d.read_topic(d.topics.replies, min_count=1) if b'"r-slow"' in (r.value or b"")
    ]
    assert len(on_topic) == 1, f"{len(on_topic)} reply records for one request read twice"
    assert len([r for r in c.replies if r.request_id == "r-slow"]) == 1
    assert d.workers[0].status()["in_flight"] == 0
    tp = f"{d.topics.work('interactive')}[{items[0].partition}]"
    for _ in range(40):  # both copies acked: the group's offset passes the second one
        if (await locate(d, []))["committed"].get(tp) == items[0].offset + 2:  # type: ignore[union-attr]
            break
        await asyncio.sleep(0.25)
    else:
        raise AssertionError(f"the second copy was never acked: {await locate(d, [])}")


async def test_two_workers_sigterm_rolling_restart_gives_no_duplicates(deployment) -> None:
    d = deployment(**ECHO, echo_delay_ms="10", max_batch_size="8", session_timeout_s="6")
    w1 = d.worker(worker_id="a")
    w2 = d.worker(worker_id="b", data_dir=str(d.tmp / "data-b"))
    c = await d.client()
    n = 600
    futs = []
    sent = [request(i, f"u{i % 12}", f"line {i}", priority=("batch", "offline")[i % 2]) for i in range(n)]
    pending_at_sigterm = []  # requests unanswered as each SIGTERM is sent: each stop is under load

    async def send(part: list[dict[str, object]], stop: WorkerProcess) -> None:
        for i, req in enumerate(part):
            futs.append(await c.submit(req))
            if i == 150:
                await c.producer.flush()
                pending_at_sigterm.append(sum(not f.done() for f in futs))
                stop.terminate()  # SIGTERM: stop taking work, drain, commit, leave the group
            if i % 50 == 0:
                await asyncio.sleep(0.25)
        await c.producer.flush()

    await send(sent[:350], w1)
    await asyncio.to_thread(w1.wait_exit, 60)
    d.workers.remove(w1)
    d.worker(worker_id="a")
    await send(sent[350:], w2)  # the second stop while the rest of the stream arrives
    await asyncio.to_thread(w2.wait_exit, 60)
    assert len(pending_at_sigterm) == 2 and min(pending_at_sigterm) > 0, pending_at_sigterm
    done, pending = await asyncio.wait(futs, timeout=120)
    if pending:
        missing = sorted({r["request_id"] for r in sent} - {r.request_id for r in c.replies})
        status = [w.status() for w in d.workers if w.running]
        where = await locate(d, missing[:5])
        raise AssertionError(
            f"{len(missing)} never answered, e.g. {missing[:10]}; {where}; workers: {status}"
        )
    replies = [f.result() for f in done]
    assert all(r.status == "ok" for r in replies), [r.error for r in replies if r.status != "ok"][:3]
    await asyncio.sleep(2.0)
    extra, differing = repeats(c.replies)
    assert not differing
    assert extra == 0, f"a graceful stop must not repeat replies ({extra} repeats)"


async def test_broker_restart_under_load_loses_nothing(deployment, tmp_path: Path) -> None:
    broker = EmbeddedKafka(tmp_path / "own-kafka", partitions=4, heap_mb=384)
    broker.start()
    try:
        # batches of 8 at 200 ms each: a backlog of seconds when the broker goes down
        d = Deployment(broker, tmp_path / "dep", **{**ECHO, "echo_delay_ms": "200", "max_batch_size": "8"})
        d.worker()
        c = await d.client()
        futs = [await c.submit(request(i, f"u{i % 8}", f"before {i}")) for i in range(150)]
        await c.producer.flush()
        await d.replies(futs[:20], 60)
        pending_at_restart = sum(not f.done() for f in futs)
        assert pending_at_restart > 0, "every request was answered before the restart: nothing under load"
        await asyncio.to_thread(broker.restart)
        futs += [await c.submit(request(1000 + i, f"u{i % 8}", f"after {i}")) for i in range(150)]
        await c.producer.flush()
        replies = await d.replies(futs, 240)
        assert len({r.request_id for r in replies}) == 300
        assert all(r.status == "ok" for r in replies), [r.error for r in replies if r.status != "ok"][:3]
        _, differing = repeats(c.replies)
        assert not differing
        await d.close()
    finally:
        broker.stop()
