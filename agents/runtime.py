"""What every agent shares in one worker process: settings, topics, metrics, and the send helpers.

Agents stay thin: they read records, call the pure logic in ``pipeline/``, and send through the
helpers here, which return the broker's acknowledgement (retried a few times) so that an offset is
acked only after its reply (or forwarded work item) is safely on the broker. Every reply goes
through :meth:`Runtime.publish`, which records it in the reply book first and sends it once the
record is on the broker, so a request read again after a crash gets the same reply
(docs/architecture.md, "Guarantees").
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import faust
from aiokafka.errors import (
    CorruptRecordException,
    InvalidTopicError,
    MessageSizeTooLargeError,
    PolicyViolationError,
    RecordListTooLargeError,
    TopicAuthorizationFailedError,
)
from aiokafka.partitioner import DefaultPartitioner
from faust.types import EventT

from agents.acks import Acker
from agents.durable_table import DurableTable
from agents.offset_oracle import OffsetOracle
from agents.reply_order import ReplySequencer, task_is_cancelling
from pipeline.auth import KeyRing, request_signers, sign_reply
from pipeline.compat import as_current_event, producer_knows_topic, producer_partitions_for, topic_exists
from pipeline.exceptions import InvalidRequestError
from pipeline.intake_backlog import IntakeBacklog
from pipeline.keys import reply_key
from pipeline.metrics import Metrics
from pipeline.records import (
    DeadLetter,
    ErrorInfo,
    InferenceReply,
    InferenceRequest,
    Timings,
    deadletter_key,
    encode,
    now_ms,
)
from pipeline.replybook import ReplyBook
from pipeline.replyto import PROBE_TIMEOUT_S, KnownTopics, ReplyToPolicy
from pipeline.settings import Settings
from pipeline.topics import TopicNames


def highwater(app: faust.App, tp: Any) -> int | None:
    """The partition's high watermark as the consumer last fetched it, or None (not assigned to this
    worker, or no fetch answered): a plain read of what the consumer's fetcher recorded, no broker call."""
    try:
        value = app.consumer.highwater(tp)
    except Exception:  # a partition being revoked, a consumer not started: unknown, not an error
        return None
    return value if isinstance(value, int) else None


if TYPE_CHECKING:
    from agents.book_sweep import BookSweeper
    from agents.risk import RiskAgents

#: raw bytes kept in a dead letter: base64 and the other fields then stay under a default cluster's
#: 1 MiB message.max.bytes, whatever the request's size
DEADLETTER_RAW_BYTES = 600_000

#: how often a failed send is tried again before the worker gives up (and stops, see Acker)
SEND_ATTEMPTS = 4
#: the broker's answers that no retry changes for a client's reply topic: the topic's configuration
#: or ACLs refuse the record (a transient error, a timeout included, is retried as before)
REFUSED_FOR_GOOD: tuple[type[Exception], ...] = (
    MessageSizeTooLargeError,
    RecordListTooLargeError,
    TopicAuthorizationFailedError,
    PolicyViolationError,
    InvalidTopicError,
    CorruptRecordException,
)

#: how long a reply waits for its reply-book record's acknowledgement before the record is sent
#: again (a record stuck on its way must not hold every later reply back without a word)
RECORD_ACK_TIMEOUT_S = 10.0

log = logging.getLogger("surge.agents")
_PARTITIONER = DefaultPartitioner()


