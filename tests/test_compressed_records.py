"""Compressed records on the topics clients write (docs/architecture.md, "Security"): the broker
checks ``max.message.bytes`` against a batch as sent, so a producer's gzip batch of 50 KB held a
50 MB record that each consumer decompressed whole, past every size check of the worker. surge
creates those topics uncompressed: the broker decompresses such a batch, and refuses it when it is
too large decompressed. Real broker, topics as ``ensure_topics`` creates them."""

from __future__ import annotations

import json
import uuid

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import MessageSizeTooLargeError

from pipeline.admin import ensure_topics
from pipeline.devtools.broker import EmbeddedKafka
from pipeline.settings import Settings
from pipeline.topics import TopicNames

MB = 1 << 20
#: decompressed, far past the broker's 1 MB max.message.bytes; about 20 KB as gzip
BOMB = 20 * MB

pytestmark = pytest.mark.integration


async def test_a_compressed_bomb_is_refused_and_a_compressed_request_still_goes(kafka: EmbeddedKafka) -> None:
    prefix = f"z{uuid.uuid4().hex[:8]}."
    settings = Settings.load(broker=f"kafka://{kafka.bootstrap}", topic_prefix=prefix, partitions=1)
    names = TopicNames(prefix)
    # the risk events topic as the risk workers create it; the control topic stored as sent
    await ensure_topics(settings, extra=[names.risk_events, prefix + "as-sent"])
    producer = AIOKafkaProducer(
        bootstrap_servers=kafka.bootstrap,
        compression_type="gzip",
        max_request_size=BOMB + MB,
        max_batch_size=BOMB + MB,
        request_timeout_ms=60_000,
    )
    await producer.start()
    try:
        bomb = json.dumps({"request_id": "r-bomb", "user_id": "u1", "prompt": "a" * BOMB}).encode()
        # the topic as a producer's own would be: the broker keeps the small batch, bomb inside
        await producer.send_and_wait(prefix + "as-sent", bomb, key=b"u1")
        for topic in (names.requests, names.risk_events):
            with pytest.raises(MessageSizeTooLargeError):
                await producer.send_and_wait(topic, bomb, key=b"u1")
        # a compressed batch of an ordinary request is taken, and read back as sent
        small = json.dumps({"request_id": "r-small", "user_id": "u1", "prompt": "hi " * 300}).encode()
        sent = await producer.send_and_wait(names.requests, small, key=b"u1")
    finally:
        await producer.stop()
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka.bootstrap, enable_auto_commit=False)
    await consumer.start()
    try:
        tp = TopicPartition(names.requests, sent.partition)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        records = [r for batch in (await consumer.getmany(tp, timeout_ms=10_000)).values() for r in batch]
    finally:
        await consumer.stop()
    assert [r.value for r in records] == [small], "only the ordinary request is on the request topic"
