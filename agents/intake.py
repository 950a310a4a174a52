"""The intake agent: decode, validate, rate-limit, answer exact repeats, forward by class.

Reads ``surge.requests``; for each record exactly one of: an error reply (+ a dead letter for
bad input), a cached reply, or a WorkItem on ``surge.work.<priority>``. The record's offset is
acked only after what it produced has been acknowledged by the broker.
"""

from __future__ import annotations

import logging

import faust
from faust.types import EventT

from agents.runtime import Runtime, ack_after
from pipeline.cache import AnswerCache
from pipeline.dedup import exact_key, normalize, scope_key
from pipeline.exceptions import InvalidRequestError, RateLimitedError
from pipeline.ratelimit import RateLimitConfig, RateLimiter, TierLimits
from pipeline.records import (
    InferenceReply,
    InferenceRequest,
    Timings,
    WorkItem,
    decode_request,
    encode,
    now_ms,
    salvage_ids,
)
from pipeline.scheduler import absolute_deadline_ms
from pipeline.settings import Settings

log = logging.getLogger("surge.intake")


def rate_limit_config(s: Settings) -> RateLimitConfig:
    return RateLimitConfig(
        users={
            "free": TierLimits(s.user_rate_per_s_free, s.user_burst_free),
            "standard": TierLimits(s.user_rate_per_s_standard, s.user_burst_standard),
            "premium": TierLimits(s.user_rate_per_s_premium, s.user_burst_premium),
        },
        tenant=TierLimits(s.tenant_rate_per_s, s.tenant_burst),
    )


def _int_or_none(value: float | None) -> int | None:
    return None if value is None else int(value)


def request_scope(req: InferenceRequest, model_name: str) -> str:
    return scope_key(req.tenant, req.model or model_name, req.max_tokens, req.temperature, req.logprobs)


class Intake:
    """State of the intake agent in one worker."""

    def __init__(self, rt: Runtime, ratelimit_table: faust.Table, cache: AnswerCache | None) -> None:
        self.rt = rt
        self.limiter = RateLimiter(
            rate_limit_config(rt.settings), ratelimit_table, tenant_shards=rt.settings.partitions
        )
        self.cache = cache
        self.model_name = rt.settings.model

    async def handle(self, stream: faust.StreamT, event: EventT) -> None:
        """Process one record; schedules its ack once its outputs are on the broker."""
        rt, s, msg = self.rt, self.rt.settings, event.message
        futures = []
        try:
            req = decode_request(
                msg.value, msg.key, max_record_bytes=s.max_record_bytes, max_content_bytes=s.max_content_bytes
            )
        except InvalidRequestError as exc:
            ids = salvage_ids(msg.value)
            if ids is not None:
                rid, uid, reply_to = ids
                futures.append(
                    await rt.error_reply(
                        request_id=rid, user_id=uid, reply_to=reply_to, code=exc.code, message=exc.message
                    )
                )
            futures.append(await rt.deadletter(event, "invalid_request", exc.message))
            self._ack_later(stream, event, futures)
            return
        created = req.created_at if req.created_at is not None else int(msg.timestamp * 1000)
        reply_to = req.reply_to or rt.topics.replies
        if s.rate_limit_enabled:
            try:
                self.limiter.check(req.user_id, req.tier, req.tenant, now_ms(), shard=msg.partition)
            except RateLimitedError as exc:
                rt.metrics.rate_limited.labels(scope=exc.scope).inc()
                futures.append(
                    await rt.error_reply(
                        request_id=req.request_id, user_id=req.user_id, reply_to=reply_to, code=exc.code,
                        message=exc.message, retry_after_ms=exc.retry_after_ms, priority=req.priority,
                        created_at_ms=created,
                    )
                )  # fmt: skip
                self._ack_later(stream, event, futures)
                return
        key = None
        if req.cache and self.cache is not None:
            key = exact_key(normalize(req.text()), request_scope(req, self.model_name))
            hit = self.cache.get_exact(key)
            rt.metrics.cache_lookups.labels(layer="exact", result="hit" if hit else "miss").inc()
            if hit is not None:
                reply = InferenceReply(
                    request_id=req.request_id, user_id=req.user_id, status="ok", answer=hit.answer,
                    finish_reason=hit.finish_reason, served_from="cache", model_version=hit.model_version,  # type: ignore[arg-type]
                    priority=req.priority, timings=Timings(total_ms=max(0, now_ms() - created)),
                )  # fmt: skip
                futures.append(await rt.reply(reply, reply_to, created))
                self._ack_later(stream, event, futures)
                return
        item = WorkItem(
            request=req, priority=req.priority, tier=req.tier, reply_to=reply_to, created_at_ms=created,
            arrival_ms=now_ms(), deadline_at_ms=_int_or_none(absolute_deadline_ms(created, s.deadline_ms(req.priority), req.deadline_ms)),
            cache_key=key,
        )  # fmt: skip
        futures.append(await rt.send(rt.topics.work(req.priority), req.user_id, encode(item)))
        self._ack_later(stream, event, futures)

    def _ack_later(self, stream: faust.StreamT, event: EventT, futures: list) -> None:
        self.rt.app.loop.create_task(ack_after(stream, [event], futures))


def register(rt: Runtime, cache: AnswerCache | None) -> Intake:
    """Declare the rate-limit table and the intake agent on ``rt.app``."""
    table = rt.app.Table(
        "ratelimit", default=None, partitions=rt.settings.partitions,
        schema=faust.Schema(key_serializer="json", value_serializer="json"),
    )  # fmt: skip
    intake = Intake(rt, table, cache)

    @rt.app.agent(rt.topic(rt.topics.requests), name="surge.intake")
    async def intake_agent(stream: faust.StreamT) -> None:
        s = stream.noack()
        async for event in s.events():
            try:
                await intake.handle(s, event)
            except Exception as exc:
                log.exception("intake failed on %s", event.message.tp)
                fut = await rt.deadletter(event, "internal", f"internal error: {exc!r}")
                intake._ack_later(s, event, [fut])

    return intake