@dataclass
class Runtime:
    settings: Settings
    app: faust.App
    metrics: Metrics
    topics: TopicNames = field(init=False)
    #: the inference agent's state, when this worker runs it (its readiness gates "worker ready")
    inference: Any = None
    #: the intake agent's state (agents.intake.Intake), when this worker runs it
    intake: Any = None
    #: readiness and drains (agents.lifecycle.Lifecycle), set by the worker
    lifecycle: Any = None
    #: the risk agents' state, when this worker runs them (``--role risk``)
    risk: RiskAgents | None = None
    #: recorded replies (a GlobalTable); None only in tools that send no replies
    book: ReplyBook | None = None
    #: deletes expired entries from this worker's store of the reply book (agents/book_sweep.py)
    book_sweeper: BookSweeper | None = None
    #: the reply book's table, whose writes can be awaited until durable (set with ``book``)
    book_table: DurableTable | None = None
    acker: Acker = field(init=False)
    replies_in_order: ReplySequencer = field(init=False)
    reply_policy: ReplyToPolicy = field(init=False)
    #: which reply topics exist (a reply never creates one): pipeline.replyto.KnownTopics
    reply_topics: KnownTopics = field(init=False)
    #: how far this worker's intake is behind (pipeline.intake_backlog; reported by the intake agent)
    intake_backlog: IntakeBacklog = field(init=False)
    #: who may sign a request record, and whose key signs its reply (None: requests are not signed)
    signers: KeyRing | None = field(init=False)
    _topics: dict[str, faust.TopicT] = field(default_factory=dict, init=False)
    _unknown_signers: set[str] = field(default_factory=set, init=False)

    def __post_init__(self) -> None:
        self.topics = TopicNames(self.settings.topic_prefix)
        self.acker = Acker(self.app, OffsetOracle(self.settings))
        self.replies_in_order = ReplySequencer(self._recorded_durably)
        self.reply_policy = ReplyToPolicy(
            self.topics, self.settings.app_id, self.settings.reply_topic_pattern
        )
        self.reply_topics = KnownTopics(lambda name: topic_exists(self.app.producer, name))
        self.intake_backlog = IntakeBacklog(
            self.settings.intake_first_lag_records,
            self.settings.intake_first_stall_ms,
            lambda tp: highwater(self.app, tp),
        )
        self.signers = request_signers(self.settings)

    async def reply_topic(self, reply_to: str | None) -> str:
        """The topic a request's replies go to: its ``reply_to`` when allowed and existing; raises
        :class:`InvalidRequestError` otherwise (docs/architecture.md, "Tenant isolation")."""
        name = self.reply_policy.resolve(reply_to)
        if name != self.topics.replies and not await self.reply_topics.exists(name):
            raise InvalidRequestError(
                f"reply_to topic {name!r} does not exist; create it before naming it "
                "(a reply never creates a topic)"
            )
        return name

    async def safe_reply_topic(self, reply_to: str | None) -> str:
        """``reply_to`` when allowed and existing, else the default replies topic (error replies)."""
        try:
            return await self.reply_topic(reply_to)
        except InvalidRequestError:
            return self.topics.replies

    def topic(self, name: str) -> faust.TopicT:
        """A raw-bytes topic handle, created once per name."""
        t = self._topics.get(name)
        if t is None:
            t = self.app.topic(
                name, key_serializer="raw", value_serializer="raw", partitions=self.settings.partitions
            )
            self._topics[name] = t
        return t

    async def home_partition(self, topic: str, key: bytes) -> int:
        """The partition of ``topic`` that records keyed ``key`` belong on: the one this worker's
        producer sends them to (murmur2, as aiokafka's and the Java client's default partitioners)."""
        parts = sorted(await producer_partitions_for(self.app.producer, topic))
        return int(_PARTITIONER(key, parts, parts))

    async def send(
        self,
        topic: str,
        key: str | bytes | None,
        value: bytes,
        *,
        reply: bool = False,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> Awaitable[Any]:
        """Enqueue one record; returns an awaitable that resolves when the broker has acked it,
        sending again (up to ``SEND_ATTEMPTS`` times, with backoff) when the broker refused it.
        ``reply``: a reply to a client's own topic, dead-lettered if that topic is gone. ``headers``:
        sent with the record and with every retry (a forwarded request keeps its signature,
        docs/architecture.md "Tenant isolation")."""
        k = key.encode() if isinstance(key, str) else key
        fut = await self.topic(topic).send(key=k, value=value, headers=headers)
        return _Delivery(self, topic, k, value, fut, reply, headers)

    async def publish(
        self,
        reply: InferenceReply,
        *,
        tenant: str,
        reply_to: str | None,
        created_at_ms: int | None,
        event: EventT | None,
        digest: str = "",
        record: bool = True,
        key_id: str | None = None,
    ) -> Awaitable[Any]:
        """Record ``reply`` in the reply book (first reply wins), send what was recorded, count it.

        ``digest``: the request's :attr:`~pipeline.records.InferenceRequest.digest` (part of the
        book's key). ``record=False`` for replies to records that never became a request (invalid
        input): those are the same on every read anyway. ``key_id``: the key the request was signed
        with; the reply is signed with it (:meth:`reply_headers`).
        """
        data = encode(reply)
        topic = reply_to or self.topics.replies
        key = reply_key(tenant, reply.user_id, reply.request_id, topic, digest)
        if record and self.book is not None:
            data = await self._record(key, data, event)
        priority = reply.priority or "interactive"
        served = reply.served_from or "none"
        self.metrics.requests.labels(priority=priority, status=reply.status, served_from=served).inc()
        if created_at_ms is not None:
            self.metrics.request_latency.labels(priority=priority).observe(
                max(0, now_ms() - created_at_ms) / 1000
            )
        return await self._send_recorded(key, topic, reply.user_id, data, key_id)

    def reply_headers(self, key_id: str | None, data: bytes) -> list[tuple[str, bytes]] | None:
        """The headers of a reply of ``data`` to a request signed with the key ``key_id``: that key's
        reply signature (pipeline.auth.sign_reply), or None where requests are not signed or the key
        is no longer configured (docs/architecture.md, "Tenant isolation")."""
        if key_id is None or self.signers is None:
            return None
        key = self.signers.by_id(key_id)
        if key is None:
            if key_id not in self._unknown_signers:  # once per key, not once per reply
                self._unknown_signers.add(key_id)
                log.warning(
                    "replies to requests signed with key %s go unsigned: this worker does not have "
                    "that key (SURGE_API_KEYS must be alike on every worker), and clients drop them",
                    key_id[:40],
                )
            return None
        return sign_reply(key, data)

    async def _send_recorded(
        self, key: str, topic: str, user_id: str, data: bytes, key_id: str | None = None
    ) -> Awaitable[Any]:
        """Send a reply once its record in the book is on the broker, after every reply published
        before it (:mod:`agents.reply_order`), signed with the key ``key_id`` (:meth:`reply_headers`;
        a reply sent again is signed again, over the same bytes).

        A reply must never be visible without its record: a worker killed in between would leave
        the client a reply that the request's next owner cannot find, and it would compute another."""
        ack = self.book_table.durable(key) if self.book_table is not None else None

        async def send() -> Awaitable[Any]:
            if not await self.reply_topic_present(topic):
                return await self.undeliverable(topic, user_id, data)
            headers = self.reply_headers(key_id, data)
            return await self.send(topic, user_id, data, reply=topic != self.topics.replies, headers=headers)

        return await self.replies_in_order.submit(key, ack, send)

    async def reply_topic_present(self, topic: str, *, ask_broker: bool = False) -> bool:
        """Whether a reply can go to ``topic``: the default replies topic always; a client's when
        the producer holds its metadata (unless ``ask_broker``) or the broker says it exists, asked
        with a request that cannot create it. Called as each reply is handed to the producer: a
        client's topic deleted after intake checked it made the producer wait for its metadata
        (its request timeout, 30 s) while every reply queued behind it waited too, and then the
        worker stopped; on a broker that creates topics, the reply created it again
        (docs/architecture.md, "Tenant isolation"). A broker that does not answer in time counts
        as "present": the reply is sent as before."""
        if topic == self.topics.replies:
            return True
        if not ask_broker and producer_knows_topic(self.app.producer, topic):
            return True
        try:
            return await asyncio.wait_for(topic_exists(self.app.producer, topic), PROBE_TIMEOUT_S)
        except Exception:
            return True

    async def undeliverable(
        self, topic: str, key: str | bytes | None, data: bytes, refusal: Exception | None = None
    ) -> Awaitable[Any]:
        """A reply whose topic is gone, or refuses it for good (``refusal``: a record too large for
        the topic's ``max.message.bytes``, a policy, no write access): written to the dead-letter
        topic (reason ``reply_topic_missing`` or ``reply_refused``, the reply as its raw record) in
        place of the reply, so its request is acked and nothing waits for a topic that will not
        take it."""
        k = key.encode() if isinstance(key, str) else key
        if refusal is None:
            reason, why = "reply_topic_missing", f"reply topic {topic!r} no longer exists"
        else:
            reason, why = "reply_refused", f"reply topic {topic!r} refused the reply: {refusal!r}"
        dl = DeadLetter.of(topic, -1, -1, reason, why, k, data, DEADLETTER_RAW_BYTES)
        self.metrics.deadletter.labels(reason=reason).inc()
        log.warning("reply dead-lettered: %s", why)
        return await self.send(self.topics.deadletter, None if k is None else deadletter_key(k), encode(dl))

    async def _recorded_durably(self, key: str, ack: Awaitable[Any]) -> None:
        """Wait for a reply's record to be acknowledged, sending it again when its send failed or
        was not acknowledged within ``RECORD_ACK_TIMEOUT_S``."""
        assert self.book_table is not None
        for attempt in range(1, SEND_ATTEMPTS + 1):
            try:
                await asyncio.wait_for(asyncio.shield(ack), RECORD_ACK_TIMEOUT_S)
                return
            except (Exception, asyncio.CancelledError) as exc:
                # a cancelled acknowledgement (not this task's own stop) is a failed send: sent again
                if isinstance(exc, asyncio.CancelledError) and task_is_cancelling():
                    raise
                if attempt == SEND_ATTEMPTS:
                    if isinstance(exc, asyncio.CancelledError):
                        raise RuntimeError(f"the record of {key} was cancelled {attempt} times") from exc
                    raise
                if isinstance(exc, TimeoutError):
                    exc = TimeoutError(f"no acknowledgement after {RECORD_ACK_TIMEOUT_S:g} s")
                log.warning(
                    "recording %s failed (%r), attempt %d of %d; %d replies wait for it",
                    key,
                    exc,
                    attempt,
                    SEND_ATTEMPTS,
                    self.replies_in_order.waiting,
                )
                await asyncio.sleep(0.2 * 2**attempt)
                ack = self._resend_record(key)

    def _resend_record(self, key: str) -> Awaitable[Any]:
        """The acknowledgement of a reply record sent again; a send that cannot even be queued
        counts as one failed attempt (the caller waits and tries again) rather than ending the
        worker."""
        assert self.book_table is not None
        try:
            return self.book_table.resend(key)
        except Exception as exc:
            failed: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
            failed.set_exception(exc)
            return failed

    async def _record(self, key: str, data: bytes, event: EventT | None) -> bytes:
        """Record a reply in the book; what to send. A table write can fail while the producer's
        metadata of the changelog is missing (a fresh topic whose leader is not elected yet): the
        metadata is fetched and the write tried again; a reply is never lost to the book."""
        assert self.book is not None
        for attempt in range(3):
            try:
                with event_context(event):
                    return self.book.record(key, data)
            except Exception as exc:
                log.warning("recording a reply failed (%r), attempt %d", exc, attempt + 1)
                with contextlib.suppress(Exception):
                    topic = f"{self.settings.app_id}-replybook-changelog"
                    await producer_partitions_for(self.app.producer, topic)
                await asyncio.sleep(0.05 * (attempt + 1))
        log.error("reply of %s sent without being recorded", key)
        return data

    def recorded(self, req: InferenceRequest, reply_to: str) -> bytes | None:
        """The reply already recorded for ``req`` to ``reply_to`` (it was answered before a crash),
        or None."""
        if self.book is None:
            return None
        return self.book.get(reply_key(req.tenant, req.user_id, req.request_id, reply_to, req.digest))

    async def resend(
        self, data: bytes, reply_to: str | None, req: InferenceRequest, key_id: str | None = None
    ) -> Awaitable[Any]:
        """Send ``req``'s recorded reply again, byte for byte (once its record is on the broker, when
        this worker wrote it a moment ago), signed with the key ``key_id`` that signed ``req``."""
        self.metrics.replies_repeated.inc()
        topic = reply_to or self.topics.replies
        key = reply_key(req.tenant, req.user_id, req.request_id, topic, req.digest)
        return await self._send_recorded(key, topic, req.user_id, data, key_id)

    async def error_reply(
        self,
        *,
        request_id: str,
        user_id: str,
        reply_to: str | None,
        code: str,
        message: str,
        priority: str | None = None,
        retry_after_ms: int | None = None,
        created_at_ms: int | None = None,
        degradation_level: int = 0,
        timings: Timings | None = None,
        tenant: str = "default",
        event: EventT | None = None,
        digest: str = "",
        record: bool = True,
        key_id: str | None = None,
    ) -> Awaitable[Any]:
        """Publish an error reply (see :meth:`publish`)."""
        reply = InferenceReply(
            request_id=request_id,
            user_id=user_id,
            status="error",
            error=ErrorInfo(code=code, message=message, retry_after_ms=retry_after_ms),
            priority=priority,
            degradation_level=degradation_level,
            timings=timings or Timings(),
        )
        return await self.publish(
            reply,
            tenant=tenant,
            reply_to=reply_to,
            created_at_ms=created_at_ms,
            event=event,
            digest=digest,
            record=record,
            key_id=key_id,
        )

    async def deadletter(self, event: EventT, reason: str, message: str) -> Awaitable[Any]:
        """Write the raw record with the reason to the dead-letter topic."""
        msg = event.message
        raw = msg.value if isinstance(msg.value, bytes) else bytes(str(msg.value), "utf-8")
        key = msg.key if isinstance(msg.key, bytes | None) else bytes(str(msg.key), "utf-8")
        dl = DeadLetter.of(
            msg.topic,
            msg.partition,
            msg.offset,
            reason,
            message,
            key,
            raw or b"",
            DEADLETTER_RAW_BYTES,
        )
        self.metrics.deadletter.labels(reason=reason).inc()
        log.warning("dead letter %s[%d]@%d: %s", msg.topic, msg.partition, msg.offset, dl.message)
        return await self.send(
            self.topics.deadletter, None if key is None else deadletter_key(key), encode(dl)
        )


class _Delivery:
    """The broker's acknowledgement of one record, re-sent on failure (awaitable, no task)."""

    __slots__ = ("fut", "headers", "key", "reply", "rt", "topic", "value")

    def __init__(
        self,
        rt: Runtime,
        topic: str,
        key: bytes | None,
        value: bytes,
        fut: Awaitable[Any],
        reply: bool,
        headers: list[tuple[str, bytes]] | None = None,
    ) -> None:
        self.rt, self.topic, self.key, self.value, self.fut = rt, topic, key, value, fut
        self.reply = reply
        self.headers = headers

    def __await__(self) -> Any:
        return self._wait().__await__()

    def __repr__(self) -> str:
        state = "acked" if isinstance(self.fut, asyncio.Future) and self.fut.done() else "awaiting the broker"
        return f"send to {self.topic} key={self.key!r} ({state})"

    async def _wait(self) -> Any:
        for attempt in range(1, SEND_ATTEMPTS + 1):
            try:
                return await self.fut
            except Exception as exc:
                # a client's reply topic deleted after the producer learnt of it, or one that refuses
                # the reply for good (a client chooses its topic's configuration: a small
                # max.message.bytes made every worker that read the request stop, one after the
                # other): the reply goes to the dead-letter topic rather than failing the worker
                if self.reply and isinstance(exc, REFUSED_FOR_GOOD):
                    return await (await self.rt.undeliverable(self.topic, self.key, self.value, exc))
                if self.reply and not await self.rt.reply_topic_present(self.topic, ask_broker=True):
                    return await (await self.rt.undeliverable(self.topic, self.key, self.value))
                if attempt == SEND_ATTEMPTS:
                    raise
                log.warning(
                    "send to %s failed (%r), attempt %d of %d", self.topic, exc, attempt, SEND_ATTEMPTS
                )
                await asyncio.sleep(0.2 * 2**attempt)
                self.fut = await self.rt.topic(self.topic).send(
                    key=self.key, value=self.value, headers=self.headers
                )
        raise AssertionError("unreachable")


def unacked(stream: faust.StreamT) -> faust.StreamT:
    """``stream`` with Faust's automatic acks off: an agent acks each record itself, once what the
    record produced is on the broker (docs/architecture.md, "Guarantees").

    An agent is handed a :class:`faust.Stream`, but typed as the :class:`faust.StreamT` interface,
    which does not declare ``noack``.
    """
    return cast(faust.Stream[Any], stream).noack()


@contextlib.contextmanager
def event_context(event: EventT | None) -> Iterator[None]:
    """Make ``event`` Faust's current event while writing a table outside the stream's iteration.

    Faust's RocksDB store picks the local partition database from the current event; the inference
    loop writes the answer cache after a model call, when no stream iteration is under way.
    """
    if event is None:
        yield
        return
    with as_current_event(event):
        yield
