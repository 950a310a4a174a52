"""A producer-side client: send InferenceRequests, await their InferenceReplies by request_id.

Used by ``surge send``, ``surge demo``, the gateway, the benchmarks and the tests. It reads its reply
topic without a consumer group (all partitions, from the end at start), so many clients can share
one reply topic; each picks the replies it is waiting for. A request it signs must be answered by a
reply signed with the same key: any other reply under its request id (one that another tenant's
request caused to be written there) is dropped (docs/architecture.md, "Tenant isolation").

:class:`TopicReader` (a group-less reader of one topic) and :class:`ReplyClient` (a producer and the
reader of its answers, with a future per id) are what every such client shares: this one, the risk
client (:mod:`pipeline.risk_client`) and the replay's collector (:mod:`pipeline.replay.runner`).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any, Generic, Self, TypeVar

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.errors import KafkaError

from pipeline.auth import ApiKey, reply_signed_by, sign
from pipeline.compat import refresh_metadata, track_sent_topics
from pipeline.exceptions import BrokerError, TopicMissingError
from pipeline.records import InferenceReply, now_ms

log = logging.getLogger("surge.client")

#: what a client waits for: a reply, a decision
A = TypeVar("A")


async def partitions_of(consumer: AIOKafkaConsumer, topic: str, tries: int = 30) -> list[int]:
    """The partitions of ``topic``, sorted; while the consumer's metadata does not know the topic yet
    it asks the broker again, every 0.1 s, ``tries`` times in all; ``[]`` when it never does."""
    for _ in range(tries):
        parts = consumer.partitions_for_topic(topic)
        if parts:
            return sorted(parts)
        await refresh_metadata(consumer)
        await asyncio.sleep(0.1)
    return []


class TopicReader:
    """Reads every partition of one topic without a consumer group, so that any number of readers can
    share the topic and none commits anything: from the topic's end at :meth:`start` (or from its
    beginning), in a background task that runs :meth:`_read`."""

    #: what the topic is to its reader, for the error when it does not exist
    topic_kind = "topic"

    def __init__(self, consumer: AIOKafkaConsumer, topic: str, *, from_beginning: bool = False) -> None:
        self.consumer = consumer
        self.topic = topic
        self.from_beginning = from_beginning
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start reading; :class:`BrokerError` when the cluster cannot be reached or the topic does
        not exist (with what was started stopped again: no client is left open behind the error)."""
        try:
            await self._start()
        except BaseException as exc:
            with contextlib.suppress(Exception):
                await self.stop()
            if isinstance(exc, KafkaError):
                raise BrokerError(f"cannot reach Kafka: {exc}") from exc
            raise

    async def _start(self) -> None:
        await self.consumer.start()
        parts = await partitions_of(self.consumer, self.topic, tries=100)
        if not parts:
            raise self._missing_topic()
        tps = [TopicPartition(self.topic, p) for p in parts]
        self.consumer.assign(tps)
        if self.from_beginning:
            await self.consumer.seek_to_beginning(*tps)
        else:
            await self.consumer.seek_to_end(*tps)
            for tp in tps:  # resolve the positions now, so nothing sent after start() is missed
                await self.consumer.position(tp)
        self._task = asyncio.create_task(self._read())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.consumer.stop()

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _missing_topic(self) -> Exception:
        return TopicMissingError(self.topic_kind, self.topic)

    async def _read(self) -> None:
        """Read the assigned partitions until cancelled."""
        raise NotImplementedError


