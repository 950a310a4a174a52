"""Assemble one worker process: the Faust app, its tables, agents for the role, and /metrics."""

from __future__ import annotations

import json
import logging
import os
import socket
import time
from typing import Any

import faust
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from agents import inference as inference_agent
from agents import intake as intake_agent
from agents.lifecycle import Lifecycle
from agents.runtime import Runtime
from pipeline.admin import changelog_config
from pipeline.app import create_app, table_store_options
from pipeline.cache import AnswerCache
from pipeline.metrics import GpuSampler, create_metrics
from pipeline.records import now_ms
from pipeline.replybook import ReplyBook
from pipeline.settings import Settings
from pipeline.terms import PRIORITIES

log = logging.getLogger("surge.worker")


def _json_kv(event: Any) -> tuple[str, Any]:
    """Key and value of a changelog event, decoded from JSON where they are still bytes."""
    key, value = event.key, event.value
    if isinstance(key, bytes | bytearray):
        key = json.loads(key)
    if isinstance(value, bytes | bytearray):
        value = json.loads(value) if value else None
    return str(key), value


def build_worker_app(settings: Settings) -> tuple[faust.App, Runtime]:
    """The app with everything ``settings.role`` asks for, ready for ``faust.Worker``."""
    if settings.role == "risk":
        from agents.risk import build_risk_app

        return build_risk_app(settings)
    app = create_app(settings)
    rt = Runtime(settings, app, create_metrics())
    cache: AnswerCache | None = None

    async def learn_answer(event: Any) -> None:
        # each answer another worker stores reaches this worker's semantic index as it arrives
        if cache is not None:
            cache.learn(*_json_kv(event))

    answers = app.GlobalTable(
        "answers", default=None, partitions=settings.partitions, use_partitioner=True,
        schema=faust.Schema(key_serializer="json", value_serializer="json"),
        on_changelog_event=learn_answer, options=table_store_options(settings),
    )  # fmt: skip
    cache = (
        AnswerCache(
            answers, ttl_s=settings.cache_ttl_s, max_entries=settings.cache_max_entries, clock_ms=now_ms
        )
        if settings.cache_enabled
        else None
    )
    replybook = app.GlobalTable(
        "replybook", default=None, partitions=settings.partitions, use_partitioner=True,
        schema=faust.Schema(key_serializer="json", value_serializer="json"),
        extra_topic_configs=changelog_config(settings, f"{settings.app_id}-replybook-changelog"),
        options=table_store_options(settings),
    )  # fmt: skip
    rt.book = ReplyBook(replybook, ttl_ms=settings.reply_record_ttl_s * 1000, clock_ms=now_ms)
    from models.registry import build_model

    model = build_model(settings)
    intake = None
    if settings.role in ("intake", "all"):
        intake = intake_agent.register(rt, cache, model.peek_version())
    if settings.role in ("inference", "all"):
        from models.embedder import shared_embedder
        from models.template import build_template

        template = build_template(settings, model)
        embedder = (
            shared_embedder(settings.embedder_path)
            # an exact-only cache (semantic_cache_enabled off) needs no embedder
            if (settings.dedup_enabled or (settings.cache_enabled and settings.semantic_cache_enabled))
            else None
        )
        inf = inference_agent.Inference(rt, model, template, embedder, cache)
        inference_agent.register(rt, inf)
        rt.inference = inf

    sources = [rt.topics.requests, *(rt.topics.work(p) for p in PRIORITIES)]
    life = rt.lifecycle = Lifecycle(app, rt, source_topics=sources)

    @app.on_partitions_revoked.connect
    async def drain_on_revoke(app: faust.App, revoked: set[Any], **_: Any) -> None:
        await life.on_revoked(revoked)

    @app.on_partitions_assigned.connect
    async def seek_sources(app: faust.App, assigned: set[Any], **_: Any) -> None:
        # every source partition starts at its committed offset, else the log start (agents/acks.py)
        rt.acker.keep_only(assigned)
        await rt.acker.seek_to_starts([tp for tp in assigned if tp.topic in life.source_topics])

    @app.timer(interval=settings.commit_interval_ms / 1000)
    async def commit_released() -> None:
        # the Acker commits what its ledgers released and checks for holes (agents/acks.py)
        await rt.acker.commit()
        await rt.acker.check_holes(time.monotonic())

    @app.task
    async def warm_writes() -> None:
        await life.warm_writes()

    @app.task
    async def announce_ready() -> None:
        await life.watch_ready()

    @app.page("/readyz")
    async def readyz(web: faust.web.Web, request: faust.web.Request) -> faust.web.Response:
        ready = life.ready.is_set()
        return web.json({"ready": ready, "serving": life.can_serve()}, status=200 if ready else 503)

    gpu = GpuSampler(rt.metrics)
    content_type = CONTENT_TYPE_LATEST.split(";")[0]

    @app.page("/metrics")
    async def metrics_page(web: faust.web.Web, request: faust.web.Request) -> faust.web.Response:
        gpu.sample()
        return web.bytes(generate_latest(rt.metrics.registry), content_type=content_type)

    @app.page("/status")
    async def status(web: faust.web.Web, request: faust.web.Request) -> faust.web.Response:
        inf = rt.inference
        body: dict[str, object] = {"role": settings.role, "assigned": len(app.consumer.assignment())}
        if inf is not None:
            body.update(inf.status())
        if intake is not None:
            body["ratelimit_buckets_swept"] = intake.swept
        if cache is not None:
            body["cache"] = cache.stats()
        return web.json(body)

    @app.page("/healthz")
    async def healthz(web: faust.web.Web, request: faust.web.Request) -> faust.web.Response:
        return web.json({"ok": True, "worker": settings.worker_id or f"{socket.gethostname()}:{os.getpid()}"})

    return app, rt
