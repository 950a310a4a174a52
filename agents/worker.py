"""Assemble one worker process: the Faust app, its tables, agents for the role, and /metrics."""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import sys
from typing import Any

import faust
from faust.types import TableT

from agents import inference as inference_agent
from agents import intake as intake_agent
from agents.book_sweep import SWEEP_INTERVAL_S, BookSweeper
from agents.durable_table import DurableTable
from agents.lifecycle import Lifecycle, commit_in_order, serve_pages
from agents.runtime import Runtime
from pipeline.admin import changelog_config
from pipeline.app import create_app, table_store_options
from pipeline.cache import AnswerCache
from pipeline.compat import flush_changelog_buffers
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


def _json_global_table(app: faust.App, settings: Settings, name: str, **extra: Any) -> TableT:
    """A global table of JSON keys and values, one partition per source partition, in a bounded
    RocksDB store (docs/architecture.md, "Guarantees")."""
    return app.GlobalTable(
        name,
        default=None,
        partitions=settings.partitions,
        use_partitioner=True,
        schema=faust.Schema(key_serializer="json", value_serializer="json"),
        options=table_store_options(settings),
        **extra,
    )


def install_event_loop(settings: Settings) -> None:
    """Make ``settings.event_loop`` the process's event loop policy; called once by ``surge worker``
    before anything makes a loop (its topic set-up, then Faust and mode: the worker's loop and the
    consumer thread's). Not part of :func:`build_worker_app`: a policy is process-wide, and a test or
    tool that builds a worker inside its own running loop must not change the loop of everything
    else it runs afterwards."""
    if settings.event_loop == "uvloop":
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    else:
        asyncio.set_event_loop_policy(None)


def build_worker_app(settings: Settings) -> tuple[faust.App, Runtime]:
    """The app with everything ``settings.role`` asks for, ready for ``faust.Worker``."""
    # the embedding and model threads give the GIL up at each native call and wait to take it back
    # while the event loop runs (docs/architecture.md, "Threads and the GIL")
    sys.setswitchinterval(settings.gil_switch_interval_ms / 1000)
    # short-lived objects die in the young generation instead of setting off full collections
    # (docs/architecture.md, "Garbage collection")
    gc.set_threshold(settings.gc_young_threshold_objects, *gc.get_threshold()[1:])
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

    answers = _json_global_table(app, settings, "answers", on_changelog_event=learn_answer)
    cache = (
        AnswerCache(
            answers, ttl_s=settings.cache_ttl_s, max_entries=settings.cache_max_entries, clock_ms=now_ms
        )
        if settings.cache_enabled
        else None
    )
    replybook = _json_global_table(
        app,
        settings,
        "replybook",
        extra_topic_configs=changelog_config(settings, f"{settings.app_id}-replybook-changelog"),
    )
    rt.book_table = DurableTable(replybook)
    rt.book = ReplyBook(rt.book_table, ttl_ms=settings.reply_record_ttl_s * 1000, clock_ms=now_ms)
    sweeper = rt.book_sweeper = BookSweeper(
        replybook, settings.partitions, settings.reply_record_ttl_s * 1000
    )

    @app.timer(interval=SWEEP_INTERVAL_S)
    async def sweep_reply_book() -> None:
        sweeper.tick(now_ms())

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
        if embedder is not None and settings.embed_chunk_size:
            embedder.batch_size = settings.embed_chunk_size
        inf = inference_agent.Inference(rt, model, template, embedder, cache)
        inference_agent.register(rt, inf)
        rt.inference = inf

    sources = [rt.topics.requests, *(rt.topics.work(p) for p in PRIORITIES)]
    life = rt.lifecycle = Lifecycle(app, rt, source_topics=sources)

    # other workers' answers and recorded replies into this worker's stores (pipeline/compat.py)
    commit_in_order(life, on_commit_timer=lambda: flush_changelog_buffers(app))

    @app.task
    async def warm_writes() -> None:
        await life.warm_writes()

    @app.task
    async def announce_ready() -> None:
        await life.watch_ready()

    def describe() -> dict[str, object]:
        body: dict[str, object] = {}
        inf = rt.inference
        if inf is not None:
            body.update(inf.status())
        if intake is not None:
            body["ratelimit_buckets_swept"] = intake.swept
            body["intake_triage_queued"] = len(intake.triage)
            body["intake_triage_overtakes"] = intake.triage.overtakes
        if cache is not None:
            body["cache"] = cache.stats()
        return body

    gpu = GpuSampler(rt.metrics)
    serve_pages(life, ready=life.ready.is_set, describe=describe, before_scrape=gpu.sample)

    return app, rt