class ReplyClient(TopicReader, Generic[A]):
    """A producer, and the reader of the topic its answers come back on: each answer read resolves
    the future :meth:`expect` gave out for its id."""

    def __init__(
        self,
        producer: AIOKafkaProducer,
        consumer: AIOKafkaConsumer,
        topic: str,
        *,
        from_beginning: bool = False,
    ) -> None:
        super().__init__(consumer, topic, from_beginning=from_beginning)
        # a record for one topic must not wait for good after a send to another (pipeline/compat.py)
        track_sent_topics(producer)
        self.producer = producer
        self._waiting: dict[str, asyncio.Future[A]] = {}

    async def _start(self) -> None:
        await self.producer.start()
        await super()._start()

    async def stop(self) -> None:
        try:
            await super().stop()
        finally:
            await self.producer.stop()

    def expect(self, key: str) -> asyncio.Future[A]:
        """A future for the answer to ``key`` (call before sending)."""
        fut = self._waiting.get(key)
        if fut is None:
            fut = self._waiting[key] = asyncio.get_running_loop().create_future()
        return fut

    def waiting(self) -> dict[str, asyncio.Future[A]]:
        """The ids still waiting for an answer, with their futures (a copy)."""
        return dict(self._waiting)

    def forget(self, key: str) -> None:
        """Stop waiting for ``key`` (after a timeout); a late answer is then ignored."""
        self._waiting.pop(key, None)

    def _answered(self, key: str, answer: A) -> None:
        fut = self._waiting.pop(key, None)
        if fut is not None and not fut.done():
            fut.set_result(answer)

    def fail_unsent(self, key: str, delivery: asyncio.Future[Any]) -> None:
        """Fail the future of ``key``'s answer when ``delivery`` (the producer's acknowledgement of
        what was sent for it) fails: nothing will answer a record the broker never took, and a
        caller not awaiting the delivery would otherwise wait for good."""

        def done(ack: asyncio.Future[Any]) -> None:
            exc = BrokerError("the send was cancelled") if ack.cancelled() else ack.exception()
            if exc is None:
                return
            fut = self._waiting.get(key)
            self.forget(key)  # and whatever a subclass keeps for it (SurgeClient: its reply's key)
            if fut is not None and not fut.done():
                fut.set_exception(BrokerError(f"{key[:80]} was not written to Kafka: {exc!r}"))

        delivery.add_done_callback(done)


