"""The inference agent: strict-priority reads, embedding, cache and merge, micro-batches, replies.

Four readers (one per work topic) admit items; a reader may take a record only while its class has
room (items waiting to be embedded count, as do queued ones) and no higher class has anything
waiting, so backlog stays in Kafka and strict priority holds across the whole worker. New items
are embedded in batches (higher classes first, batches growing with the backlog), answered from
the semantic cache, or merged into an open leader; the rest wait for a micro-batch. The vector
travels with the item, so the FAQ answerer does not embed again. The model runs in a worker
thread. A reply is recorded and sent for every request and its offset acked, in offset order, only
after the broker has it. See docs/architecture.md, "The path of a request".
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

import faust
from faust.types import EventT
from pydantic import ValidationError

from agents.acks import Ticket
from agents.exceptions import WorkItemError
from agents.intake import scope_of
from agents.outcomes import Outcome, Pending, ReplyWriter
from agents.runtime import Runtime, event_context
from models.base import ChatMessage, ModelBackend, ModelInput, ModelOutput
from models.embedder import Embedder
from pipeline.batcher import AsyncBatcher, BatchObserver
from pipeline.cache import AnswerCache, CachedAnswer
from pipeline.dedup import exact_key, is_embeddable, normalize
from pipeline.degrade import DegradationController, DegradeConfig, MissRateWindow, plan
from pipeline.exceptions import DeadlineExceededError, OverloadedError, SurgeError
from pipeline.isolation import RetryPolicy, run_isolated
from pipeline.keys import reply_key, source_key
from pipeline.merge import MergeRegistry
from pipeline.pairs import decision_from_settings
from pipeline.records import WorkItem, now_ms
from pipeline.scheduler import DeadlinePolicy, QueuedItem, Scheduler, SchedulerConfig
from pipeline.terms import PRIORITIES, RANK, Priority, Tier

log = logging.getLogger("surge.inference")

#: the level-3 answer when the template model has none
BUSY_FALLBACK = "We are very busy right now; please try again shortly."


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
            deadline_ms={Priority(p): s.deadline_ms(p) for p in PRIORITIES},
            queue_limit={Priority(p): s.queue_limit_per_class for p in PRIORITIES},
            deadline_policy={Priority.BATCH: DeadlinePolicy(s.deadline_policy_batch)},
            max_batch_size=min(s.max_batch_size, model.max_batch_size),
            base_batch_size=min(s.base_batch_size, s.max_batch_size, model.max_batch_size),
            max_wait_ms=s.max_wait_ms,
        )
        self.scheduler = Scheduler(cfg, policy=s.queue_policy)
        self.batcher = AsyncBatcher(self.scheduler, _Observer(self))
        #: one merge decision for live merging and the semantic cache (what `surge dedup eval` measures)
        self.decision = decision_from_settings(s)
        self.merges = MergeRegistry(decision=self.decision)
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
        self.template_pool = ThreadPoolExecutor(1, thread_name_prefix="surge-template")
        self.retry = RetryPolicy()
        self.replies = ReplyWriter(rt, model)
        self.replies.on_answered = self._answered
        self.ready = asyncio.Event()
        self.loaded = False
        self.use_vectors = False
        #: admitted items waiting to be embedded, per class
        self._arrivals: dict[str, deque[Pending]] = {p: deque() for p in PRIORITIES}
        self._arrived = asyncio.Event()
        #: set whenever items leave the arrivals or the queue (readers may have room again)
        self._room = asyncio.Event()
        #: requests admitted and not yet answered, by reply key (a redelivered copy becomes a twin)
        self._inflight: dict[str, Pending] = {}
        self._blocked: set[str] = set()
        self.model_calls = 0
        self.embed_calls = 0
        #: moving averages of the measured cost per item (they size ``work_bound``)
        self.embed_ms_per_item = 0.0
        self.model_ms_per_item = 0.0

    # ---- start ---------------------------------------------------------------------------------
    def load(self) -> None:
        """Load and warm up the models and the embedder (blocking). The worker calls this before it
        joins the consumer group, so it never holds partitions it cannot serve yet."""
        if self.loaded:
            return
        self.model.load()
        if self.template_model is not None and self.template_model is not self.model:
            self.template_model.load()
        self._warm_up()
        self.use_vectors = self.embedder is not None and self.model.accepts_vectors_from(self.embedder)
        self.loaded = True

    async def start(self) -> None:
        """Finish start-up on the event loop; readers wait for ``ready``."""
        if not self.loaded:
            await asyncio.get_running_loop().run_in_executor(self.model_pool, self.load)
        if self.cache is not None:
            self.cache.sync()
        await self.rt.lifecycle.writes_ready.wait()
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
                for n in (1, 8, self.rt.settings.embed_max_batch_size):
                    self.embedder.embed(["warm up the embedder"] * n)
        except Exception:  # a failing warm-up is the first batch's problem, not the worker's
            log.exception("warm-up call failed")

    def waiting(self, priority: str | None = None) -> int:
        """Items admitted and not yet in a batch: waiting to be embedded or queued."""
        if priority is None:
            return sum(len(q) for q in self._arrivals.values()) + self.scheduler.depth()
        return len(self._arrivals[priority]) + self.scheduler.depth(Priority(priority))

    def status(self) -> dict[str, object]:
        """What /status shows: queue depths, paused topics, open leaders, model calls."""
        return {
            "ready": self.ready.is_set(),
            "depths": {str(p): n for p, n in self.scheduler.depths().items()},
            "arrivals_waiting": {p: len(q) for p, q in self._arrivals.items()},
            "blocked_classes": sorted(self._blocked),
            "open_leaders": len(self.merges),
            "in_flight": len(self._inflight),
            "model_calls": self.model_calls,
            "embed_calls": self.embed_calls,
            "batches": self.batcher.batches,
            "degradation_level": self.controller.level,
            "unacked_records": self.rt.acker.pending(),
            "work_bound": self.work_bound(),
        }

    # ---- admission (one reader per class) ---------------------------------------------------------
    def can_admit(self, priority: str) -> bool:
        """Whether a reader of ``priority`` may take its next record; called before each read.

        Room in the class (embedding backlog included), room in the embedding backlog, and (under
        EDF) nothing waiting in any higher class. Never while the worker is stopping.
        """
        s = self.rt.settings
        if self.rt.lifecycle is not None and self.rt.lifecycle.stopping:
            return False
        if self.waiting(priority) >= s.queue_limit_per_class:
            return False
        rank = RANK[priority]
        if sum(self.waiting(p) for p in PRIORITIES[: rank + 1]) >= self.work_bound():
            return False
        if s.queue_policy != "edf":
            return sum(len(q) for q in self._arrivals.values()) < s.embed_queue_limit
        # strict priority: a class is read only while no higher class has anything waiting, and
        # lower classes' embedding backlog never holds a higher class back
        if any(self.waiting(p) for p in PRIORITIES[:rank]):
            return False
        return len(self._arrivals[priority]) < s.embed_queue_limit

    def work_bound(self) -> int:
        """How many items this worker keeps admitted: about ``queue_target_ms`` of measured
        embedding and model time per item, at least two full batches, at most the class limit."""
        s = self.rt.settings
        batch = self.scheduler.config.max_batch_size
        per_item_ms = self.embed_ms_per_item + self.model_ms_per_item
        if per_item_ms <= 0:
            return max(2 * batch, min(s.queue_limit_per_class, 8 * batch))
        return int(min(s.queue_limit_per_class, max(2 * batch, s.queue_target_ms / per_item_ms)))

    async def _wait_admit(self, priority: str) -> None:
        while not self.can_admit(priority):
            # While this reader waits, Faust's flow control pauses the topic's partitions once the
            # stream buffer (stream_buffer_max_records) is full: the backlog stays in Kafka.
            self._blocked.add(priority)
            self._room.clear()
            await self._room.wait()
        self._blocked.discard(priority)

    async def admit(self, priority: str, stream: faust.StreamT, event: EventT) -> None:
        """Called by a work-topic reader for each record, in order."""
        rt = self.rt
        generation = rt.acker.generation
        await self.ready.wait()
        await self._wait_admit(priority)
        await rt.lifecycle.hold_if_stopping()
        # tracked only once admitted: a record still held by a waiting reader at a stop or a
        # rebalance was not worked on, and its next owner reads it without it being a repeat
        ticket = await rt.acker.track(event, generation)
        if ticket is None:
            return
        try:
            work = decode_work_item(event)
        except WorkItemError as exc:
            rt.acker.ack_after([ticket], [await rt.deadletter(event, "invalid_work_item", exc.message)])
            return
        req = work.request
        recorded = rt.recorded(req.tenant, req.user_id, req.request_id)
        if recorded is not None:
            rt.acker.ack_after([ticket], [await rt.resend(recorded, work.reply_to, req.user_id)])
            return
        pending = self._pending(stream, event, ticket, work)
        key = reply_key(req.tenant, req.user_id, req.request_id)
        first = self._inflight.get(key)
        if first is not None:  # the same request read again while its first copy is in flight
            first.twins.append(pending)
            return
        self._inflight[key] = pending
        p = self._plan(pending)
        # a template is answered after the embedding stage: from the cache when it can, else from
        # the template model with the item's vector, in a batch, off the event loop
        pending.template = p.use_template and self.template_model is not None
        self._arrivals[priority].append(pending)
        self._arrived.set()

    def _pending(self, stream: faust.StreamT, event: EventT, ticket: Ticket, work: WorkItem) -> Pending:
        req = work.request
        inp = ModelInput(
            messages=tuple(ChatMessage(m.role, m.content) for m in req.chat()),
            max_tokens=req.max_tokens,
            temperature=req.temperature,
            logprobs=req.logprobs,
        )
        msg = event.message
        return Pending(
            stream, event, work, scope="", inp=inp, ticket=ticket,
            lead_id=source_key(msg.topic, msg.partition, msg.offset),
        )  # fmt: skip

    def _plan(self, it: Pending) -> Any:
        """Apply the current degradation level to an item (at admission, and again when popped if
        the level rose meanwhile); sets its level, parameters, scope and cache key."""
        s = self.rt.settings
        level = self.controller.level if s.degrade_enabled else 0
        req = it.work.request
        p = plan(
            level, it.work.priority, it.work.tier, req.max_tokens, req.logprobs,
            max_tokens_cap=s.degrade_max_tokens_cap,
        )  # fmt: skip
        it.level = p.level_applied
        it.inp = replace(it.inp, max_tokens=p.max_tokens, logprobs=p.logprobs)
        # a degraded answer is cached under the parameters it was made with, not the asked ones
        it.scope = scope_of(req, s.served_model, self.model.version, p.max_tokens, p.logprobs)
        it.cache_key = exact_key(normalize(it.inp.text), it.scope) if req.cache else None
        return p

    def _answered(self, it: Pending) -> None:
        req = it.work.request
        key = reply_key(req.tenant, req.user_id, req.request_id)
        if self._inflight.get(key) is it:
            del self._inflight[key]

    # ---- embedding, cache, merge ------------------------------------------------------------------
    def _take_arrivals(self) -> list[Pending]:
        """The next embedding batch: highest classes first, about ``embed_budget_ms`` of measured
        embedding time (at most ``embed_max_batch_size``); a batch holding real-time items stops at
        them, so they never wait for a long embedding call."""
        s = self.rt.settings
        limit = s.embed_max_batch_size
        if self.embed_ms_per_item > 0:
            limit = max(4, min(limit, int(s.embed_budget_ms / self.embed_ms_per_item)))
        out: list[Pending] = []
        for p in PRIORITIES:
            q = self._arrivals[p]
            while q and len(out) < limit:
                out.append(q.popleft())
            if out and p == "realtime":
                break
        return out

    async def embed_loop(self) -> None:
        """Embed arrivals in batches, then answer from cache, merge, or queue each one."""
        await self.ready.wait()
        loop = asyncio.get_running_loop()
        s = self.rt.settings
        while True:
            await self._arrived.wait()
            self._arrived.clear()
            items = self._take_arrivals()
            if any(self._arrivals.values()):
                self._arrived.set()
            if not items:
                continue
            want = [
                i for i, it in enumerate(items)
                if self.embedder is not None
                and (self.use_vectors or s.dedup_enabled or (s.cache_enabled and it.work.request.cache))
                and (self.use_vectors or is_embeddable(it.inp.text, self.embedder.multilingual))
            ]  # fmt: skip
            if want:
                assert self.embedder is not None
                self.rt.metrics.embed_batch_size.observe(len(want))
                self.embed_calls += 1
                t0 = time.perf_counter()
                try:
                    vecs = await loop.run_in_executor(
                        self.embed_pool, self.embedder.embed, [items[i].inp.text for i in want]
                    )
                    self.embed_ms_per_item = _ewma(
                        self.embed_ms_per_item, (time.perf_counter() - t0) * 1000 / len(want)
                    )
                except Exception:
                    log.exception("embedding %d questions failed; they go on without vectors", len(want))
                else:
                    for row, i in enumerate(want):
                        items[i].vector = vecs[row]
                        if self.use_vectors:
                            items[i].inp = replace(items[i].inp, vector=vecs[row])
            done: list[Outcome] = []
            templated: list[Pending] = []
            found = await self._lookups(items)
            for it, hit in zip(items, found, strict=True):
                try:
                    with event_context(it.event):
                        self._route(it, hit, done, templated)
                except Exception as exc:
                    log.exception("routing %s failed", it.req_id)
                    done.append(Outcome.error(it, SurgeError(f"internal error: {type(exc).__name__}")))
            if templated:
                done += await self._templates(templated)
            self._room.set()
            if done:
                await self.replies.send(done, batch_size=0)

    def _semantic_ok(self, it: Pending) -> bool:
        return it.vector is not None and (
            self.embedder is None or is_embeddable(it.inp.text, self.embedder.multilingual)
        )

    def _lookup_all(self, items: list[Pending]) -> list[tuple[CachedAnswer, float] | None]:
        """The cached answer for each item, exact else semantic (None where there is none or the
        item may not use the cache). Runs in the embedding thread: the vector search and the merge
        decision stay off the event loop; the cache writes no store here (docs/architecture.md,
        "Semantic dedup")."""
        s = self.rt.settings
        out: list[tuple[CachedAnswer, float] | None] = []
        for it in items:
            if not (s.cache_enabled and it.work.request.cache and self.cache is not None):
                out.append(None)
                continue
            assert it.cache_key is not None
            # semantic_cache_enabled off: exact hits only (a replay's default, docs/architecture.md, "Replay")
            decision = self.decision if s.semantic_cache_enabled else None
            vector = it.vector if self._semantic_ok(it) else None
            out.append(self.cache.lookup(it.cache_key, it.scope, vector, it.inp.text, decision))
        return out

    async def _lookups(self, items: list[Pending]) -> list[tuple[CachedAnswer, float] | None]:
        if self.cache is None or not self.rt.settings.cache_enabled:
            return [None] * len(items)
        loop = asyncio.get_running_loop()
        try:
            found = await loop.run_in_executor(self.embed_pool, self._lookup_all, items)
        except Exception:
            log.exception("cache lookups of %d questions failed; they go on uncached", len(items))
            return [None] * len(items)
        try:
            self.cache.drop_expired()
        except Exception:  # a cache write failing never costs the batch its answers
            log.warning("dropping expired cache entries failed", exc_info=True)
        return found

    def _route(
        self,
        it: Pending,
        found: tuple[CachedAnswer, float] | None,
        done: list[Outcome],
        templated: list[Pending],
    ) -> None:
        s, m = self.rt.settings, self.rt.metrics
        req = it.work.request
        if s.cache_enabled and req.cache and self.cache is not None:
            m.cache_lookups.labels(layer="semantic", result="hit" if found else "miss").inc()
            if found is not None:
                entry, sim = found
                out = ModelOutput(entry.answer, entry.finish_reason)
                done.append(Outcome(it, out, "cache", entry.request_id, sim, entry.model_version))
                return
        if it.template:
            templated.append(it)
            return
        rank = RANK[it.work.priority]
        vector = it.vector if self._semantic_ok(it) else None
        if s.dedup_enabled and req.cache:
            joined = self.merges.find(it.scope, it.inp.text, vector, rank)
            if joined is not None:
                leader, sim = joined
                leader.followers.append((it, sim))
                return
        item = QueuedItem(
            item_id=it.lead_id, user_id=req.user_id, priority=Priority(it.work.priority),
            tier=Tier(it.work.tier), created_at_ms=it.work.created_at_ms,
            deadline_at_ms=it.work.deadline_at_ms, enqueued_at_ms=now_ms(), payload=it,
        )  # fmt: skip
        try:
            self.batcher.put(item)
        except OverloadedError as exc:
            done.append(Outcome.error(it, exc))
            return
        if s.dedup_enabled and req.cache:
            self.merges.open(it.lead_id, it.scope, it.inp.text, vector, rank)

    async def failed(self, stream: faust.StreamT, event: EventT, exc: Exception) -> None:
        """An internal error on one record: an error reply where the request can be read, a dead
        letter, then the ack (nothing is left without an answer, nothing blocks the partition)."""
        rt = self.rt
        futs = []
        try:
            work = decode_work_item(event)
        except WorkItemError:
            work = None
        if work is not None:
            req = work.request
            self._inflight.pop(reply_key(req.tenant, req.user_id, req.request_id), None)
            futs.append(
                await rt.error_reply(
                    request_id=req.request_id, user_id=req.user_id, reply_to=work.reply_to, code="internal",
                    message=f"internal error: {type(exc).__name__}", priority=work.priority,
                    created_at_ms=work.created_at_ms, tenant=req.tenant, event=event,
                )
            )  # fmt: skip
        futs.append(await rt.deadletter(event, "internal", f"internal error: {exc!r}"))
        ticket = rt.acker.ticket_of(event) or await rt.acker.track(event)
        if ticket is not None:
            rt.acker.ack_after([ticket], futs)

    # ---- batches ---------------------------------------------------------------------------------
    async def batch_loop(self) -> None:
        """Pop micro-batches and run them, one model call at a time."""
        await self.ready.wait()
        while True:
            batch = await self.batcher.next_batch()
            self._room.set()
            now = now_ms()
            done: list[Outcome] = []
            for q in batch.expired:
                it: Pending = q.payload
                late = int(now - (q.deadline_at_ms or now))
                deadline = int((q.deadline_at_ms or now) - it.work.created_at_ms)
                err = DeadlineExceededError(deadline, late, str(q.priority))
                self.rt.metrics.deadline_missed.labels(priority=str(q.priority)).inc()
                if not it.work.client_deadline:
                    self.misses.record(True, now)
                done.append(Outcome.error(it, err))
                for f, _ in self.merges.close(it.lead_id):
                    done.append(Outcome.error(f, err))
            if done:
                await self.replies.send(done, batch_size=0)
            if batch.items:
                try:
                    await self._run(batch.items)
                except Exception as exc:
                    log.exception("batch of %d failed", len(batch.items))
                    err = SurgeError(f"internal error: {type(exc).__name__}")
                    failed: list[Outcome] = []
                    for q in batch.items:
                        failed.append(Outcome.error(q.payload, err))
                        failed.extend(Outcome.error(f, err) for f, _ in self.merges.close(q.payload.lead_id))
                    await self.replies.send(failed)

    async def pressure_loop(self) -> None:
        """Read the pressure on a timer (also when no batch runs), so the level steps down again."""
        s = self.rt.settings
        while True:
            await asyncio.sleep(s.degrade_tick_ms / 1000)
            self.observe_pressure()

    def observe_pressure(self) -> int:
        """Feed the controller and the gauges; returns the level."""
        m = self.rt.metrics
        total = 0
        for p in PRIORITIES:
            n = self.waiting(p)
            m.requests_queue_depth.labels(priority=p).set(n)
            total += n
        m.requests_in_queue_per_worker.set(total)
        if not self.rt.settings.degrade_enabled:
            return 0
        now = now_ms()
        level = self.controller.observe(total, self.misses.miss_rate(now), now)
        m.degradation_level.set(level)
        return level

    def _degrade_queued(self, items: list[QueuedItem]) -> tuple[list[QueuedItem], list[Pending]]:
        """Apply the current degradation level to popped items (they may have queued at a lower one).

        Returns the items still to run and those that now get the template answer.
        """
        if not self.rt.settings.degrade_enabled or self.controller.level == 0:
            return items, []
        keep: list[QueuedItem] = []
        templated: list[Pending] = []
        for q in items:
            it: Pending = q.payload
            before = it.level
            p = self._plan(it)
            if p.level_applied > before and p.use_template and self.template_model is not None:
                templated.append(it)
            else:
                keep.append(q)
        return keep, templated

    async def _templates(self, items: list[Pending]) -> list[Outcome]:
        """Template answers for ``items`` (and their followers), computed in a worker thread."""
        assert self.template_model is not None
        loop = asyncio.get_running_loop()
        outs = await loop.run_in_executor(
            self.template_pool, self.template_model.template_answers, [p.inp for p in items]
        )
        done: list[Outcome] = []
        for it, out in zip(items, outs, strict=True):
            out = out or ModelOutput(BUSY_FALLBACK, "template")
            done.append(Outcome(it, out, "template"))
            for f, _ in self.merges.close(it.lead_id):
                f.level = it.level
                done.append(Outcome(f, out, "template"))
        return done

    async def _run(self, items: list[QueuedItem]) -> None:
        loop = asyncio.get_running_loop()
        items, templated = self._degrade_queued(items)
        if templated:
            await self.replies.send(await self._templates(templated), batch_size=0)
        if not items:
            return
        pend: list[Pending] = [q.payload for q in items]
        now = now_ms()
        for p in pend:
            if not p.work.client_deadline:
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
        self.model_ms_per_item = _ewma(self.model_ms_per_item, seconds * 1000 / len(pend))
        self.model_calls += len(calls)
        self.batcher.record_batch(len(pend), seconds)
        m.model_inference_latency.labels(model_version=self.model.version).observe(seconds)
        done: list[Outcome] = []
        for p, res in zip(pend, results, strict=True):
            done.append(Outcome(p, res, "model") if isinstance(res, ModelOutput) else Outcome.error(p, res))
            for f, sim in self.merges.close(p.lead_id):
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
            vector=p.vector.tolist() if p.vector is not None and self._semantic_ok(p) else None,
        )  # fmt: skip
        try:
            with event_context(p.event):
                self.cache.put(p.cache_key, entry)
        except Exception:
            log.exception("could not store the answer of %s in the cache", p.req_id)


def _ewma(old: float, new: float, alpha: float = 0.2) -> float:
    return new if old <= 0 else (1 - alpha) * old + alpha * new


def register(rt: Runtime, inf: Inference) -> None:
    """Declare the four work-topic readers and the background loops on ``rt.app``."""
    for priority in PRIORITIES:

        def make(prio: str) -> Any:
            async def reader(stream: faust.StreamT) -> None:
                s = stream.noack()
                async for event in s.events():
                    try:
                        await inf.admit(prio, s, event)
                    except Exception as exc:
                        log.exception("inference admit failed")
                        await inf.failed(s, event, exc)

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

    @rt.app.task
    async def pressure_loop() -> None:
        await inf.pressure_loop()
