"""Inputs written by a transactional producer (an exactly-once sink of Kafka Streams or Flink writes
this way, and writes an aborted transaction's records again in a later one): an aborted record never
happened, so it gets no reply, no decision and no place in any feature; every committed transaction
leaves a marker between its records, a gap in the offsets the risk stages' readers step over
(docs/architecture.md, "Transactional producers")."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from agents.risk import feature_config
from pipeline.devtools.bench.risk_check import check_decisions, read_arrivals
from tests.conftest import RELAXED, request
from tests.test_risk_integration import T0, event, start

pytestmark = pytest.mark.integration


async def test_events_committed_one_transaction_each_are_decided_and_aborted_ones_never(
    deployment: Any,
) -> None:
    d, _w, c = await start(deployment)
    producer = AIOKafkaProducer(bootstrap_servers=d.bootstrap, transactional_id="upstream-sink-1")
    await producer.start()
    try:
        accounts = [f"txn-acct-{i}" for i in range(8)]
        events = [event(f"t{i}", accounts[i % 8], T0 + i * 1_000, amount=10.0 + i) for i in range(200)]
        futs = {e["event_id"]: c.expect(e["event_id"]) for e in events}
        ghost = event("ghost", accounts[0], T0 + 50_500, amount=9_999.0)
        ghost_fut = c.expect("ghost")
        started = time.monotonic()
        for i, e in enumerate(events):
            async with producer.transaction():
                await producer.send(
                    d.topics.risk_events, value=json.dumps(e).encode(), key=e["account"].encode()
                )
            if i == 100:  # a transaction the upstream aborts: its event never happened
                await producer.begin_transaction()
                await producer.send(
                    d.topics.risk_events, value=json.dumps(ghost).encode(), key=ghost["account"].encode()
                )
                await producer.abort_transaction()
        _, pending = await asyncio.wait(futs.values(), timeout=120)
        took = time.monotonic() - started
        print(f"200 events, one transaction each: decided in {took:.1f} s")
        assert not pending, f"{len(pending)} of {len(futs)} events without a decision"
    finally:
        await producer.stop()
    await asyncio.sleep(2)
    assert not ghost_fut.done(), "an aborted transaction's event was decided"
    decisions = [dec for dec, _ in c.decisions]
    report = check_decisions(await read_arrivals(d.settings), decisions, feature_config(d.settings), futs)
    assert report["missing"] == 0 and report["mismatched_decisions"] == 0, report
    # the ghost's amount is in no decision's features: the account's sums are those of committed events
    after = [dec for dec in decisions if dec.account == accounts[0]]
    assert after and all("9999" not in json.dumps(dec.features) for dec in after), (
        "the aborted event's amount reached an account's features"
    )
    # and the commit keeps up: one question to the broker steps over every marker it has read past
    # (one marker per question and grace period left it near the start while reading went on)
    lag = await commit_lag(d, f"{d.env['SURGE_APP_ID']}-risk", d.topics.risk_events, within_s=20)
    assert max(lag.values()) <= 1, f"committed offsets behind the log's end (the last marker aside): {lag}"


async def commit_lag(d: Any, group: str, topic: str, within_s: float) -> dict[int, int]:
    """Per partition of ``topic``, how far ``group``'s committed offset is behind the log's end,
    polled until every partition is within one offset of it (a trailing marker) or ``within_s``."""
    admin = AIOKafkaAdminClient(bootstrap_servers=d.bootstrap)
    consumer = AIOKafkaConsumer(bootstrap_servers=d.bootstrap)
    await admin.start()
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(d.settings.partitions)]
        end = await consumer.end_offsets(tps)
        deadline = time.monotonic() + within_s
        while True:
            offsets = await admin.list_consumer_group_offsets(group)
            lag = {tp.partition: end[tp] - (offsets[tp].offset if tp in offsets else 0) for tp in tps}
            if max(lag.values()) <= 1 or time.monotonic() > deadline:
                return lag
            await asyncio.sleep(0.5)
    finally:
        await consumer.stop()
        await admin.close()


async def test_a_request_in_an_aborted_transaction_gets_no_reply_and_its_neighbours_do(
    deployment: Any,
) -> None:
    d = deployment(rate_limit_enabled="false", **RELAXED)
    d.worker()
    c = await d.client()
    producer = AIOKafkaProducer(bootstrap_servers=d.bootstrap, transactional_id="upstream-requests")
    await producer.start()

    async def write(rid: str) -> None:
        body = request(rid, "u-txn", f"question {rid}", reply_to=d.topics.replies)
        await producer.send(d.topics.requests, value=json.dumps(body).encode(), key=b"u-txn")

    try:
        awaited = {rid: c.expect(f"r-{rid}") for rid in ("before", "after")}
        ghost = c.expect("r-ghost")
        async with producer.transaction():
            await write("before")
        await producer.begin_transaction()
        await write("ghost")
        await producer.abort_transaction()
        async with producer.transaction():
            await write("after")
        replies = await d.replies(list(awaited.values()), 60)
    finally:
        await producer.stop()
    assert [r.status for r in replies] == ["ok", "ok"], replies
    await asyncio.sleep(2)
    assert not ghost.done(), "a request its producer aborted was answered"
    assert all(b'"r-ghost"' not in r.value for r in await d.read_topic(d.topics.replies, 2))