class SurgeClient(ReplyClient[InferenceReply]):
    """Async client of one surge deployment."""

    topic_kind = "reply topic"

    def __init__(
        self,
        bootstrap: str,
        *,
        requests_topic: str = "surge.requests",
        reply_topic: str = "surge.replies",
        on_reply: Callable[[InferenceReply], None] | None = None,
        from_beginning: bool = False,
        keep_replies: bool = True,
        security: Mapping[str, Any] | None = None,
        signer: ApiKey | None = None,
        verify_replies: bool = True,
    ) -> None:
        """``security``: aiokafka's TLS/SASL options, :func:`pipeline.kafka_security.client_options`.
        ``signer``: the API key each request is signed with (:func:`pipeline.auth.sign`), for a
        deployment that wants signed records (``kafka_request_auth``); None: unsigned.
        ``verify_replies``: take, for a request signed with a key, only a reply signed with that key
        (:func:`pipeline.auth.reply_signed_by`); the workers sign them where they verify requests.
        Off only where signed requests meet workers that take records as written."""
        auth = dict(security or {})
        super().__init__(
            AIOKafkaProducer(
                bootstrap_servers=bootstrap, acks="all", linger_ms=2, max_request_size=8 << 20, **auth
            ),
            AIOKafkaConsumer(
                bootstrap_servers=bootstrap,
                enable_auto_commit=False,
                auto_offset_reset="latest",
                fetch_max_wait_ms=50,
                **auth,
            ),
            reply_topic,
            from_beginning=from_beginning,
        )
        self.bootstrap = bootstrap
        self.requests_topic = requests_topic
        self.reply_topic = reply_topic
        self.on_reply = on_reply
        #: keep every reply in ``replies`` (tests, the demo); a long-running gateway turns it off
        self.keep_replies = keep_replies
        self.replies: list[InferenceReply] = []
        self.signer = signer
        self.verify_replies = verify_replies
        #: the key each waiting request was signed with: its reply must be signed with it
        self._reply_keys: dict[str, ApiKey] = {}
        #: replies dropped because they were not signed with their request's key
        self.unverified = 0

    def expect(self, key: str, signer: ApiKey | None = None) -> asyncio.Future[InferenceReply]:
        """A future for the reply to request ``key`` (call before sending), signed with ``signer``
        when the request is (the key its reply must be signed with)."""
        if signer is not None and self.verify_replies:
            self._reply_keys[key] = signer
        return super().expect(key)

    def forget(self, key: str) -> None:
        super().forget(key)
        self._reply_keys.pop(key, None)

    def _answered(self, key: str, answer: InferenceReply) -> None:
        super()._answered(key, answer)
        self._reply_keys.pop(key, None)

    def _verified(self, reply: InferenceReply, headers: Any, value: bytes | None) -> bool:
        """Whether ``reply`` may be taken: one to a request waiting with a key must be signed with
        that key (else it is dropped, counted and logged); any other, seen by a client with its own
        key, must be signed with that key to be kept (others' replies on a shared topic are
        dropped quietly)."""
        key = self._reply_keys.get(reply.request_id)
        if key is None:
            own = self.signer if self.verify_replies else None
            return own is None or reply_signed_by(own, headers, value)
        if reply_signed_by(key, headers, value):
            return True
        self.unverified += 1
        log.warning(
            "reply to %s dropped: not signed with the key %s of its request (another tenant's request "
            "under this id, or workers that do not sign: kafka_request_auth open)",
            reply.request_id[:80],
            key.key_id,
        )
        return False

    async def _read(self) -> None:
        async for msg in self.consumer:
            try:
                reply = InferenceReply.model_validate_json(msg.value)
            except Exception:
                log.warning("undecodable reply at %s[%d]@%d", msg.topic, msg.partition, msg.offset)
                continue
            if not self._verified(reply, msg.headers, msg.value):
                continue
            if self.keep_replies:
                self.replies.append(reply)
            if self.on_reply is not None:
                self.on_reply(reply)
            self._answered(reply.request_id, reply)

    async def send_raw(
        self, key: bytes | None, value: bytes, headers: list[tuple[str, bytes]] | None = None
    ) -> None:
        """Produce raw bytes (and ``headers``) to the request topic (for bad-input tests and replays)."""
        await self.producer.send_and_wait(self.requests_topic, value=value, key=key, headers=headers)

    async def produce(self, request: dict[str, Any], signer: ApiKey | None = None) -> asyncio.Future[Any]:
        """Enqueue one request record, keyed by its user_id and signed with ``signer`` (default: the
        client's own, if any); the future of the broker's acknowledgement."""
        signer = signer or self.signer
        if signer is not None and "created_at" not in request:
            # a signed request must say when it was made (pipeline/auth.py, check_signed_date)
            request = {**request, "created_at": now_ms()}
        value = json.dumps(request).encode()
        headers = sign(signer, value) if signer is not None else None
        return await self.producer.send(
            self.requests_topic, value=value, key=request["user_id"].encode(), headers=headers
        )

    async def submit(
        self, request: dict[str, Any], *, signer: ApiKey | None = None
    ) -> asyncio.Future[InferenceReply]:
        """Send one request (a dict in the InferenceRequest format), signed with ``signer`` (default:
        the client's own, if any); returns the future of its reply, failed with
        :class:`BrokerError` if the broker never takes the request."""
        request = dict(request)
        request.setdefault("created_at", now_ms())
        request.setdefault("reply_to", self.reply_topic)
        rid = request["request_id"]
        fut = self.expect(rid, signer or self.signer)
        try:
            self.fail_unsent(rid, await self.produce(request, signer))
        except BaseException:
            self.forget(rid)
            raise
        return fut

    async def request(self, request: dict[str, Any], timeout_s: float = 30.0) -> InferenceReply:
        """Send one request and wait for its reply."""
        fut = await self.submit(request)
        await self.producer.flush()
        return await asyncio.wait_for(fut, timeout_s)
