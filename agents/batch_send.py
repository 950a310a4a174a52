"""Records handed to the Kafka producer as whole batches: one producer call per partition and batch
instead of one per record (docs/architecture.md, "Risk: the chain").

The risk stages write four or five records per event (a changelog record per changed entity state,
the decision), and the producer's per-record ``send`` (a future, a metadata check and a place in the
accumulator for each) cost more of a worker's core than the records themselves. Records bound for
one partition go into a batch built here, closed (so no other send appends to it) and queued behind
whatever that partition already has queued, so per partition they keep the order they were given in.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from aiokafka import AIOKafkaProducer


@dataclass(frozen=True, slots=True)
class SentBatch:
    """One batch queued for ``partition``: ``ack`` resolves to the broker's metadata of its first
    record (or raises the send's error); it holds ``count`` records."""

    partition: int
    ack: asyncio.Future[Any]
    count: int

    def last_offset(self, meta: Any) -> int:
        """The offset of the batch's last record, given what ``ack`` resolved to."""
        return int(meta.offset) + self.count - 1


class BatchSender:
    """Queues whole batches on one aiokafka producer, one writer per topic at a time.

    aiokafka queues a batch only while its partition has no batch waiting (``send_batch`` waits for
    the last one to go out, then looks again). Several stages write the same topics (any stage may
    decide, three feed the ip stage's repartition topic); taking turns without a lock, a busy writer
    found a batch of another waiting each time it looked and gave up after seconds
    (``KafkaTimeoutError``, which stops the worker). Taking turns by topic, first come first served,
    each writer waits for at most the batches already queued."""

    def __init__(self, producer: AIOKafkaProducer) -> None:
        self.producer = producer
        self._locks: dict[str, asyncio.Lock] = {}

    async def send(
        self, topic: str, by_partition: Mapping[int, Sequence[tuple[bytes | None, bytes | None]]]
    ) -> list[SentBatch]:
        """Queue ``(key, value)`` records (a None value: a tombstone) per partition of ``topic`` in as
        few batches as the producer's batch size allows (a record larger than that gets a batch of its
        own), in the order given per partition."""
        lock = self._locks.get(topic)
        if lock is None:
            lock = self._locks[topic] = asyncio.Lock()
        async with lock:
            return await send_batches(self.producer, topic, by_partition)


async def send_batches(
    producer: AIOKafkaProducer,
    topic: str,
    by_partition: Mapping[int, Sequence[tuple[bytes | None, bytes | None]]],
) -> list[SentBatch]:
    """Queue ``(key, value)`` records per partition of ``topic`` as whole batches. Waits while the
    producer holds a batch of that partition not yet sent; a caller that is not the topic's only
    writer goes through :class:`BatchSender`."""
    sent: list[SentBatch] = []
    for partition, records in by_partition.items():
        builder = producer.create_batch()
        count = 0
        for key, value in records:
            if builder.append(key=key, value=value, timestamp=None) is None:
                # full: an empty batch takes any one record, so this one starts the next batch
                sent.append(await _queue(producer, builder, topic, partition, count))
                builder = producer.create_batch()
                builder.append(key=key, value=value, timestamp=None)
                count = 0
            count += 1
        if count:
            sent.append(await _queue(producer, builder, topic, partition, count))
    return sent


async def _queue(
    producer: AIOKafkaProducer, builder: Any, topic: str, partition: int, count: int
) -> SentBatch:
    builder.close()
    ack = await producer.send_batch(builder, topic, partition=partition)
    return SentBatch(partition, ack, count)
