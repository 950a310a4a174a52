"""Whole batches handed to the producer (agents/batch_send.py), on the real broker: records keep their
order per partition, a batch's acknowledgement gives the offset of its last record, and writers
sharing a topic take turns instead of starving one another."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import KafkaTimeoutError

from agents.batch_send import BatchSender, send_batches

pytestmark = pytest.mark.integration

PARTITIONS = 2


@pytest.fixture
async def topic(kafka: Any) -> AsyncIterator[str]:
    name = f"batch-send-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, PARTITIONS, 1)])
        yield name
        await admin.delete_topics([name])
    finally:
        await admin.close()


async def _producer(bootstrap: str, request_timeout_ms: int = 30_000) -> AIOKafkaProducer:
    p = AIOKafkaProducer(
        bootstrap_servers=bootstrap, acks="all", max_batch_size=4096, request_timeout_ms=request_timeout_ms
    )
    await p.start()
    return p


async def _read(bootstrap: str, topic: str) -> dict[int, list[tuple[bytes | None, bytes]]]:
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tps = [TopicPartition(topic, p) for p in range(PARTITIONS)]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        ends = await consumer.end_offsets(tps)
        out: dict[int, list[tuple[bytes | None, bytes]]] = {p: [] for p in range(PARTITIONS)}
        while [tp for tp in tps if await consumer.position(tp) < ends[tp]]:
            for tp, records in (await consumer.getmany(timeout_ms=500)).items():
                out[tp.partition] += [(r.key, r.value) for r in records]
        return out
    finally:
        await consumer.stop()


async def test_batches_keep_the_order_per_partition_and_give_the_last_offset(kafka: Any, topic: str) -> None:
    producer = await _producer(kafka.bootstrap)
    try:
        await producer.partitions_for(topic)
        # 1 KiB values in batches of at most 4 KiB: several batches per partition, one record alone
        # larger than a batch
        records = {
            p: [(f"k{p}-{i}".encode(), bytes([65 + i % 26]) * (1024 if i != 7 else 9000)) for i in range(20)]
            for p in range(PARTITIONS)
        }
        sent = await send_batches(producer, topic, records)
        assert len(sent) > 2 * PARTITIONS, "the records should have needed several batches"
        last = {p: -1 for p in range(PARTITIONS)}
        for b in sent:
            last[b.partition] = max(last[b.partition], b.last_offset(await b.ack))
        assert sum(b.count for b in sent) == 40
    finally:
        await producer.stop()
    assert last == {0: 19, 1: 19}
    assert await _read(kafka.bootstrap, topic) == records


WRITERS, BATCHES = 8, 300


async def _writers(send: Any) -> list[Any]:
    """``WRITERS`` writers each queueing ``BATCHES`` one-record batches on partition 0 without waiting
    for acknowledgements in between; what each returned (its acknowledgements, or its error)."""

    async def writer(w: int) -> list[Any]:
        acks = []
        for i in range(BATCHES):
            acks += [b.ack for b in await send({0: [(f"w{w}".encode(), f"{w}-{i}".encode() * 100)]})]
        return [await a for a in acks]

    return await asyncio.gather(*(writer(w) for w in range(WRITERS)), return_exceptions=True)


async def test_writers_sharing_a_topic_take_turns(kafka: Any, topic: str) -> None:
    """Through :class:`BatchSender` every writer's batches are queued, its records in its order."""
    producer = await _producer(kafka.bootstrap, request_timeout_ms=2_000)
    sender = BatchSender(producer)
    try:
        await producer.partitions_for(topic)
        results = await asyncio.wait_for(_writers(lambda recs: sender.send(topic, recs)), 120)
    finally:
        await producer.stop()
    assert not [r for r in results if isinstance(r, BaseException)], results
    got = (await _read(kafka.bootstrap, topic))[0]
    assert len(got) == WRITERS * BATCHES
    for w in range(WRITERS):
        mine = [v for k, v in got if k == f"w{w}".encode()]
        assert mine == [f"{w}-{i}".encode() * 100 for i in range(BATCHES)], w


async def test_writers_without_turns_starve(kafka: Any, topic: str) -> None:
    """What :class:`BatchSender` is for: the same writers calling ``send_batches`` directly (aiokafka
    queues a batch only while the partition has none waiting, and gives up once the producer's wait,
    here 2 s, is used up) and some give up with ``KafkaTimeoutError``."""
    producer = await _producer(kafka.bootstrap, request_timeout_ms=2_000)
    try:
        await producer.partitions_for(topic)
        results = await asyncio.wait_for(_writers(lambda recs: send_batches(producer, topic, recs)), 120)
    finally:
        await producer.stop()
    assert any(isinstance(r, KafkaTimeoutError) for r in results), results
