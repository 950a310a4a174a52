"""Where reading starts and which offsets the log holds, asked of the real broker; and a worker
whose request topic is written by a transactional producer (markers leave holes in the offsets)
still commits everything it answered."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic, RecordsToDelete
from aiokafka.partitioner import DefaultPartitioner
from aiokafka.structs import OffsetAndMetadata

from agents.offset_oracle import OffsetOracle
from pipeline.devtools.broker import EmbeddedKafka
from pipeline.offsets import encode_done
from pipeline.records import now_ms
from pipeline.settings import Settings
from tests.conftest import RELAXED, request
from tests.test_transactional_producers import commit_lag

pytestmark = pytest.mark.integration


async def _topic(bootstrap: str) -> str:
    name = f"oracle-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(name, num_partitions=1, replication_factor=1)])
    finally:
        await admin.close()
    return name


async def _transactional_sends(
    bootstrap: str, topic: str, values: list[bytes], key: bytes = b"k", partition: int = 0
) -> None:
    """One transaction per record, all to ``partition``: each commit leaves a marker after its record."""
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap, transactional_id=f"tx-{uuid.uuid4().hex[:6]}", enable_idempotence=True
    )
    await producer.start()
    try:
        for value in values:
            async with producer.transaction():
                await producer.send_and_wait(topic, value, key=key, partition=partition)
    finally:
        await producer.stop()


async def test_start_is_the_committed_offset_else_the_log_start(kafka: EmbeddedKafka) -> None:
    topic = await _topic(kafka.bootstrap)
    group = f"g-{uuid.uuid4().hex[:6]}"
    producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap)
    await producer.start()
    for i in range(3):
        await producer.send_and_wait(topic, b"x%d" % i, partition=0)
    await producer.stop()
    oracle = OffsetOracle(Settings(broker=f"kafka://{kafka.bootstrap}", app_id=group))
    try:
        assert await oracle.start_of(topic, 0) == 0, "nothing committed: the log start"
        committer = AIOKafkaConsumer(
            bootstrap_servers=kafka.bootstrap, group_id=group, enable_auto_commit=False
        )
        await committer.start()
        committer.assign([TopicPartition(topic, 0)])
        await committer.commit({TopicPartition(topic, 0): OffsetAndMetadata(2, "")})
        assert await oracle.start_of(topic, 0) == 2
        assert await oracle.start_and_done(topic, 0) == (2, set()), "no metadata: nothing done"
        # a worker's commit names what it finished past the committed offset
        await committer.commit({TopicPartition(topic, 0): OffsetAndMetadata(1, encode_done({2, 4}, 1))})
        await committer.stop()
        assert await oracle.start_and_done(topic, 0) == (1, {2, 4})
    finally:
        await oracle.close()


async def test_starts_of_many_partitions_come_in_one_question_and_match_each_alone(
    kafka: EmbeddedKafka,
) -> None:
    # asked at every assignment for every source partition: committed (with what was done past it),
    # nothing committed (the log start), and a log whose start moved (records deleted)
    name = f"oracle-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap)
    await admin.start()
    await admin.create_topics([NewTopic(name, num_partitions=3, replication_factor=1)])
    producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap)
    await producer.start()
    for p in range(3):
        for i in range(4):
            await producer.send_and_wait(name, b"x%d" % i, partition=p)
    await producer.stop()
    await admin.delete_records({TopicPartition(name, 2): RecordsToDelete(3)})
    await admin.close()
    group = f"g-{uuid.uuid4().hex[:6]}"
    committer = AIOKafkaConsumer(bootstrap_servers=kafka.bootstrap, group_id=group, enable_auto_commit=False)
    await committer.start()
    committer.assign([TopicPartition(name, 0)])
    await committer.commit({TopicPartition(name, 0): OffsetAndMetadata(1, encode_done({2}, 1))})
    await committer.stop()
    oracle = OffsetOracle(Settings(broker=f"kafka://{kafka.bootstrap}", app_id=group))
    try:
        wanted = [(name, 0), (name, 1), (name, 2)]
        together = await oracle.starts_and_done(wanted)
        assert together == {(name, 0): (1, {2}), (name, 1): (0, set()), (name, 2): (3, set())}
        assert together == {tp: await oracle.start_and_done(*tp) for tp in wanted}
        assert await oracle.starts_and_done([]) == {}
    finally:
        await oracle.close()


async def test_the_records_held_step_over_transaction_markers(kafka: EmbeddedKafka) -> None:
    topic = await _topic(kafka.bootstrap)
    await _transactional_sends(kafka.bootstrap, topic, [b"a", b"b"])  # a@0, marker@1, b@2, marker@3
    oracle = OffsetOracle(Settings(broker=f"kafka://{kafka.bootstrap}", app_id="oracle-probe"))
    try:
        assert await oracle.held_from(topic, 0, 0) == [0, 2], "the records, not the markers"
        assert await oracle.held_from(topic, 0, 0, 1) == [0]
        assert await oracle.held_from(topic, 0, 1) == [2], "offset 1 is a marker, not a record"
        assert await oracle.held_from(topic, 0, 3) == [], "only a marker up to the end"
        # asked by a reader handed a later record: the fetch alone, from the offset (or the log start)
        assert await oracle.held_from(topic, 0, 1, known_later=True) == [2]
        # no fetch is left waiting at the log's end between questions: it would hold the next
        # question's back by up to its wait (aiokafka keeps one fetch in flight per broker)
        probe = oracle._probe
        assert probe is not None and probe.paused() == {TopicPartition(topic, 0)}
    finally:
        await oracle.close()


async def test_requests_from_a_transactional_producer_are_answered_and_committed(deployment) -> None:
    d = deployment(model="echo", rate_limit_enabled="false", cache_enabled="false", **RELAXED)
    d.worker()
    c = await d.client()
    n = 6
    values = []
    for i in range(n):
        req = request(f"tx{i}", "tx-user", f"transactional question {i}")
        req.update(created_at=now_ms(), reply_to=c.reply_topic)
        values.append(json.dumps(req).encode())
    futs = [c.expect(f"r-tx{i}") for i in range(n)]
    # the user's own partition (murmur2), where intake handles its records rather than sending them on
    parts = list(range(d.settings.partitions))
    home = DefaultPartitioner()(b"tx-user", parts, parts)
    await _transactional_sends(d.bootstrap, d.topics.requests, values, key=b"tx-user", partition=home)
    replies = await d.replies(futs, 60)
    assert all(r.status == "ok" for r in replies)
    # the commit steps over the markers between the records: it reaches the last record + 1, one
    # short of the log's end (the last marker)
    lag = await commit_lag(d, d.env["SURGE_APP_ID"], d.topics.requests, within_s=30)
    assert lag[home] <= 1, f"commit {lag[home]} offsets behind the end: a marker held the run back"


async def test_a_start_that_fails_leaves_no_consumer_open(monkeypatch: pytest.MonkeyPatch) -> None:
    """The broker away when a partition is assigned: the question fails, and the consumers made for
    it are stopped (each failed start left two open, holding their connections, one pair per
    question asked during the outage)."""
    import gc
    import warnings

    from aiokafka.errors import KafkaConnectionError

    import agents.offset_oracle

    oracle = OffsetOracle(Settings.load(broker="kafka://127.0.0.1:1"))
    made: list[AIOKafkaConsumer] = []

    def tracked(*args: Any, **kw: Any) -> AIOKafkaConsumer:
        made.append(AIOKafkaConsumer(*args, **kw))
        return made[-1]

    monkeypatch.setattr(agents.offset_oracle, "AIOKafkaConsumer", tracked)
    for _ in range(2):
        with pytest.raises(KafkaConnectionError):
            await oracle.start_of("anything", 0)
    assert len(made) == 4
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        made.clear()
        gc.collect()
    unclosed = [w for w in caught if "Unclosed AIOKafkaConsumer" in str(w.message)]
    assert unclosed == [], unclosed
