"""The inference agent: strict-priority reads, embedding, cache and merge, micro-batches, replies.

Four readers (one per work topic) admit items into one scheduler; a lower class is read only
while no higher class has items waiting, and its partitions are paused while it may not be read,
so backlog waits in Kafka. New items are embedded in batches, answered from the semantic cache,
or merged into an open leader; the rest wait for a micro-batch. The model runs in a worker
thread. A reply is sent for every request and its offset acked only after the broker has it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import faust
from faust.types import EventT
from pydantic import ValidationError

from agents.exceptions import WorkItemError
from agents.outcomes import Outcome, Pending, ReplyWriter
from agents.runtime import Runtime, event_context
from models.base import ChatMessage, ModelBackend, ModelInput, ModelOutput
from models.embedder import Embedder
from pipeline.admin import changelog_topics
from pipeline.batcher import AsyncBatcher, BatchObserver
from pipeline.cache import AnswerCache, CachedAnswer
from pipeline.dedup import exact_key, guard_allows, is_embeddable, normalize, scope_key
from pipeline.degrade import DegradationController, DegradeConfig, MissRateWindow, plan
from pipeline.exceptions import DeadlineExceededError, OverloadedError, SurgeError
from pipeline.isolation import RetryPolicy, run_isolated
from pipeline.merge import MergeRegistry
from pipeline.records import WorkItem, now_ms
from pipeline.scheduler import DeadlinePolicy, Priority, QueuedItem, Scheduler, SchedulerConfig, Tier

log = logging.getLogger("surge.inference")
RANK = {p: i for i, p in enumerate(("realtime", "interactive", "batch", "offline"))}


def decode_work_item(event: EventT) -> WorkItem:
    """The WorkItem in a work-topic record, or :class:`WorkItemError`."""
    msg = event.message
    try:
        return WorkItem.model_validate_json(msg.value)
    except (ValidationError, ValueError, TypeError) as exc:
        raise WorkItemError(msg.topic, msg.partition, msg.offset, str(exc)[:500]) from exc


class _Observer(BatchObserver):
    def __init__(self, inf: Inference) -> None:
        self.inf = inf

    def on_depth(self, depths: Any) -> None:
        m = self.inf.rt.metrics
        total = 0
        for p, n in depths.items():
            m.requests_queue_depth.labels(priority=str(p)).set(n)
            total += n
        m.requests_in_queue_per_worker.set(total)

    def on_flush(self, size: int, limit: int, waits_ms: Any) -> None:
        self.inf.rt.metrics.batch_fill_ratio.observe(size / max(1, limit))


class Inference:
    """State of the inference agents in one worker."""

    def __init__(
        self,
        rt: Runtime,
        model: ModelBackend,
        template_model: ModelBackend | None,
        embedder: Embedder | None,
        cache: AnswerCache | None,
    ) -> None:
        self.rt = rt
        s = rt.settings
        self.model = model
        self.template_model = template_model
        self.embedder = embedder
        self.cache = cache
        cfg = SchedulerConfig(
            deadline_ms={p: s.deadline_ms(p) for p in RANK},
            queue_limit={p: s.queue_limit_per_class for p in RANK},
            deadline_policy={"batch": DeadlinePolicy(s.deadline_policy_batch)},
            max_batch_size=min(s.max_batch_size, model.max_batch_size),
            base_batch_size=min(s.base_batch_size, s.max_batch_size, model.max_batch_size),
            max_wait_ms=s.max_wait_ms,
        )
        self.scheduler = Scheduler(cfg, policy=s.queue_policy)
        self.batcher = AsyncBatcher(self.scheduler, _Observer(self))
        self.merges = MergeRegistry(s.semantic_threshold)
        self.controller = DegradationController(
            DegradeConfig(
                up_queue_depth=s.degrade_up_queue_depth,
                down_queue_depth=s.degrade_down_queue_depth,
                up_miss_rate=s.degrade_up_miss_rate,
                down_miss_rate=s.degrade_down_miss_rate,
                cooldown_ms=s.degrade_cooldown_ms,
                max_tokens_cap=s.degrade_max_tokens_cap,
            )
        )
        self.misses = MissRateWindow()
        self.model_pool = ThreadPoolExecutor(1, thread_name_prefix="surge-model")
        self.embed_pool = ThreadPoolExecutor(1, thread_name_prefix="surge-embed")
        self.retry = RetryPolicy()
        self.replies = ReplyWriter(rt, model)
        self.ready = asyncio.Event()
        self._arrivals: list[Pending] = []
        self._arrived = asyncio.Event()
        self._blocked: set[str] = set()
        self.model_calls = 0

    # ---- start ---------------------------------------------------------------------------------
    async def start(self) -> None:
        """Load the models off the event loop; readers wait for this."""
        loop = asyncio.get_running_loop()
        await loop.run_in_executor(self.model_pool, self.model.load)
        if self.template_model is not None and self.template_model is not self.model:
            await loop.run_in_executor(self.model_pool, self.template_model.load)
        await loop.run_in_executor(self.model_pool, self._warm_up)
        if self.cache is not None:
            self.cache.sync()
            # the answers table picks changelog partitions with the producer's partitioner, which
            # needs the topic's metadata before the first write
            producer = self.rt.app.producer
            await producer.maybe_start()
            for topic in changelog_topics(self.rt.settings):
                await producer._ensure_producer().partitions_for(topic)
        self.ready.set()
        log.info("inference ready: model %s version %s", self.model.name, self.model.version)

    def _warm_up(self) -> None:
        """One tiny call through each model and the embedder, so the first real batch is not the
        one that pays for lazy initialisation (and misses a real-time deadline)."""
        probe = ModelInput(messages=(ChatMessage("user", "warm up"),), max_tokens=1)
        try:
            self.model.infer([probe])
            if self.template_model is not None:
                self.template_model.template_answer(probe)
            if self.embedder is not None:
                self.embedder.embed(["warm up"])
        except Exception:  # a failing warm-up is the first batch's problem, not the worker's
            log.exception("warm-up call failed")

    def status(self) -> dict[str, object]:
        """What /status shows: queue depths, paused topics, open leaders, model calls."""
        return {
            "ready": self.ready.is_set(),
            "depths": {str(p): n for p, n in self.scheduler.depths().items()},
            "arrivals_waiting": len(self._arrivals),
            "blocked_classes": sorted(self._blocked),
            "open_leaders": len(self.merges),
            "model_calls": self.model_calls,
            "batches": self.batcher.batches,
            "degradation_level": self.controller.level,
        }

    # ---- admission (one reader per class) ---------------------------------------------------------
    async def admit(self, priority: str, stream: faust.StreamT, event: EventT) -> None:
        """Called by a work-topic reader for each record, in order."""
        await self.ready.wait()
        s = self.rt.settings
        prio = Priority(priority)
        if not self.scheduler.can_admit(prio):
            # While this reader waits, Faust's flow control pauses the topic's partitions once the
            # stream buffer (stream_buffer_max_records) is full: the backlog stays in Kafka.
            self._blocked.add(priority)
            await self.batcher.wait_admit(prio)
            self._blocked.discard(priority)
        try:
            work = decode_work_item(event)
        except WorkItemError as exc:
            fut = await self.rt.deadletter(event, "invalid_work_item", exc.message)
            self.replies.ack_later(stream, [event], [fut])
            return
        req = work.request
        level = self.controller.level if self.rt.settings.degrade_enabled else 0
        p = plan(
            level, priority, work.tier, req.max_tokens, req.logprobs, max_tokens_cap=s.degrade_max_tokens_cap
        )
        inp = ModelInput(
            messages=tuple(ChatMessage(m.role, m.content) for m in req.chat()),
            max_tokens=p.max_tokens, temperature=req.temperature, logprobs=p.logprobs,
        )  # fmt: skip
        scope = scope_key(req.tenant, req.model or self.model.name, p.max_tokens, req.temperature, p.logprobs)
        pending = Pending(stream, event, work, scope, inp, level=p.level_applied)
        if p.use_template and self.template_model is not None:
            await self.replies.send([Outcome(pending, self._template(pending), "template")])
            return
        self._arrivals.append(pending)
        self._arrived.set()

    # ---- embedding, cache, merge ------------------------------------------------------------------
    async def embed_loop(self) -> None:
        """Embed arrivals in batches, then answer from cache, merge, or queue each one."""
        await self.ready.wait()
        loop = asyncio.get_running_loop()
        s = self.rt.settings
        while True:
            await self._arrived.wait()
            self._arrived.clear()
            items, self._arrivals = self._arrivals, []
            if not items:
                continue
            want = [
                i for i, it in enumerate(items)
                if self.embedder is not None and (s.dedup_enabled or (s.cache_enabled and it.work.request.cache))
                and is_embeddable(it.inp.text, self.embedder.multilingual)
            ]  # fmt: skip
            if want:
                assert self.embedder is not None
                vecs = await loop.run_in_executor(
                    self.embed_pool, self.embedder.embed, [items[i].inp.text for i in want]
                )
                for row, i in enumerate(want):
                    items[i].vector = vecs[row]
            done: list[Outcome] = []
            for it in items:
                try:
                    with event_context(it.event):
                        await self._route(it, done)
                except Exception as exc:
                    log.exception("routing %s failed", it.req_id)
                    done.append(Outcome.error(it, SurgeError(f"internal error: {exc!r}")))
            if done:
                await self.replies.send(done, batch_size=0)

    async def _route(self, it: Pending, done: list[Outcome]) -> None:
        s, m = self.rt.settings, self.rt.metrics
        req = it.work.request
        use_cache = s.cache_enabled and req.cache and self.cache is not None
        if use_cache:
            assert self.cache is not None
            it.cache_key = exact_key(normalize(it.inp.text), it.scope)
            hit = self.cache.get_exact(it.cache_key)
            if hit is None and it.vector is not None:
                found = self.cache.search(
                    it.scope,
                    it.vector,
                    s.semantic_threshold,
                    accept=lambda e: guard_allows(e.text, it.inp.text)[0],
                )
            else:
                found = (hit, 1.0) if hit is not None else None
            m.cache_lookups.labels(layer="semantic", result="hit" if found else "miss").inc()
            if found is not None:
                entry, sim = found
                out = ModelOutput(entry.answer, entry.finish_reason)
                done.append(Outcome(it, out, "cache", entry.request_id, sim, entry.model_version))
                return
        if s.dedup_enabled and req.cache:
            joined = self.merges.find(it.scope, it.inp.text, it.vector, RANK[it.work.priority])
            if joined is not None:
                leader, sim = joined
                leader.followers.append((it, sim))
                return
        item = QueuedItem(
            item_id=req.request_id, user_id=req.user_id, priority=Priority(it.work.priority),
            tier=Tier(it.work.tier), created_at_ms=it.work.created_at_ms,
            deadline_at_ms=it.work.deadline_at_ms, enqueued_at_ms=now_ms(), payload=it,
        )  # fmt: skip
        try:
            self.batcher.put(item)
        except OverloadedError as exc:
            done.append(Outcome.error(it, exc))
            return
        if s.dedup_enabled and req.cache:
            self.merges.open(req.request_id, it.scope, it.inp.text, it.vector, RANK[it.work.priority])

    # ---- batches ---------------------------------------------------------------------------------
    async def batch_loop(self) -> None:
        """Pop micro-batches and run them, one model call at a time."""
        await self.ready.wait()
        while True:
            batch = await self.batcher.next_batch()
            now = now_ms()
            done: list[Outcome] = []
            for q in batch.expired:
                it: Pending = q.payload
                late = int(now - (q.deadline_at_ms or now))
                deadline = int((q.deadline_at_ms or now) - it.work.created_at_ms)
                err = DeadlineExceededError(deadline, late, str(q.priority))
                self.rt.metrics.deadline_missed.labels(priority=str(q.priority)).inc()
                self.misses.record(True, now)
                done.append(Outcome.error(it, err))
                for f, _ in self.merges.close(it.req_id):
                    done.append(Outcome.error(f, err))
            if done:
                await self.replies.send(done, batch_size=0)
            if batch.items:
                try:
                    await self._run(batch.items, batch.limit)
                except Exception as exc:
                    log.exception("batch of %d failed", len(batch.items))
                    err = SurgeError(f"internal error: {exc!r}")
                    await self.replies.send([Outcome.error(q.payload, err) for q in batch.items])
            self._observe_pressure()

    def _observe_pressure(self) -> None:
        if not self.rt.settings.degrade_enabled:
            return
        now = now_ms()
        level = self.controller.observe(self.scheduler.depth(), self.misses.miss_rate(now), now)
        self.rt.metrics.degradation_level.set(level)

    def _degrade_queued(self, items: list[QueuedItem]) -> tuple[list[QueuedItem], list[Outcome]]:
        """Apply the current degradation level to popped items (they may have queued at a lower one).

        Returns the items still to run and the template answers (with their followers) to send.
        """
        s = self.rt.settings
        level = self.controller.level if s.degrade_enabled else 0
        if level == 0:
            return items, []
        keep: list[QueuedItem] = []
        done: list[Outcome] = []
        for q in items:
            it: Pending = q.payload
            req = it.work.request
            p = plan(
                level,
                it.work.priority,
                it.work.tier,
                req.max_tokens,
                req.logprobs,
                max_tokens_cap=s.degrade_max_tokens_cap,
            )
            if p.level_applied <= it.level:
                keep.append(q)
                continue
            it.level = p.level_applied
            if p.use_template and self.template_model is not None:
                out = self._template(it)
                done.append(Outcome(it, out, "template"))
                for f, _ in self.merges.close(it.req_id):
                    f.level = p.level_applied
                    done.append(Outcome(f, out, "template"))
                continue
            it.inp = replace(it.inp, max_tokens=p.max_tokens, logprobs=p.logprobs)
            # a degraded answer is cached under the parameters it was made with, not the asked ones
            it.scope = scope_key(
                req.tenant, req.model or self.model.name, p.max_tokens, req.temperature, p.logprobs
            )
            if it.cache_key is not None:
                it.cache_key = exact_key(normalize(it.inp.text), it.scope)
            keep.append(q)
        return keep, done

    async def _run(self, items: list[QueuedItem], limit: int) -> None:
        loop = asyncio.get_running_loop()
        items, templated = self._degrade_queued(items)
        if templated:
            await self.replies.send(templated, batch_size=0)
        if not items:
            return
        pend: list[Pending] = [q.payload for q in items]
        now = now_ms()
        for _ in items:
            self.misses.record(False, now)
        m = self.rt.metrics
        m.batch_size.observe(len(pend))
        calls: list[int] = []
        t0 = time.perf_counter()
        results = await loop.run_in_executor(
            self.model_pool, run_isolated, [p.inp for p in pend], self.model.infer, self.retry,
            time.sleep, calls.append,
        )  # fmt: skip
        seconds = time.perf_counter() - t0
        self.model_calls += len(calls)
        self.batcher.record_batch(len(pend), seconds)
        m.model_inference_latency.labels(model_version=self.model.version).observe(seconds)
        done: list[Outcome] = []
        for p, res in zip(pend, results, strict=True):
            done.append(Outcome(p, res, "model") if isinstance(res, ModelOutput) else Outcome.error(p, res))
            followers = self.merges.close(p.req_id)
            for f, sim in followers:
                m.merged.inc()
                done.append(
                    Outcome(f, res, "merged", p.req_id, sim)
                    if isinstance(res, ModelOutput)
                    else Outcome.error(f, res)
                )
            if isinstance(res, ModelOutput) and p.cache_key and self.cache is not None:
                self._store(p, res)
        await self.replies.send(done, batch_size=len(pend), inference_ms=seconds * 1000)

    def _store(self, p: Pending, res: ModelOutput) -> None:
        """Put a model answer in the shared cache; a cache failure never costs the reply."""
        assert self.cache is not None and p.cache_key is not None
        entry = CachedAnswer(
            answer=res.answer, finish_reason=res.finish_reason, model_version=self.model.version,
            created_ms=now_ms(), scope=p.scope, text=p.inp.text, request_id=p.req_id,
            vector=p.vector.tolist() if p.vector is not None else None,
        )  # fmt: skip
        try:
            with event_context(p.event):
                self.cache.put(p.cache_key, entry)
        except Exception:
            log.exception("could not store the answer of %s in the cache", p.req_id)

    # ---- replies ---------------------------------------------------------------------------------
    def _template(self, p: Pending) -> ModelOutput:
        assert self.template_model is not None
        out = self.template_model.template_answer(p.inp)
        return out or ModelOutput("We are very busy right now; please try again shortly.", "template")


def register(rt: Runtime, inf: Inference) -> None:
    """Declare the four work-topic readers and the background loops on ``rt.app``."""
    for priority in RANK:

        def make(prio: str) -> Any:
            async def reader(stream: faust.StreamT) -> None:
                s = stream.noack()
                async for event in s.events():
                    try:
                        await inf.admit(prio, s, event)
                    except Exception as exc:
                        log.exception("inference admit failed")
                        fut = await rt.deadletter(event, "internal", f"internal error: {exc!r}")
                        inf.replies.ack_later(s, [event], [fut])

            reader.__name__ = f"inference_{prio}"
            return reader

        rt.app.agent(rt.topic(rt.topics.work(priority)), name=f"surge.inference.{priority}")(make(priority))

    @rt.app.task
    async def start_inference() -> None:
        await inf.start()

    @rt.app.task
    async def embed_loop() -> None:
        await inf.embed_loop()

    @rt.app.task
    async def batch_loop() -> None:
        await inf.batch_loop()
