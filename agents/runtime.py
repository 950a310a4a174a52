"""What every agent shares in one worker process: settings, topics, metrics, and the send helpers.

Agents stay thin: they read records, call the pure logic in ``pipeline/``, and send through the
helpers here, which return the broker's acknowledgement futures so that an offset is acked only
after its reply (or forwarded work item) is safely on the broker.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import weakref
from collections.abc import Awaitable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import faust
from faust.streams import _current_event
from faust.types import EventT

from pipeline.metrics import Metrics
from pipeline.records import DeadLetter, ErrorInfo, InferenceReply, Timings, encode, now_ms
from pipeline.settings import Settings
from pipeline.topics import TopicNames

log = logging.getLogger("surge.agents")


@dataclass
class Runtime:
    settings: Settings
    app: faust.App
    metrics: Metrics
    topics: TopicNames = field(init=False)
    #: the inference agent's state, when this worker runs it (its readiness gates "worker ready")
    inference: Any = None
    _topics: dict[str, faust.TopicT] = field(default_factory=dict, init=False)

    def __post_init__(self) -> None:
        self.topics = TopicNames(self.settings.topic_prefix)

    def topic(self, name: str) -> faust.TopicT:
        """A raw-bytes topic handle, created once per name."""
        t = self._topics.get(name)
        if t is None:
            t = self.app.topic(
                name, key_serializer="raw", value_serializer="raw", partitions=self.settings.partitions
            )
            self._topics[name] = t
        return t

    async def send(self, topic: str, key: str | bytes | None, value: bytes) -> Awaitable[Any]:
        """Enqueue one record; returns the future that resolves when the broker has acked it."""
        k = key.encode() if isinstance(key, str) else key
        return await self.topic(topic).send(key=k, value=value)

    async def reply(
        self, reply: InferenceReply, reply_to: str | None, created_at_ms: int | None
    ) -> Awaitable[Any]:
        """Send one reply and count it in the metrics."""
        priority = reply.priority or "interactive"
        served = reply.served_from or "none"
        self.metrics.requests.labels(priority=priority, status=reply.status, served_from=served).inc()
        if created_at_ms is not None:
            self.metrics.request_latency.labels(priority=priority).observe(
                max(0, now_ms() - created_at_ms) / 1000
            )
        return await self.send(reply_to or self.topics.replies, reply.user_id, encode(reply))

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
    ) -> Awaitable[Any]:
        reply = InferenceReply(
            request_id=request_id,
            user_id=user_id,
            status="error",
            error=ErrorInfo(code=code, message=message, retry_after_ms=retry_after_ms),  # type: ignore[arg-type]
            priority=priority,  # type: ignore[arg-type]
            degradation_level=degradation_level,
            timings=timings or Timings(),
        )
        return await self.reply(reply, reply_to, created_at_ms)

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
            self.settings.max_record_bytes,
        )
        self.metrics.deadletter.labels(reason=reason).inc()
        log.warning("dead letter %s[%d]@%d: %s", msg.topic, msg.partition, msg.offset, message)
        return await self.send(self.topics.deadletter, key, encode(dl))


async def ack_after(
    stream: faust.StreamT, events: Iterable[EventT], futures: Iterable[Awaitable[Any]]
) -> None:
    """Ack ``events`` once every future (broker acks of what they produced) has resolved.

    If a send fails the events stay un-acked, so their offsets are not committed and the records
    are read again after a restart (at-least-once).
    """
    try:
        await asyncio.gather(*futures)
    except Exception:
        log.exception("a send failed; leaving its source records un-acked for redelivery")
        return
    for event in events:
        await stream.ack(event)


@contextlib.contextmanager
def event_context(event: EventT) -> Iterator[None]:
    """Make ``event`` Faust's current event while writing a table outside the stream's iteration.

    Faust's RocksDB store picks the local partition database from the current event; the inference
    loop writes the answer cache after a model call, when no stream iteration is under way.
    """
    token = _current_event.set(weakref.ref(event))
    try:
        yield
    finally:
        _current_event.reset(token)
