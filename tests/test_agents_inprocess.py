"""The intake and inference agents running inside the test process, on the real broker.

Each test starts the worker ``surge worker`` would run (tests/inprocess_worker.py) in the test's
event loop, talks to it through Kafka like any client, and also reads its state directly (its acker,
its metrics registry): a failure shows the agent's own traceback instead of a subprocess log. The
echo model answers with the prompt. See docs/architecture.md, "The path of a request" and
"Guarantees".
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.partitioner import DefaultPartitioner
from confluent_kafka import Producer
from faust.types.tuples import FutureMessage

from agents.runtime import Runtime
from pipeline.client import SurgeClient
from pipeline.compat import (
    forget_topic_metadata,
    kafka_producer,
    producer_backlog,
    refresh_metadata,
    wake_producer,
)
from pipeline.devtools.broker import EmbeddedKafka, free_port
from pipeline.keys import reply_key
from pipeline.records import DeadLetter, InferenceReply, InferenceRequest, WorkItem, encode, now_ms
from pipeline.terms import PRIORITIES
from pipeline.topics import TopicNames
from tests.conftest import Deployment, request
from tests.inprocess_worker import running_worker

pytestmark = pytest.mark.integration

#: the worker under test: no embedder to load (exact cache only), and deadlines no test here meets
INPROCESS_ENV = {
    "dedup_enabled": "false",
    "semantic_cache_enabled": "false",
    "rate_limit_enabled": "false",
    **{f"deadline_{p}_ms": "60000" for p in PRIORITIES},
}
#: how long a reply may take
REPLY_TIMEOUT_S = 30.0


def book_key(rec: dict[str, Any], topic: str) -> str:
    """The reply-book key of the request record ``rec`` answered on ``topic``."""
    req = InferenceRequest.model_validate(rec)
    return reply_key(req.tenant, req.user_id, req.request_id, topic, req.digest)


@dataclass
class Running:
    """A deployment served by one in-process worker, and a started client of its replies topic."""

    deployment: Deployment
    rt: Runtime
    client: SurgeClient

    @property
    def topics(self) -> TopicNames:
        return self.deployment.topics

    async def client_of(self, reply_topic: str) -> SurgeClient:
        """Another started client, reading ``reply_topic`` (stopped with the deployment)."""
        d = self.deployment
        c = SurgeClient(d.bootstrap, requests_topic=d.topics.requests, reply_topic=reply_topic)
        d.clients.append(c)
        await c.start()
        return c

    async def replies(self, *futures: asyncio.Future[InferenceReply]) -> list[InferenceReply]:
        """The replies of ``futures``, in order (the client's sends are flushed first)."""
        await self.client.producer.flush()
        return list(await asyncio.wait_for(asyncio.gather(*futures), REPLY_TIMEOUT_S))

    async def settled(self) -> None:
        """Wait until every record the worker took on has its outputs on the broker: nothing sent
        so far can make it produce another record after this."""
        assert await self.rt.acker.wait_idle(REPLY_TIMEOUT_S), "the worker still has records in flight"

    async def records(self, topic: str, min_count: int = 0) -> list[Any]:
        """Every record of ``topic``, from the beginning (waiting for ``min_count`` of them)."""
        return await self.deployment.read_topic(topic, min_count, timeout_s=REPLY_TIMEOUT_S)

    async def count(self, topic: str) -> int:
        """How many records ``topic`` holds (its partitions' end minus start offsets): exact once
        :meth:`settled`, where reading until nothing more comes could stop early."""
        consumer = AIOKafkaConsumer(bootstrap_servers=self.deployment.bootstrap, enable_auto_commit=False)
        await consumer.start()
        try:
            await refresh_metadata(consumer)
            tps = [TopicPartition(topic, p) for p in consumer.partitions_for_topic(topic) or ()]
            assert tps, f"no topic {topic}"
            ends, starts = await consumer.end_offsets(tps), await consumer.beginning_offsets(tps)
            return sum(ends[tp] - starts[tp] for tp in tps)
        finally:
            await consumer.stop()

    def metric(self, name: str, **labels: str) -> float:
        """A sample of the worker's own metrics registry (0 when never set)."""
        value = self.rt.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


@contextlib.asynccontextmanager
async def inprocess(
    kafka: EmbeddedKafka, tmp: Path, reply_suffixes: tuple[str, ...] = (), **env: str
) -> AsyncIterator[Running]:
    """An isolated deployment on the session broker, served by one worker in this process;
    ``reply_suffixes``: extra reply topics ``<prefix>replies.<suffix>`` to create."""
    d = Deployment(kafka, tmp, web_port=str(free_port()), **{**INPROCESS_ENV, **env})
    extra = [d.topics.replies + f".{s}" for s in reply_suffixes]
    async with running_worker(d.settings, extra) as (_, rt):
        try:
            yield Running(d, rt, await d.client())
        finally:
            # the client's tasks end before the worker checks what it left running; the worker
            # still reads the topics
            await d.close(delete_topics=False)


async def test_each_priority_class_gets_exactly_one_echo_reply_on_its_own_reply_topic(
    kafka: EmbeddedKafka, tmp_path: Path
) -> None:
    async with inprocess(kafka, tmp_path, reply_suffixes=PRIORITIES) as w:
        reply_to = {p: f"{w.topics.replies}.{p}" for p in PRIORITIES}
        sent = {
            p: request(p, f"user-{p}", f"a {p} question", priority=p, reply_to=reply_to[p])
            for p in PRIORITIES
        }
        # one client per class, each reading only its class's reply topic
        clients = {p: await w.client_of(reply_to[p]) for p in PRIORITIES}
        futures = [await clients[p].submit(req) for p, req in sent.items()]
        for c in clients.values():
            await c.producer.flush()
        answered = await asyncio.wait_for(asyncio.gather(*futures), REPLY_TIMEOUT_S)
        await w.settled()
        assert [r.request_id for r in answered] == [f"r-{p}" for p in PRIORITIES]
        for p in PRIORITIES:
            assert await w.count(reply_to[p]) == 1, f"{p}: not exactly one reply on {reply_to[p]}"
            records = await w.records(reply_to[p], 1)
            assert records[0].key == f"user-{p}".encode()
            reply = InferenceReply.model_validate_json(records[0].value)
            assert (reply.request_id, reply.status, reply.error) == (f"r-{p}", "ok", None)
            assert reply.answer == f"a {p} question" and reply.finish_reason == "stop"
            assert (reply.priority, reply.served_from, reply.model_version) == (p, "model", "echo-1")
            assert w.metric("surge_requests_total", priority=p, status="ok", served_from="model") == 1
        assert await w.count(w.topics.replies) == 0, "a reply went to the default replies topic"
        assert await w.count(w.topics.deadletter) == 0


async def test_an_invalid_record_gets_an_error_reply_and_a_dead_letter_and_serving_goes_on(
    kafka: EmbeddedKafka, tmp_path: Path
) -> None:
    async with inprocess(kafka, tmp_path) as w:
        bad_priority = json.dumps(
            {"request_id": "bad-prio", "user_id": "alice", "prompt": "hi", "priority": "urgent"}
        )
        bad_reply_to = json.dumps(
            {
                "request_id": "bad-to",
                "user_id": "alice",
                "prompt": "hi",
                "reply_to": w.topics.work("realtime"),
            }
        )
        not_json = b"{not json"
        errors = [w.client.expect("bad-prio"), w.client.expect("bad-to")]
        for raw in (bad_priority.encode(), bad_reply_to.encode(), not_json):
            await w.client.send_raw(b"alice", raw)
        good = await w.client.submit(request("good", "alice", "still served"))
        prio_error, reply_to_error, ok = await w.replies(*errors, good)
        await w.settled()

        assert ok.status == "ok" and ok.answer == "still served"
        for reply in (prio_error, reply_to_error):
            assert reply.status == "error" and reply.error is not None and reply.answer is None
            assert reply.error.code == "invalid_request", reply.error
        assert prio_error.error is not None and "priority" in prio_error.error.message
        assert reply_to_error.error is not None and "reply_to" in reply_to_error.error.message
        # the error went to the default replies topic, never to the internal topic the record named
        assert await w.count(w.topics.work("realtime")) == 0
        assert await w.count(w.topics.replies) == 3, "one reply per readable record"
        ids = [
            InferenceReply.model_validate_json(r.value).request_id
            for r in await w.records(w.topics.replies, 3)
        ]
        assert sorted(ids) == ["bad-prio", "bad-to", "r-good"]
        assert await w.count(w.topics.deadletter) == 3

        letters = [DeadLetter.model_validate_json(r.value) for r in await w.records(w.topics.deadletter, 3)]
        assert [base64.b64decode(dl.raw_b64) for dl in letters] == [
            bad_priority.encode(),
            bad_reply_to.encode(),
            not_json,
        ]
        for dl in letters:
            assert (dl.reason, dl.source_topic, dl.key_b64) == (
                "invalid_request",
                w.topics.requests,
                base64.b64encode(b"alice").decode(),
            )
        assert w.metric("surge_deadletter_total", reason="invalid_request") == 3


async def test_records_from_a_librdkafka_producer_byte_order_marks_flaws_and_future_dates(
    kafka: EmbeddedKafka, tmp_path: Path
) -> None:
    """A producer that is not aiokafka (confluent-kafka: librdkafka, its own partitioner for keys)
    writes what such producers write: a JSON text with a byte order mark (served), records with a
    flaw away from their ids (an over-long integer, bytes that are not UTF-8: an error reply naming
    the request, and a dead letter each), and real-time requests dated an hour ahead (by created_at,
    or by the record's own timestamp), whose deadlines count from the record's time or the worker's
    clock plus the clock slack, not from that hour."""
    producer = Producer({"bootstrap.servers": kafka.bootstrap})
    async with inprocess(kafka, tmp_path) as w:
        ok, huge, latin1 = w.client.expect("r-bom"), w.client.expect("r-huge"), w.client.expect("r-latin1")
        ahead = w.client.expect("r-ahead")
        hour_ahead = now_ms() + 3_600_000
        records = [
            b"\xef\xbb\xbf" + json.dumps(request("bom", "carol", "with a byte order mark")).encode(),
            b'{"request_id": "r-huge", "user_id": "carol", "prompt": "x", "max_tokens": 1'
            + b"0" * 5000
            + b"}",
            b'{"request_id": "r-latin1", "user_id": "carol", "prompt": "caf\xe9 au lait"}',
            json.dumps(
                request("ahead", "carol", "dated an hour ahead", priority="realtime", created_at=hour_ahead)
            ).encode(),
        ]
        for raw in records:
            producer.produce(w.topics.requests, key=b"carol", value=raw)
        # no created_at, but the record's own timestamp (the producer's choice) an hour ahead, and
        # ten minutes behind: the request topic keeps the broker's time instead (LogAppendTime)
        stamped, past = w.client.expect("r-stamped"), w.client.expect("r-past")
        value = json.dumps(request("stamped", "carol", "stamped an hour ahead", priority="realtime"))
        producer.produce(w.topics.requests, key=b"carol", value=value.encode(), timestamp=hour_ahead)
        value = json.dumps(request("past", "carol", "stamped ten minutes ago", priority="realtime"))
        producer.produce(w.topics.requests, key=b"carol", value=value.encode(), timestamp=now_ms() - 600_000)
        assert producer.flush(30) == 0, "librdkafka did not deliver every record"
        served, huge_error, latin1_error, ahead_reply, stamped_reply, past_reply = await w.replies(
            ok, huge, latin1, ahead, stamped, past
        )
        await w.settled()
        read_by = now_ms()

        assert (served.status, served.answer) == ("ok", "with a byte order mark")
        for reply in (huge_error, latin1_error):
            assert reply.status == "error" and reply.error is not None
            assert reply.error.code == "invalid_request", reply.error
        assert latin1_error.error is not None and "not UTF-8" in latin1_error.error.message
        assert await w.count(w.topics.deadletter) == 2
        assert ahead_reply.status == "ok"
        # stamped ten minutes ago, it would have been refused as 10 minutes late; served now
        assert stamped_reply.status == "ok" and past_reply.status == "ok", past_reply.error
        on_topic = await w.records(w.topics.requests, 6)
        # librdkafka's crc32 partitioner may put carol off her murmur2 partition: intake sends the
        # record on to that one, and handles it there
        n = w.deployment.settings.partitions
        home = DefaultPartitioner()(b"carol", list(range(n)), list(range(n)))
        (sent,) = [r for r in on_topic if b"r-ahead" in r.value and r.partition == home]
        assert all(abs(r.timestamp - read_by) < 60_000 for r in on_topic), "a producer's timestamp was kept"
        items = {
            item["request"]["request_id"]: item
            for item in (json.loads(r.value) for r in await w.records(w.topics.work("realtime"), 3))
        }
        # INPROCESS_ENV gives every class 60 s; from the hour ahead it would be 3,660 s
        assert items["r-ahead"]["created_at_ms"] == sent.timestamp + 1_000
        assert items["r-ahead"]["deadline_at_ms"] == sent.timestamp + 1_000 + 60_000
        # the worker's clock when it read the record, plus the slack
        assert items["r-stamped"]["created_at_ms"] <= read_by + 1_000
        assert items["r-stamped"]["deadline_at_ms"] <= read_by + 1_000 + 60_000


async def test_a_key_near_the_record_limit_gets_a_small_error_reply_and_a_dead_letter_under_1_mib(
    kafka: EmbeddedKafka, tmp_path: Path
) -> None:
    """A default cluster refuses records over 1 MiB; the session broker takes 8 MiB, so the sizes
    are checked here: the error reply named the whole 700 KB key, and the dead letter (the key in
    its message, base64'd, and as its own key) came to 2.4 MB, which a default cluster refuses on
    every try until the worker stops."""
    async with inprocess(kafka, tmp_path) as w:
        error = w.client.expect("r-bigkey")
        await w.client.send_raw(b"k" * 700_000, json.dumps(request("bigkey", "carol", "hi")).encode())
        good = await w.client.submit(request("after", "carol", "still served"))
        refused, ok = await w.replies(error, good)
        await w.settled()

        assert ok.status == "ok" and refused.error is not None and refused.error.code == "invalid_request"
        assert "(700000 bytes)" in refused.error.message
        (reply_record,) = [r for r in await w.records(w.topics.replies, 2) if b"r-bigkey" in r.value]
        assert len(reply_record.value) < 1_000
        (letter,) = await w.records(w.topics.deadletter, 1)
        assert len(letter.key) + len(letter.value) < 10_000
        dl = DeadLetter.model_validate_json(letter.value)
        assert (dl.key_bytes, dl.key_truncated, letter.key) == (700_000, True, b"k" * 1024)


async def test_a_reply_topic_that_does_not_exist_is_refused_and_never_created(
    kafka: EmbeddedKafka, tmp_path: Path
) -> None:
    """The session broker creates topics on request, as many clusters do: a reply sent to a missing
    topic would create it, one topic per name a client makes up (and wait for its metadata on a
    cluster that creates none). The request gets an error on the default replies topic instead."""
    async with inprocess(kafka, tmp_path, reply_suffixes=("team-a",)) as w:
        made_up = [f"{w.topics.replies}.made-up-{i}" for i in range(20)]
        refused = [w.client.expect(f"mallory-{i}") for i in range(len(made_up))]
        for i, topic in enumerate(made_up):
            raw = json.dumps(
                request(f"x{i}", "mallory", "hi", reply_to=topic) | {"request_id": f"mallory-{i}"}
            )
            await w.client.send_raw(b"mallory", raw.encode())
        team = await w.client_of(f"{w.topics.replies}.team-a")
        served = await team.submit(request("team", "alice", "to my team's topic", reply_to=team.reply_topic))
        await team.producer.flush()
        errors = await w.replies(*refused)
        (ok,) = await asyncio.wait_for(asyncio.gather(served), REPLY_TIMEOUT_S)
        await w.settled()

        assert (ok.status, ok.answer) == ("ok", "to my team's topic")
        for reply, topic in zip(errors, made_up, strict=True):
            assert reply.error is not None and reply.error.code == "invalid_request"
            assert f"reply_to topic {topic!r} does not exist" in reply.error.message
        assert await w.count(w.topics.replies) == len(made_up)  # the errors came on the default topic
        assert await w.count(w.topics.deadletter) == len(made_up)
        admin = AIOKafkaAdminClient(bootstrap_servers=w.deployment.bootstrap)
        await admin.start()
        try:
            assert not set(made_up) & set(await admin.list_topics()), "a reply created a topic"
        finally:
            await admin.close()
        assert w.rt.reply_topics.probes == len(made_up) + 1  # one question per name


async def test_a_reply_topic_deleted_after_intake_gets_a_dead_letter_not_a_stalled_worker(
    kafka: EmbeddedKafka, tmp_path: Path
) -> None:
    """A client names its own reply topic, then deletes it while its request waits for the model.
    The producer waited for the gone topic's metadata, holding every reply queued behind it, and
    then stopped the worker (on a broker that creates no topics); on this one, which creates them,
    the reply created the topic again. Now the reply goes to the dead-letter topic, the request is
    acked, and the next user's reply comes as usual."""
    async with inprocess(kafka, tmp_path, reply_suffixes=("gone",), echo_delay_ms="1500") as w:
        gone = f"{w.topics.replies}.gone"
        doomed = await w.client.submit(
            request("doomed", "mallory", "reply to a topic I delete", reply_to=gone)
        )
        await w.client.producer.flush()
        admin = AIOKafkaAdminClient(bootstrap_servers=w.deployment.bootstrap)
        await admin.start()
        try:
            await asyncio.sleep(0.5)  # intake has checked the topic; the model is busy with it
            await admin.delete_topics([gone])
            (after,) = await w.replies(await w.client.submit(request("after", "alice", "my own question")))
            await w.settled()
            assert after.status == "ok" and after.answer == "my own question"
            assert gone not in await admin.list_topics(), "a reply created the deleted topic again"
        finally:
            await admin.close()
        assert not doomed.done(), "the reply reached no topic the client could read"
        letters = [DeadLetter.model_validate_json(r.value) for r in await w.records(w.topics.deadletter, 1)]
        assert [(d.source_topic, d.reason) for d in letters] == [(gone, "reply_topic_missing")]
        assert b"reply to a topic I delete" in base64.b64decode(letters[0].raw_b64)
        assert w.metric("surge_deadletter_total", reason="reply_topic_missing") == 1


async def test_a_reply_topic_that_refuses_the_reply_gets_a_dead_letter_not_a_stopped_worker(
    kafka: EmbeddedKafka, tmp_path: Path
) -> None:
    """A client names a reply topic of its own whose max.message.bytes its reply exceeds: the broker
    refuses the reply for good. The worker retried it, then stopped; the next owner read the request
    again, re-sent the recorded reply and stopped too. Now the reply is dead-lettered (reason
    ``reply_refused``), the request acked, and the worker goes on serving."""
    async with inprocess(kafka, tmp_path) as w:
        tiny = f"{w.topics.replies}.tiny"
        admin = AIOKafkaAdminClient(bootstrap_servers=w.deployment.bootstrap)
        await admin.start()
        try:
            await admin.create_topics([NewTopic(tiny, 1, 1, topic_configs={"max.message.bytes": "1000"})])
        finally:
            await admin.close()
        text = "a question far longer than its reply topic takes " * 60
        refused = await w.client.submit(request("refused", "mallory", text, reply_to=tiny))
        await w.client.producer.flush()
        letters = [DeadLetter.model_validate_json(r.value) for r in await w.records(w.topics.deadletter, 1)]
        assert [(d.source_topic, d.reason) for d in letters] == [(tiny, "reply_refused")]
        assert "MessageSizeTooLargeError" in letters[0].message
        (after,) = await w.replies(await w.client.submit(request("after", "alice", "my own question")))
        assert after.status == "ok" and after.answer == "my own question"
        await w.settled()
        assert not refused.done(), "the reply reached no topic the client could read"
        assert w.metric("surge_deadletter_total", reason="reply_refused") == 1


async def test_a_redelivered_request_gets_the_recorded_reply_byte_for_byte(
    kafka: EmbeddedKafka, tmp_path: Path
) -> None:
    async with inprocess(kafka, tmp_path) as w:
        req = request("again", "bob", "answer me once", priority="batch")
        (first,) = await w.replies(await w.client.submit(req))
        assert first.status == "ok" and first.served_from == "model" and first.answer == "answer me once"
        (second,) = await w.replies(await w.client.submit(req))
        await w.settled()

        assert second == first
        assert await w.count(w.topics.replies) == 2
        records = await w.records(w.topics.replies, 2)
        assert records[0].value == records[1].value, "a repeat is the same bytes"
        assert w.metric("surge_replies_repeated_total") == 1
        # the model answered once: the repeat came from the reply book, not from the cache or a batch
        assert w.metric("surge_requests_total", priority="batch", status="ok", served_from="model") == 1
        assert w.metric("surge_batch_size_count") == 1


async def test_expired_reply_book_entries_leave_the_workers_own_store(
    kafka: EmbeddedKafka, tmp_path: Path
) -> None:
    """A worker's store of the reply book (a global table) kept every entry it ever read: one was
    deleted only when its request came again after the TTL, so the disk grew with every reply.
    The sweep deletes entries past the TTL and keeps the others."""
    async with inprocess(kafka, tmp_path) as w:
        asked = request("old", "ann", "remember me for an hour")
        (first,) = await w.replies(await w.client.submit(asked))
        await w.settled()
        sweeper, key = w.rt.book_sweeper, book_key(asked, w.topics.replies)
        assert sweeper is not None and w.rt.book_table is not None
        assert w.rt.book_table.get(key) is not None, "the reply was recorded"
        n = w.deployment.settings.partitions
        ttl_ms = w.deployment.settings.reply_record_ttl_s * 1000
        assert sum(sweeper.sweep(p, now_ms()) for p in range(n)) == 0
        assert w.rt.book_table.get(key) is not None, "a fresh entry is kept"
        assert sum(sweeper.sweep(p, now_ms() + ttl_ms + 1) for p in range(n)) >= 1
        assert w.rt.book_table.get(key) is None, "an expired entry is deleted"
        assert sweeper.deleted >= 1 and first.status == "ok"


async def test_a_recorded_reply_is_never_re_sent_to_another_reply_topic(
    kafka: EmbeddedKafka, tmp_path: Path
) -> None:
    """Whoever can write a request naming another client's tenant, user and request_id must not get
    that client's recorded answer re-sent to a reply topic of their own: the reply book keys replies
    by the reply topic too, so such a request is a new one (answered for itself)."""
    async with inprocess(kafka, tmp_path, reply_suffixes=("team-a", "mallory")) as w:
        team = await w.client_of(f"{w.topics.replies}.team-a")
        mallory = await w.client_of(f"{w.topics.replies}.mallory")
        ids = {"tenant": "acme", "priority": "batch"}
        secret = request("v1", "alice", "my balance is 4,200 EUR", reply_to=team.reply_topic, **ids)
        (first,) = await asyncio.wait_for(asyncio.gather(await team.submit(secret)), REPLY_TIMEOUT_S)
        probe = request("v1", "alice", "what did alice ask?", reply_to=mallory.reply_topic, **ids)
        (stolen,) = await asyncio.wait_for(asyncio.gather(await mallory.submit(probe)), REPLY_TIMEOUT_S)
        again = await team.submit(secret)  # a real repeat: the recorded reply, byte for byte
        await team.producer.flush()
        (repeat,) = await asyncio.wait_for(asyncio.gather(again), REPLY_TIMEOUT_S)
        await w.settled()

        assert first.answer == "my balance is 4,200 EUR" and repeat == first
        assert stolen.answer == "what did alice ask?", "another client's recorded answer was re-sent"
        for r in await w.records(mallory.reply_topic, 1):
            assert b"4,200" not in r.value
        assert w.metric("surge_replies_repeated_total") == 1


async def test_a_question_sent_ahead_under_a_clients_request_id_never_becomes_its_answer(
    kafka: EmbeddedKafka, tmp_path: Path
) -> None:
    """Whoever can guess a client's next request_id sends a question of their own under it first,
    to that client's reply topic. The reply book keyed replies by ids and topic only, so the
    client's own question, sent later, got the planted answer re-sent (and was never answered).
    Keyed by what the request asks too, it gets its own answer; a real repeat (new times) still
    gets the recorded reply byte for byte."""
    async with inprocess(kafka, tmp_path) as w:
        ids = {"tenant": "bank", "priority": "batch"}
        planted = request("order-1001", "alice", "How do I close my account?", **ids)
        (plant,) = await w.replies(await w.client.submit(planted))
        own = request("order-1001", "alice", "My card was stolen, how do I block it?", **ids)
        (answer,) = await w.replies(await w.client.submit(own))
        (repeat,) = await w.replies(await w.client.submit({**own, "created_at": now_ms()}))
        await w.settled()

        assert plant.answer == "How do I close my account?"
        assert answer.status == "ok" and answer.answer == own["prompt"], "the planted answer was re-sent"
        assert repeat == answer, "a retry of the same request gets its recorded reply"
        assert w.metric("surge_replies_repeated_total") == 1
        assert await w.count(w.topics.replies) == 3


def hold_reply_records(
    w: Running,
    monkeypatch: pytest.MonkeyPatch,
    which: Callable[[str], bool],
    held: list[asyncio.Future[None]] | None = None,
) -> asyncio.Event:
    """Delay the acknowledgement of the worker's reply-book changelog records whose value (as JSON)
    ``which`` selects until the returned event is set: the records are sent as usual, and the others
    are acknowledged as they come (a record on another partition may be acknowledged first). Each
    record held adds one entry to ``held``, so a test can tell that it held something."""
    book = w.rt.book_table
    assert book is not None
    release = asyncio.Event()
    send = book._enqueue_record
    if held is None:
        held = []

    def delayed(partition: int | None, key: str, value: Any, value_serializer: str | None = None) -> Any:
        fut = send(partition, key, value, value_serializer)
        if not which(json.dumps(value)):
            return fut
        acknowledged = FutureMessage(fut.message)  # what Faust returns: it names the partition

        async def later() -> None:
            await release.wait()
            try:
                acknowledged.set_result(await fut)
            except Exception as exc:
                acknowledged.set_exception(exc)

        held.append(asyncio.ensure_future(later()))
        return acknowledged

    monkeypatch.setattr(book, "_enqueue_record", delayed)
    return release


async def test_a_reply_is_sent_only_once_its_reply_book_record_is_on_the_broker(
    kafka: EmbeddedKafka, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reply visible before its record would, after a SIGKILL in between, leave the client a reply
    the next owner of the request cannot find: it would compute another (a different one when the
    deadline has passed by then). The reply book's changelog acknowledgements are held here; the replies of a
    model answer and of an intake cache hit wait for them, then go out byte for byte as recorded."""
    async with inprocess(kafka, tmp_path) as w:
        (warm,) = await w.replies(await w.client.submit(request("warm", "carol", "say it once")))
        assert warm.status == "ok"
        held: list[asyncio.Future[None]] = []
        release = hold_reply_records(w, monkeypatch, lambda value: True, held)
        asked = {"r-fresh": request("fresh", "carol", "a question nobody asked yet")}
        asked["r-again"] = request("again", "dave", "say it once")
        model = await w.client.submit(asked["r-fresh"])
        cached = await w.client.submit(asked["r-again"])
        await w.client.producer.flush()
        await asyncio.sleep(2.0)
        assert len(held) >= 2, f"both replies' records are held ({len(held)} held)"
        assert not model.done() and not cached.done(), "a reply went out before its record"
        release.set()
        fresh, again = await w.replies(model, cached)
        await w.settled()

        assert (fresh.served_from, again.served_from) == ("model", "cache")
        topic = f"{w.deployment.settings.app_id}-replybook-changelog"
        recorded = {json.loads(r.key): json.loads(r.value) for r in await w.records(topic, 3)}
        sent = {
            InferenceReply.model_validate_json(r.value).request_id: r.value
            for r in await w.records(w.topics.replies, 3)
        }
        for rid in ("r-fresh", "r-again"):
            entry = recorded[book_key(asked[rid], w.topics.replies)]
            assert entry["reply"].encode() == sent[rid], f"{rid}: the reply sent is not the one recorded"


async def test_batch_reading_waits_while_replies_wait_for_their_records(
    kafka: EmbeddedKafka, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replies leave in order, each once its reply-book record is acknowledged, so a real-time reply
    waits behind every reply made before it. Batch reading stops while more than
    ``changelog_buffer_limit_records`` writes and replies wait to be handed to the producer: with
    the records' acknowledgements held, a backlog of 40 batch requests is not all read and answered
    into that queue (without the rule, all 40 waited there)."""
    env = {
        "changelog_buffer_limit_records": "5",
        "queue_limit_per_class": "8",
        "max_batch_size": "4",
        "base_batch_size": "2",
    }
    async with inprocess(kafka, tmp_path, cache_enabled="false", dedup_enabled="false", **env) as w:
        inf = w.rt.inference
        assert inf is not None
        (warm,) = await w.replies(await w.client.submit(request("warm", "u0", "hello")))
        assert warm.status == "ok"
        release = hold_reply_records(w, monkeypatch, lambda value: True)
        futures = [
            await w.client.submit(request(f"bulk{i}", f"user{i}", f"bulk question {i}", priority="batch"))
            for i in range(40)
        ]
        await w.client.producer.flush()
        await asyncio.sleep(3.0)
        waiting = inf.unsent_writes()
        assert 5 < waiting <= 5 + 8 + 4, f"{waiting} writes and replies wait"
        assert "batch" in inf._blocked, "the batch reader waits"
        release.set()
        answers = await w.replies(*futures)
        assert all(a.status == "ok" for a in answers)


async def test_a_users_replies_keep_their_order_when_a_later_record_is_acknowledged_first(
    kafka: EmbeddedKafka, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The records of one batch's replies go to different changelog partitions and are acknowledged
    in any order; a reply waits for every reply published before it, so one user's replies of one
    class still arrive in the order asked (here the first reply's record is held back)."""
    async with inprocess(kafka, tmp_path, max_wait_ms="300") as w:
        (warm,) = await w.replies(await w.client.submit(request("warm", "erin", "hello")))
        assert warm.status == "ok"
        release = hold_reply_records(w, monkeypatch, lambda value: "r-first" in value)
        futures = [
            await w.client.submit(request(name, "erin", f"the {name} question", priority="batch"))
            for name in ("first", "second", "third")
        ]
        await w.client.producer.flush()
        await asyncio.sleep(2.0)
        assert not any(f.done() for f in futures), "a later reply overtook the first one"
        release.set()
        await w.replies(*futures)
        await w.settled()

        order = [
            InferenceReply.model_validate_json(r.value).request_id
            for r in await w.records(w.topics.replies, 4)
        ]
        assert order == ["r-warm", "r-first", "r-second", "r-third"]


async def test_a_record_whose_acknowledgement_never_comes_is_sent_again(
    kafka: EmbeddedKafka, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replies wait in one queue behind the oldest unacknowledged record: a record stuck on its way
    must not hold every later reply back for good. After RECORD_ACK_TIMEOUT_S it is sent again, and
    the reply (and the one queued behind it) go out."""
    import agents.runtime

    monkeypatch.setattr(agents.runtime, "RECORD_ACK_TIMEOUT_S", 0.5)
    async with inprocess(kafka, tmp_path) as w:
        (warm,) = await w.replies(await w.client.submit(request("warm", "fay", "hi there")))
        assert warm.status == "ok"
        first_time = [True]

        def once(value: str) -> bool:
            hit = "r-stuck" in value and first_time[0]
            first_time[0] = first_time[0] and not hit
            return hit

        never = hold_reply_records(w, monkeypatch, once)
        stuck_request = request("stuck", "fay", "a record that gets lost")
        stuck = await w.client.submit(stuck_request)
        behind = await w.client.submit(request("behind", "fay", "the one after it"))
        await w.client.producer.flush()
        replies = await asyncio.wait_for(w.replies(stuck, behind), 30)
        assert not never.is_set() and not first_time[0], "the first record was not held"
        assert [r.request_id for r in replies] == ["r-stuck", "r-behind"]
        topic = f"{w.deployment.settings.app_id}-replybook-changelog"
        keys = [json.loads(r.key) for r in await w.records(topic, 3)]
        assert book_key(stuck_request, w.topics.replies) in keys, "the reply went out without its record"
        never.set()  # the held first acknowledgement: let its task end


async def test_a_record_is_sent_again_while_the_producer_lacks_the_changelogs_metadata(
    kafka: EmbeddedKafka, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow broker can leave the producer's metadata without the changelog topic (a refresh that
    came back without it) just when a record must be sent again. The resend goes to the partition
    the record's first send chose and waits for the metadata; choosing the partition again raised
    TypeError there, and the worker stopped with the reply unsent (seen in CI)."""
    import agents.runtime

    monkeypatch.setattr(agents.runtime, "RECORD_ACK_TIMEOUT_S", 0.5)
    async with inprocess(kafka, tmp_path) as w:
        (warm,) = await w.replies(await w.client.submit(request("warm", "gil", "hi again")))
        assert warm.status == "ok"
        topic = f"{w.deployment.settings.app_id}-replybook-changelog"
        first_time = [True]

        def once(value: str) -> bool:
            hit = "r-lost" in value and first_time[0]
            if hit:  # the first send is on its way; then the metadata loses the topic
                first_time[0] = False
                asyncio.get_running_loop().call_later(0.2, forget_topic_metadata, w.rt.app.producer, topic)
            return hit

        never = hold_reply_records(w, monkeypatch, once)
        lost_request = request("lost", "gil", "a record sent twice")
        lost = await w.client.submit(lost_request)
        await w.client.producer.flush()
        (reply,) = await asyncio.wait_for(w.replies(lost), 30)
        assert reply.request_id == "r-lost" and reply.status == "ok"
        assert not first_time[0], "the first record was not held"
        writes = [
            r.partition
            for r in await w.records(topic, 3)
            if json.loads(r.key) == book_key(lost_request, w.topics.replies)
        ]
        assert len(writes) >= 1 and len(set(writes)) == 1, writes
        never.set()


async def test_a_reply_lingering_while_the_producer_first_meets_a_new_reply_topic_still_goes_out(
    kafka: EmbeddedKafka, tmp_path: Path
) -> None:
    """A gateway's reply topic created after the worker started: the first reply sent there makes the
    producer refresh its metadata. Faust's producer learnt every other topic from one refresh while
    tracking none, and aiokafka tracked a topic only when its metadata was missing, so that refresh
    dropped the reply topic's leaders and a reply lingering at that moment waited for good (the shadow
    test's failures in CI). With batches that linger 1 s the moment comes every time: without
    ``pipeline.compat.track_sent_topics`` the plain replies stayed queued, leader None and their topic
    untracked, in 4 of 4 runs."""
    from pipeline.admin import ensure_topics

    async with inprocess(kafka, tmp_path, producer_linger_ms="1000") as w:
        (warm,) = await w.replies(await w.client.submit(request("warm", "u0", "hello there")))
        assert warm.status == "ok"
        late = f"{w.topics.replies}.gateway-late"
        await ensure_topics(w.deployment.settings, extra=[late])
        gateway = await w.client_of(late)
        plain = [await w.client.submit(request(f"p{i}", f"u{i}", f"question {i}")) for i in range(4)]
        await w.client.producer.flush()
        await asyncio.sleep(0.2)  # the gateway's reply comes after the plain ones, within their linger
        via_gateway = await gateway.submit(request("g", "u9", "through the gateway", reply_to=late))
        await gateway.producer.flush()
        try:
            answered = await w.replies(*plain, via_gateway)
        except TimeoutError:
            producer = kafka_producer(w.rt.app.producer)
            held = producer_backlog(producer)
            wake_producer(producer)  # the remedy of a stuck-send report: else the worker cannot stop
            raise AssertionError(f"replies held inside the producer: {held}") from None
        assert [r.request_id for r in answered] == ["r-p0", "r-p1", "r-p2", "r-p3", "r-g"]
        assert all(r.status == "ok" for r in answered)


async def test_an_expired_reply_record_is_deleted_on_the_partition_that_holds_it(
    kafka: EmbeddedKafka, tmp_path: Path
) -> None:
    """A record older than the reply book's TTL is deleted when met. Its tombstone must land on the
    changelog partition of the record itself (the key's), or compaction never removes the record and
    a restarted worker restores it. The reply book is written with the key's partition
    (``DurableTable``); its deletes are Faust's own, which pick the partition of the request being
    handled unless the table uses the partitioner (agents/worker.py): without it this fails. Six
    users, so that the request's and the key's partition cannot all agree by chance."""
    async with inprocess(kafka, tmp_path, reply_record_ttl_s="1") as w:
        # the store's sweep (agents/book_sweep.py) would delete them first, locally, without a
        # tombstone: this test is about the tombstone of a record met again
        assert w.rt.book_sweeper is not None
        w.rt.book_sweeper.ttl_ms = float("inf")
        reqs = [request(f"old{i}", f"user{i}", f"question number {i}") for i in range(6)]
        firsts = await w.replies(*[await w.client.submit(r) for r in reqs])
        assert all(r.status == "ok" for r in firsts)
        await asyncio.sleep(1.5)
        seconds = await w.replies(*[await w.client.submit(r) for r in reqs])
        await w.settled()
        assert all(r.status == "ok" for r in seconds)

        topic = f"{w.deployment.settings.app_id}-replybook-changelog"
        by_key: dict[str, list[tuple[int, bool]]] = {}
        for r in await w.records(topic, 18):
            by_key.setdefault(json.loads(r.key), []).append((r.partition, r.value is None))
        assert len(by_key) == 6
        for key, writes in by_key.items():
            assert [tomb for _, tomb in writes] == [False, True, False], f"{key}: {writes}"
            assert len({p for p, _ in writes}) == 1, f"{key}: its tombstone went elsewhere: {writes}"


@dataclass
class _Handled:
    """A stand-in for the event being handled (Faust keeps a weak reference to it)."""

    message: SimpleNamespace


async def test_reply_book_records_skip_faust_s_producer_buffer_and_keep_their_offsets(
    kafka: EmbeddedKafka, tmp_path: Path
) -> None:
    """Each reply writes one reply-book record. In Faust's producer buffer those records stopped every
    stream of the worker, the intake's too, whenever more than 100 waited (``wait_until_ebb``); the
    book sends them itself, in order, and Faust still stores each one's offset with the table's
    data (what a restart reads to know what it has), as its own buffer would."""
    from pipeline.compat import as_current_event, producer_buffer_size

    async with inprocess(kafka, tmp_path) as w:
        book = w.rt.book_table
        assert book is not None
        keys = [f"k{i:03d}" for i in range(300)]
        # the store writes to the database of the current event's partition, as in the reply path
        handled = _Handled(message=SimpleNamespace(partition=0))
        with as_current_event(handled):  # type: ignore[arg-type]
            for k in keys:
                book[k] = {"reply": f"reply to {k}", "at_ms": 1}
        assert producer_buffer_size(w.rt.app) == 0, "none of the 300 records is in Faust's buffer"
        assert book.waiting() > 0
        acks = [book.durable(k) for k in keys]
        metas = await asyncio.wait_for(asyncio.gather(*[a for a in acks if a is not None]), 30)
        assert book.waiting() == 0 and all(book.durable(k) is None for k in keys)
        by_tp: dict[Any, list[int]] = {}
        for m in metas:
            by_tp.setdefault(m.topic_partition, []).append(m.offset)
        assert all(offsets == sorted(offsets) for offsets in by_tp.values()), "sent in the order written"
        # the worker also reads the book's changelog back (a global table) and stores the offset of
        # what it applied, which for a moment can be below what the acks stored (1 run in 16 under
        # load, before this session's changes too); a restart reads what it ends at
        stored: dict[Any, int | None] = {}
        for _ in range(100):
            stored = {tp: book.table.data.persisted_offset(tp) for tp in by_tp}
            if all(stored[tp] == max(offsets) for tp, offsets in by_tp.items()):
                break
            await asyncio.sleep(0.1)
        assert stored == {tp: max(offsets) for tp, offsets in by_tp.items()}
        topic = f"{w.deployment.settings.app_id}-replybook-changelog"
        written = {json.loads(r.key) for r in await w.records(topic, 300)}
        assert set(keys) <= written


async def test_a_user_over_its_rate_limit_gets_the_rate_limit_error(
    kafka: EmbeddedKafka, tmp_path: Path
) -> None:
    async with inprocess(
        kafka, tmp_path, rate_limit_enabled="true", user_burst_free="2", user_rate_per_s_free="0.001"
    ) as w:
        futures = [
            await w.client.submit(request(i, "greedy", f"question {i}", tier="free")) for i in range(3)
        ]
        futures.append(await w.client.submit(request("other", "modest", "my first question", tier="free")))
        first, second, third, other = await w.replies(*futures)
        await w.settled()

        assert (first.status, second.status, other.status) == ("ok", "ok", "ok")
        assert third.status == "error" and third.error is not None and third.answer is None
        assert third.error.code == "rate_limited", third.error
        assert third.error.retry_after_ms is not None and third.error.retry_after_ms > 0
        assert third.priority == "interactive"
        assert w.metric("surge_rate_limited_total", scope="user") == 1
        assert await w.count(w.topics.replies) == 4, "one reply per request"
        assert await w.count(w.topics.deadletter) == 0, "a refusal is no dead letter"


@pytest.mark.parametrize("flush_ms", [0, 400])
async def test_bucket_states_reach_the_changelog_written_behind_once_per_interval(
    kafka: EmbeddedKafka, tmp_path: Path, flush_ms: int
) -> None:
    """Two bucket writes per request (the user's and the tenant shard's) were two table writes and
    two changelog records each: written behind, 60 requests of one user cost a few records, and the
    newest states still reach the changelog once the interval has passed with no record coming.
    With 0, each request's writes (docs/architecture.md, "Rate-limit buckets: written behind")."""
    async with inprocess(
        kafka,
        tmp_path,
        rate_limit_enabled="true",
        rate_limit_flush_ms=str(flush_ms),
        user_burst_standard="1000",
        user_rate_per_s_standard="0.001",
    ) as w:
        futures = [await w.client.submit(request(i, "steady", f"question {i}")) for i in range(60)]
        replies = await w.replies(*futures)
        await w.settled()
        assert all(r.status == "ok" for r in replies)
        await asyncio.sleep(flush_ms / 1000 + 0.5)  # the timer writes what the last records changed
        intake = w.rt.intake
        assert intake.buckets.pending() == 0
        topic = f"{w.deployment.settings.app_id}-ratelimit-changelog"
        written = await w.count(topic)
        if flush_ms == 0:
            assert written == 120, "each request's two buckets written after it"
        else:
            assert 2 <= written <= 30, written
        user_key = json.dumps(intake.limiter.user_key("steady", "default")).encode()
        records = [r for r in await w.records(topic, written) if r.key == user_key]
        last = json.loads(records[-1].value)
        assert abs(last["tokens"] - (1000 - 60)) < 0.5, last


async def test_a_users_requests_without_a_key_share_one_bucket_whatever_their_partitions(
    kafka: EmbeddedKafka, tmp_path: Path
) -> None:
    """Records without a key, written by a producer that is not aiokafka to three different
    partitions: intake sends each on keyed by its user_id, so all three meet the user's one bucket
    (burst 2) on the user's partition and the third is refused. Handled where they landed, each met
    a bucket of its own there (Faust reads the table on the record's partition): all three served."""
    producer = Producer({"bootstrap.servers": kafka.bootstrap})
    async with inprocess(
        kafka, tmp_path, rate_limit_enabled="true", user_burst_free="2", user_rate_per_s_free="0.001"
    ) as w:
        futures = [w.client.expect(f"r-nokey-{p}") for p in range(3)]
        for p in range(3):
            raw = json.dumps(request(f"nokey-{p}", "spreader", f"question {p}", tier="free")).encode()
            producer.produce(w.topics.requests, value=raw, partition=p)
        assert producer.flush(10) == 0
        replies = list(await asyncio.wait_for(asyncio.gather(*futures), REPLY_TIMEOUT_S))
        await w.settled()

        assert sorted(r.status for r in replies) == ["error", "ok", "ok"], replies
        refused = next(r for r in replies if r.status == "error")
        assert refused.error is not None and refused.error.code == "rate_limited"
        assert await w.count(w.topics.replies) == 3, "one reply per request"
        sent_on = [r for r in await w.records(w.topics.requests, 6) if r.key == b"spreader"]
        assert len(sent_on) == 3, "each unkeyed record sent on once, keyed by its user"


async def test_a_users_keyed_requests_sprayed_over_partitions_share_one_bucket(
    kafka: EmbeddedKafka, tmp_path: Path
) -> None:
    """A producer that picks the partition itself (or partitions by crc32, librdkafka's default)
    writes one user's keyed records to three partitions. Served where they landed, each met a
    bucket of its own (40 of 40 admitted against a burst of 10 in the review); sent on to the
    user's own partition, the third of three meets the bucket the first two emptied (burst 2)."""
    producer = Producer({"bootstrap.servers": kafka.bootstrap})
    async with inprocess(
        kafka, tmp_path, rate_limit_enabled="true", user_burst_free="2", user_rate_per_s_free="0.001"
    ) as w:
        n = w.deployment.settings.partitions
        home = DefaultPartitioner()(b"sprayer", list(range(n)), list(range(n)))
        others = [p for p in range(n) if p != home][:2]
        futures = [w.client.expect(f"r-spray-{p}") for p in (home, *others)]
        for p in (home, *others):
            raw = json.dumps(request(f"spray-{p}", "sprayer", f"question {p}", tier="free")).encode()
            producer.produce(w.topics.requests, key=b"sprayer", value=raw, partition=p)
        assert producer.flush(10) == 0
        replies = list(await asyncio.wait_for(asyncio.gather(*futures), REPLY_TIMEOUT_S))
        await w.settled()

        assert sorted(r.status for r in replies) == ["error", "ok", "ok"], replies
        refused = next(r for r in replies if r.status == "error")
        assert refused.error is not None and refused.error.code == "rate_limited"
        assert await w.count(w.topics.replies) == 3, "one reply per request"
        records = [r for r in await w.records(w.topics.requests, 5) if r.key == b"sprayer"]
        assert len(records) == 5, "the two records off the user's partition sent on once each"
        assert sum(r.partition == home for r in records) == 3


@pytest.mark.parametrize("codec", ["lz4", "snappy", "zstd", "gzip"])
async def test_requests_a_producer_compressed_with_any_kafka_codec_are_answered(
    kafka: EmbeddedKafka, tmp_path: Path, codec: str
) -> None:
    """A librdkafka producer compressing its batches: without the lz4, snappy and zstd codecs
    (cramjam) aiokafka's fetcher raised ``UnsupportedCodecError`` and the worker stopped, again on
    every restart, since the record was never committed."""
    producer = Producer({"bootstrap.servers": kafka.bootstrap, "compression.type": codec, "linger.ms": 50})
    async with inprocess(kafka, tmp_path) as w:
        # long and repetitive, so that the codec saves bytes (librdkafka sends a batch that does
        # not shrink uncompressed)
        texts = [
            f"question {i} about my card: " + "why was my card declined at the shop? " * 200 for i in range(3)
        ]
        futures = [w.client.expect(f"r-{codec}-{i}") for i in range(3)]
        for i, text in enumerate(texts):
            raw = json.dumps(request(f"{codec}-{i}", "packer", text)).encode()
            producer.produce(w.topics.requests, key=b"packer", value=raw)
        assert producer.flush(10) == 0
        replies = list(await asyncio.wait_for(asyncio.gather(*futures), REPLY_TIMEOUT_S))
        await w.settled()

        assert [r.status for r in replies] == ["ok"] * 3, replies
        for i, reply in enumerate(replies):  # the echo model's answer: the question, cut short
            assert reply.answer and len(reply.answer) > 40 and texts[i].startswith(reply.answer), reply


async def test_a_follower_outlives_a_leader_that_missed_the_deadline_its_client_chose(
    kafka: EmbeddedKafka, tmp_path: Path
) -> None:
    """A request asking for 300 ms leads; another user's same question, with the class's own
    deadline, joins it while the model is busy. The leader misses its 300 ms; the follower is routed
    again on its own and answered by a model call of its own. It once got the leader's
    ``deadline_exceeded`` ("missed its deadline of 300 ms"), so one client's deadline failed others."""
    async with inprocess(kafka, tmp_path, dedup_enabled="true", echo_delay_ms="1500") as w:
        await w.replies(await w.client.submit(request("warm", "w", "warm up the model")))
        busy = await w.client.submit(request("busy", "f", "a question that keeps the model busy"))
        await w.client.producer.flush()
        await asyncio.sleep(0.3)
        leader = await w.client.submit(request("lead", "hasty", "what is my card limit", deadline_ms=300))
        await w.client.producer.flush()
        await asyncio.sleep(0.1)
        follower = await w.client.submit(request("follow", "patient", "What is my card limit?"))
        hasty, patient, _ = await w.replies(leader, follower, busy)
        await w.settled()

        assert hasty.status == "error" and hasty.error is not None
        assert hasty.error.code == "deadline_exceeded" and "300 ms" in hasty.error.message
        assert patient.status == "ok", patient.error
        assert patient.answer == "What is my card limit?" and patient.merged_into is None
        assert await w.count(w.topics.replies) == 4, "one reply per request"


async def test_a_client_dating_its_requests_in_the_past_is_still_rate_limited(
    kafka: EmbeddedKafka, tmp_path: Path
) -> None:
    """Each request dated an hour after the one before, all in 1970 (deadlines off, so none expires):
    charged at those dates, each found its bucket full again and all were served. Charged no
    earlier than their records' broker time less the clock slack, the third is refused (burst 2)."""
    async with inprocess(
        kafka,
        tmp_path,
        rate_limit_enabled="true",
        user_burst_free="2",
        user_rate_per_s_free="0.001",
        deadlines_enabled="false",
    ) as w:
        futures = [
            await w.client.submit(
                request(
                    f"dated-{i}", "dater", f"q {i}", tier="free", priority="offline", created_at=i * 3_600_000
                )
            )
            for i in range(1, 4)
        ]
        replies = await w.replies(*futures)
        await w.settled()
        assert [r.status for r in replies] == ["ok", "ok", "error"], replies
        assert replies[2].error is not None and replies[2].error.code == "rate_limited"


async def test_records_thrown_away_when_faust_resumes_its_flow_are_read_again(
    kafka: EmbeddedKafka, tmp_path: Path
) -> None:
    # Faust empties every stream buffer when it resumes its flow after a rebalance. A batch reader
    # waiting for admission (strict priority under overload) holds the rest of its partition in that
    # buffer; without a seek back, those records were gone while the fetch position stayed past them.
    async with inprocess(kafka, tmp_path) as w:
        inf = w.rt.inference
        assert inf is not None
        admit = inf.can_admit
        held = {"batch"}
        inf.can_admit = lambda priority, *more: priority not in held and admit(priority, *more)  # type: ignore[method-assign]
        futures = [
            await w.client.submit(request(f"b{i}", "user-held", f"held question {i}", priority="batch"))
            for i in range(5)
        ]
        await w.client.producer.flush()
        for _ in range(100):  # the reader holds the first record; the other four wait in its buffer
            if "batch" in inf._blocked:
                break
            await asyncio.sleep(0.1)
        assert "batch" in inf._blocked, "the batch reader never waited for admission"
        await asyncio.sleep(2.0)
        w.rt.app.flow_control.resume()  # what Faust does at the end of a rebalance's recovery
        held.clear()
        inf._room.set()
        answered = await w.replies(*futures)
        assert sorted(r.request_id for r in answered) == [f"r-b{i}" for i in range(5)]
        assert all(r.status == "ok" for r in answered)
        await w.settled()
        assert await w.count(w.topics.replies) == 5, "each request answered once"


async def test_followers_of_a_leader_degraded_while_queued_say_so_and_are_not_remembered(
    kafka: EmbeddedKafka, tmp_path: Path
) -> None:
    """A follower gets the answer its leader's model call made: when the level rose while the two
    waited, the leader is re-planned (logprobs dropped at level 1) and the follower's reply carries
    that level, and its answer is not remembered for the parameters it asked (logprobs on)."""
    env = {
        "dedup_enabled": "true",
        "semantic_cache_enabled": "true",
        "echo_delay_ms": "3000",
        "max_wait_ms": "5",
    }
    async with inprocess(kafka, tmp_path, **env) as w:
        inf = w.rt.inference
        busy = await w.client.submit(request("busy", "u0", "a question that keeps the model busy"))
        await w.client.producer.flush()
        await asyncio.sleep(0.5)  # its batch runs for 3 s; what comes now waits in the queue
        texts = ["How do I order a new chequebook?", "Hi, how can I order a new chequebook please?"]
        pair = [await w.client.submit(request(k, f"u{k}", t, logprobs=True)) for k, t in enumerate(texts)]
        await w.client.producer.flush()
        for _ in range(100):  # until one has joined the other, both planned at level 0
            if inf.merges.followers():
                break
            await asyncio.sleep(0.02)
        assert inf.merges.followers() == 1 and inf.batcher.depth == 1, "a queued leader and its follower"
        inf.level = lambda: 1  # type: ignore[method-assign]  # the level rose before their batch is popped
        (busy_reply,) = await w.replies(busy)
        replies = sorted(await w.replies(*pair), key=lambda r: r.served_from or "")
        follower, leader = replies  # "merged" sorts before "model"
        assert (leader.served_from, follower.served_from) == ("model", "merged"), replies
        assert follower.merged_into == leader.request_id
        assert leader.degradation_level == 1 and leader.logprobs is None
        assert follower.degradation_level == 1, "the follower's answer was made at level 1"
        assert follower.answer == leader.answer and follower.logprobs is None
        hits = w.metric("surge_cache_lookups_total", layer="exact", result="hit")
        again = texts[int(follower.request_id[-1])].upper()
        (repeat,) = await w.replies(await w.client.submit(request("again", "u9", again, logprobs=True)))
        assert w.metric("surge_cache_lookups_total", layer="exact", result="hit") == hits, (
            "a level-1 answer must not be remembered for a request that asked for logprobs",
            repeat,
        )
        assert busy_reply.status == "ok"


async def test_batch_reading_goes_on_when_the_intake_takes_nothing_at_all(
    kafka: EmbeddedKafka, tmp_path: Path
) -> None:
    """Batch reading yields to an intake that has requests waiting, but a hold must never stop the
    worker: when the intake takes nothing for ``intake_first_stall_ms`` (here it waits for something
    that never comes), the batch work already on its topic is answered all the same. With no such
    limit, a worker stopped answering in one benchmark run (docs/architecture.md, "Intake first")."""
    async with inprocess(kafka, tmp_path, intake_first_stall_ms="700") as w:
        (warm,) = await w.replies(await w.client.submit(request("warm", "u0", "hello", priority="batch")))
        assert warm.status == "ok"
        w.rt.lifecycle.writes_ready.clear()  # the intake waits on this before each record: it stalls
        for i in range(60):  # requests pile up behind it (one user: the partition it took "warm" from)
            await w.client.submit(request(f"stuck{i}", "u0", f"question {i}"))
        await w.client.producer.flush()
        backlog = w.rt.intake_backlog
        for _ in range(100):  # the consumer fetched them: the intake is behind
            if backlog.behind(now_ms()) or backlog.gave_way:
                break
            await asyncio.sleep(0.05)
        assert backlog.behind(now_ms()), "60 requests wait behind the intake"
        # batch work the intake forwarded before it stalled, as it wrote it
        futures = []
        for i in range(5):
            req = InferenceRequest(request_id=f"r-b{i}", user_id=f"bulk{i}", prompt=f"bulk question {i}")
            item = WorkItem(
                request=req,
                priority="batch",
                tier="standard",
                reply_to=w.topics.replies,
                created_at_ms=now_ms(),
                arrival_ms=now_ms(),
                deadline_at_ms=now_ms() + 60_000,
            )
            futures.append(w.client.expect(req.request_id))
            await w.client.producer.send(w.topics.work("batch"), value=encode(item), key=req.user_id.encode())
        t0 = time.monotonic()
        answers = await w.replies(*futures)
        waited = time.monotonic() - t0
        assert all(a.status == "ok" for a in answers), answers
        assert backlog.gave_way >= 1, "the hold gave way to the stalled intake"
        assert waited >= 0.5, f"held while the intake might still have moved ({waited:.2f} s)"
        w.rt.lifecycle.writes_ready.set()


@pytest.mark.parametrize("next_owner", ["this worker", "another worker"])
async def test_a_rebalance_gives_back_queued_work_and_what_it_finished_behind_it_is_not_done_twice(
    kafka: EmbeddedKafka, tmp_path: Path, next_owner: str
) -> None:
    """The whole group waits for a member's rebalance drain. Past ``rebalance_grace_ms`` the drain
    gives back what has not reached the model and waits only for the batch in the model: the queued
    request is answered once, after the partition comes back, not during the drain. A record finished
    behind it on the same partition (a dead-lettered one) is acked without work when it is read again:
    one dead letter, not two. Another worker learns that from the drain's commit (its metadata), so
    the partition's next owner is played by this worker with its own memory wiped."""
    env = {"echo_delay_ms": "3000", "max_wait_ms": "5", "rebalance_grace_ms": "300"}
    async with inprocess(kafka, tmp_path, **env) as w:
        inf, life, acker = w.rt.inference, w.rt.lifecycle, w.rt.acker
        assert inf is not None
        busy = await w.client.submit(request("busy", "u0", "a question that keeps the model busy"))
        await w.client.producer.flush()
        for _ in range(100):  # in the model for 3 s
            if inf.model_calls or inf.batcher.batches:
                break
            await asyncio.sleep(0.02)
        queued = await w.client.submit(request("queued", "u1", "a question that waits", priority="batch"))
        await w.client.producer.flush()
        for _ in range(100):
            if inf.scheduler.depth() == 1:
                break
            await asyncio.sleep(0.02)
        assert inf.scheduler.depth() == 1, "the second request waits behind the busy model"
        work_topic = w.topics.work("batch")
        (work,) = await w.records(work_topic, 1)
        # a record behind it on its partition that is finished at once (no WorkItem: a dead letter)
        await w.client.producer.send_and_wait(work_topic, b"not a work item", partition=work.partition)
        await w.records(w.topics.deadletter, 1)
        assigned = set(w.rt.app.consumer.assignment())
        others = {tp for tp in assigned if (tp.topic, tp.partition) != (work_topic, work.partition)}
        assert inf.give_back(others) == 0 and inf.scheduler.depth() == 1, "its partition is kept"
        request_tp = next(tp for tp in assigned if tp.topic == w.topics.requests)
        w.rt.intake_backlog.record(request_tp, -100, now_ms())  # as if 100 records waited behind the intake
        assert w.rt.intake_backlog.behind(now_ms()), "the consumer knows the partition's high watermark"
        await life.on_revoked(assigned)  # what Faust calls when a rebalance starts
        assert not w.rt.intake_backlog.behind(now_ms()), "a revoked request partition holds nobody back"
        assert acker.given_back == 1 and inf.scheduler.depth() == 0 and not inf._inflight
        assert not life.revoking, "readers may take records again"
        (first,) = await w.replies(busy)
        assert first.request_id == "r-busy", "the batch in the model finished during the drain"
        if next_owner == "another worker":
            acker._done_before.clear()  # all it has is what the group committed
        # the partitions come back: reading starts again at the committed offsets
        await acker.seek_to_starts([tp for tp in assigned if tp.topic in life.source_topics])
        (answer,) = await w.replies(queued)
        assert answer.status == "ok" and answer.served_from == "model"
        await w.settled()
        assert await w.count(w.topics.replies) == 2, "each request answered once"
        assert await w.count(w.topics.deadletter) == 1, "the finished record was not worked on again"
        assert acker.done_again == 1


class _RecordingEmbedder:
    """The worker's real embedder, recording the texts of each call and taking ``call_s`` longer per
    call (a forward pass on a busy machine); ``started`` is set when a call of batch work begins."""

    def __init__(self, real: Any, call_s: float) -> None:
        self.real = real
        self.call_s = call_s
        self.batch_size = real.batch_size
        self.multilingual = real.multilingual
        self.dim = real.dim
        self.calls: list[list[str]] = []
        self.started = asyncio.Event()
        self.loop = asyncio.get_running_loop()

    def embed(self, texts: list[str]) -> Any:
        self.calls.append(list(texts))
        if any(t.startswith("bulk") for t in texts):
            self.loop.call_soon_threadsafe(self.started.set)
        time.sleep(self.call_s)
        return self.real.embed(texts)


@pytest.mark.parametrize("window_ms", [0, 2000])
async def test_an_idle_embedding_stage_waits_for_company_while_its_window_is_open(
    kafka: EmbeddedKafka, tmp_path: Path, window_ms: int
) -> None:
    """With ``embed_max_wait_ms`` set, a question that finds the embedding stage idle while arrivals
    come often enough waits for the next one (sent 0.2 s after it reached the stage), and both are
    embedded in one call; a real-time one is embedded at once
    (docs/architecture.md, "The embedding window")."""
    async with inprocess(kafka, tmp_path, dedup_enabled="true", embed_max_wait_ms=str(window_ms)) as w:
        inf = w.rt.inference
        assert inf.embedder is not None
        rec = _RecordingEmbedder(inf.embedder, call_s=0.0)
        inf.embedder = rec
        texts = ("how do I close my savings account", "where can I see the limit on my card")
        first = await w.client.submit(request("a", "ua", texts[0], priority="interactive"))

        def reached_the_stage() -> bool:  # waiting in the window, or embedded at once
            waiting = cast(dict[str, int], inf.status()["arrivals_waiting"])
            return waiting["interactive"] > 0 or any(texts[0] in call for call in rec.calls)

        # the second is sent once the first is at the embedding stage (however long the way there
        # took on a loaded machine): without a window it has been embedded alone by then
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while not reached_the_stage():
            assert time.monotonic() < deadline, "the first question never reached the embedding stage"
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.2)
        second = await w.client.submit(request("b", "ub", texts[1], priority="interactive"))
        answers = await w.replies(first, second)
        assert all(a.status == "ok" for a in answers)
        together = any(texts[0] in call and texts[1] in call for call in rec.calls)
        assert together == bool(window_ms), f"embedding calls: {rec.calls}"
        sent = time.monotonic()
        urgent = await w.client.submit(request("rt", "ur", "was this transfer a fraud", priority="realtime"))
        (answer,) = await w.replies(urgent)
        took_s = time.monotonic() - sent
        assert answer.status == "ok"
        assert took_s < 1.6, f"the real-time request waited out the window: {took_s:.2f} s"
        assert ["was this transfer a fraud"] in rec.calls, "a real-time question is embedded alone"


@pytest.mark.parametrize("yields", [True, False])
async def test_a_real_time_request_is_embedded_between_the_forward_passes_of_batch_work(
    kafka: EmbeddedKafka, tmp_path: Path, yields: bool
) -> None:
    """A real-time request admitted while a long embedding call of batch work runs waits for one
    forward pass of it, not the whole call (``embed_yield_to_realtime``); off, it waits for all of it
    (docs/architecture.md, "Intake first")."""
    env = {
        "dedup_enabled": "true",
        "embed_budget_ms": "100000",  # one call takes every batch item waiting
        "embed_yield_to_realtime": str(yields).lower(),
    }
    async with inprocess(kafka, tmp_path, **env) as w:
        inf = w.rt.inference
        assert inf.embedder is not None
        rec = _RecordingEmbedder(inf.embedder, call_s=0.25)
        inf.embedder = rec
        bulk = []
        for i in range(24):
            req = request(f"bb{i}", f"bulkuser{i}", f"bulk question {i} about my card {i}", priority="batch")
            bulk.append(await w.client.submit(req))
        await w.client.producer.flush()
        await asyncio.wait_for(rec.started.wait(), REPLY_TIMEOUT_S)
        rt_text = "urgent: is this payment fraud"
        (urgent,) = await w.replies(
            await w.client.submit(request("rt", "urgent", rt_text, priority="realtime"))
        )
        answers = await w.replies(*bulk)
        assert urgent.status == "ok" and all(a.status == "ok" for a in answers)
        batch_calls = [
            i for i, texts in enumerate(rec.calls) if any(t.startswith("bulk question") for t in texts)
        ]
        rt_call = next(i for i, texts in enumerate(rec.calls) if rt_text in texts)
        sizes = [len(rec.calls[i]) for i in batch_calls]
        if yields:
            assert max(sizes) <= rec.batch_size, f"one forward pass per call: {sizes}"
            assert rt_call < batch_calls[-1], (
                f"the real-time request waited for all of the batch work: calls {rec.calls}"
            )
        else:
            assert max(sizes) > rec.batch_size, f"one call took the batch: {sizes}"
            assert rt_call > batch_calls[0], "the real-time request came after the long call began"


@pytest.mark.parametrize("triage_records", [512, 1])
async def test_the_intake_serves_real_time_requests_ahead_of_a_backlog_in_their_partition(
    kafka: EmbeddedKafka, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, triage_records: int
) -> None:
    """Every class shares the request topic: a real-time request read behind a backlog of batch
    requests in its partition was handled after all of them. The intake's reader takes records into
    its triage queue while the handler works, and the handler serves real-time first, each class in
    the order read (docs/architecture.md, "Triage at the intake"). The handler is held at its first
    record until the reader has queued all it may: with room for the whole backlog, the 8 real-time
    requests (sent after 300 batch ones by the same user) are handled right after the batch request
    the handler held; with a queue of one record, in the order sent. The reader stops at the bound."""
    async with inprocess(kafka, tmp_path, model="echo", intake_triage_max_records=str(triage_records)) as w:
        intake = w.rt.intake
        gate = asyncio.Event()
        handled: list[str] = []
        handle = intake.handle

        async def held(taken: Any) -> None:
            handled.append(taken.decoded.request_id)
            await gate.wait()
            await handle(taken)

        monkeypatch.setattr(intake, "handle", held)
        futures = [await w.client.submit(request(f"b{i}", "u1", priority="batch")) for i in range(300)]
        futures += [await w.client.submit(request(f"rt{i}", "u1", priority="realtime")) for i in range(8)]
        await w.client.producer.flush()
        queued = min(triage_records, 307)  # the first record is with the handler
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while len(intake.triage) < queued:
            assert time.monotonic() < deadline, f"{len(intake.triage)} queued, {queued} expected"
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.3)
        assert len(intake.triage) == queued, "the reader took records past the queue's bound"
        gate.set()
        replies = await w.replies(*futures)
        assert all(r.status == "ok" for r in replies), {r.error.code for r in replies if r.error}
    batch, live = [f"r-b{i}" for i in range(300)], [f"r-rt{i}" for i in range(8)]
    if triage_records == 1:
        assert handled == batch + live
    else:
        assert handled == batch[:1] + live + batch[1:]
        assert intake.triage.overtakes == 8


async def test_an_intake_handler_that_dies_is_started_again_with_the_agent(
    kafka: EmbeddedKafka, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Should the intake's handler ever stop on an error (here: handling a record fails and so does
    its error reply), the reader raises, Faust's supervisor starts the agent again, and the new
    handler serves the requests queued and sent after it: the intake does not stall with records
    taken on that nobody handles (docs/architecture.md, "Triage at the intake")."""
    import agents.intake as intake_module

    async with inprocess(kafka, tmp_path, model="echo") as w:
        intake = w.rt.intake
        handle, failed = intake.handle, intake_module.intake_failed
        broken = {"r-boom"}

        async def handle_or_fail(taken: Any) -> None:
            if taken.decoded.request_id in broken:
                raise RuntimeError("handling failed")
            await handle(taken)

        async def reply_fails(*args: Any, **kw: Any) -> None:
            if broken:
                broken.clear()
                raise RuntimeError("the error reply failed too")
            await failed(*args, **kw)

        monkeypatch.setattr(intake, "handle", handle_or_fail)
        monkeypatch.setattr(intake_module, "intake_failed", reply_fails)
        await w.client.submit(request("boom", "u1"))
        await w.client.producer.flush()
        deadline = time.monotonic() + REPLY_TIMEOUT_S
        while intake.handler_failed is None:
            assert time.monotonic() < deadline, "the handler did not stop"
            await asyncio.sleep(0.01)
        after = [await w.client.submit(request(f"a{i}", "u1")) for i in range(5)]
        replies = await w.replies(*after)
        assert [r.status for r in replies] == ["ok"] * 5
        assert intake.handler_failed is None, "a new handler serves the queue"
