"""A producer-side client: send InferenceRequests, await their InferenceReplies by request_id.

Used by ``surge send``, ``surge demo``, the gateway, the benchmarks and the tests. It reads its reply
topic without a consumer group (all partitions, from the end at start), so many clients can share
one reply topic; each picks the replies it is waiting for.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Callable, Mapping
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from pipeline.compat import refresh_metadata
from pipeline.records import InferenceReply, now_ms

log = logging.getLogger("surge.client")


class SurgeClient:
    """Async client of one surge deployment."""

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
    ) -> None:
        """``security``: aiokafka's TLS/SASL options, :func:`pipeline.kafka_security.client_options`."""
        self.bootstrap = bootstrap
        self.requests_topic = requests_topic
        self.reply_topic = reply_topic
        self.on_reply = on_reply
        self.from_beginning = from_beginning
        #: keep every reply in ``replies`` (tests, the demo); a long-running gateway turns it off
        self.keep_replies = keep_replies
        auth = dict(security or {})
        self.producer = AIOKafkaProducer(
            bootstrap_servers=bootstrap, acks="all", linger_ms=2, max_request_size=8 << 20, **auth
        )
        self.consumer = AIOKafkaConsumer(
            bootstrap_servers=bootstrap,
            enable_auto_commit=False,
            auto_offset_reset="latest",
            fetch_max_wait_ms=50,
            **auth,
        )
        self._waiting: dict[str, asyncio.Future[InferenceReply]] = {}
        self.replies: list[InferenceReply] = []
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        await self.producer.start()
        await self.consumer.start()
        parts: set[int] | None = None
        for _ in range(100):
            parts = self.consumer.partitions_for_topic(self.reply_topic)
            if parts:
                break
            await refresh_metadata(self.consumer)
            await asyncio.sleep(0.1)
        if not parts:
            raise RuntimeError(f"reply topic {self.reply_topic!r} does not exist")
        tps = [TopicPartition(self.reply_topic, p) for p in sorted(parts)]
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
        await self.producer.stop()

    async def __aenter__(self) -> SurgeClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def _read(self) -> None:
        async for msg in self.consumer:
            try:
                reply = InferenceReply.model_validate_json(msg.value)
            except Exception:
                log.warning("undecodable reply at %s[%d]@%d", msg.topic, msg.partition, msg.offset)
                continue
            if self.keep_replies:
                self.replies.append(reply)
            if self.on_reply is not None:
                self.on_reply(reply)
            fut = self._waiting.pop(reply.request_id, None)
            if fut is not None and not fut.done():
                fut.set_result(reply)

    async def send_raw(self, key: bytes | None, value: bytes) -> None:
        """Produce raw bytes to the request topic (for bad-input tests and replays)."""
        await self.producer.send_and_wait(self.requests_topic, value=value, key=key)

    def expect(self, request_id: str) -> asyncio.Future[InferenceReply]:
        """A future for the reply to ``request_id`` (call before sending)."""
        fut = self._waiting.get(request_id)
        if fut is None:
            fut = asyncio.get_running_loop().create_future()
            self._waiting[request_id] = fut
        return fut

    def forget(self, request_id: str) -> None:
        """Stop waiting for ``request_id`` (after a timeout); a late reply is then ignored."""
        self._waiting.pop(request_id, None)

    async def submit(self, request: dict[str, Any]) -> asyncio.Future[InferenceReply]:
        """Send one request (a dict in the InferenceRequest format); returns the future of its reply."""
        request = dict(request)
        request.setdefault("created_at", now_ms())
        request.setdefault("reply_to", self.reply_topic)
        fut = self.expect(request["request_id"])
        await self.producer.send(
            self.requests_topic, value=json.dumps(request).encode(), key=request["user_id"].encode()
        )
        return fut

    async def request(self, request: dict[str, Any], timeout_s: float = 30.0) -> InferenceReply:
        """Send one request and wait for its reply."""
        fut = await self.submit(request)
        await self.producer.flush()
        return await asyncio.wait_for(fut, timeout_s)
