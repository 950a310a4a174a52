"""The inference agent: strict-priority reads, embedding, cache and merge, micro-batches, replies.

Four readers (one per work topic) admit items; a reader may take a record only while its class has
room (items waiting to be embedded count, as do queued ones) and no higher class has anything
waiting, so backlog stays in Kafka and strict priority holds across the whole worker. New items
are embedded in batches (higher classes first, batches growing with the backlog), answered from
the semantic cache, or merged into an open leader; the rest wait for a micro-batch. The vector
travels with the item, so the FAQ answerer does not embed again. The model runs in a worker
thread. A reply is recorded and sent for every request and its offset acked, in offset order, only
after the broker has it. See docs/architecture.md, "The path of a request".

The decisions are pure code, tested without Faust: what becomes of an embedded item in
:mod:`pipeline.routing`, degradation re-planning in :mod:`pipeline.replan`, the queue's and the
controller's configs in :mod:`pipeline.inference_config`. This module keeps the glue: readers,
threads, replies and metrics.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, cast

import faust
from faust.types import TP, ChannelT, EventT
from pydantic import ValidationError

from agents.acks import Ticket
from agents.exceptions import WorkItemError
from agents.outcomes import BUSY_FALLBACK, Outcome, Pending, ReplyWriter, request_input
from agents.runtime import Runtime, event_context, unacked
from agents.shed import answers_at_once, answers_class_at_once, template_answer
from models.base import ChatMessage, ModelBackend, ModelInput, ModelOutput
from models.embedder import Embedder
from pipeline.batcher import AsyncBatcher, BatchObserver
from pipeline.cache import AnswerCache, CachedAnswer
from pipeline.compat import producer_buffer_size
from pipeline.dedup import is_embeddable
from pipeline.degrade import DegradationController, DegradePlan, MissRateWindow, pressure_depth
from pipeline.embed_window import EmbedWindow
from pipeline.exceptions import DeadlineExceededError, DeadlineUnreachableError, SurgeError
from pipeline.inference_config import degrade_config, scheduler_config
from pipeline.intake_backlog import holding_would_block
from pipeline.isolation import RetryPolicy, run_isolated
from pipeline.keys import cache_key, reply_key, scope_of, source_key
from pipeline.merge import MergeRegistry
from pipeline.pairs import decision_from_settings
from pipeline.queue_wait import UNREACHABLE_FROM_LEVEL, QueueWait
from pipeline.records import WorkItem, now_ms
from pipeline.replan import level_in_force, request_plan, split_popped
from pipeline.routing import (
    Cached,
    Refused,
    RoutingRules,
    Templated,
    embed_batch_limit,
    embed_slices,
    expired_before_embedding,
    route,
    take_arrivals,
)
from pipeline.scheduler import DeadlinePolicy, QueuedItem, Scheduler
from pipeline.terms import PRIORITIES, RANK, Priority

log = logging.getLogger("surge.inference")

#: how often a batch or offline reader held back by the intake's backlog looks again, s
INTAKE_RECHECK_S = 0.02


def stream_buffer_filling(stream: faust.StreamT) -> bool:
    """Whether Faust's buffer of ``stream`` (its channel's queue, shared by the topic's partitions)
    is close enough to full that a reader holding back could fill it, and a full one blocks the
    delivery of records to every stream of the worker (docs/architecture.md, "Intake first")."""
    queue = cast(ChannelT, stream.channel).queue
    return holding_would_block(queue.qsize(), queue.maxsize)


def decode_work_item(event: EventT) -> WorkItem:
    """The WorkItem in a work-topic record, or :class:`WorkItemError`."""
    msg = event.message
    if msg.value is None:  # a tombstone: nothing to decode
        raise WorkItemError(msg.topic, msg.partition, msg.offset, "the record has no value")
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
        self.scheduler = Scheduler(scheduler_config(s, model.max_batch_size), policy=s.queue_policy)
        self.batcher = AsyncBatcher(self.scheduler, _Observer(self))
        #: one merge decision for live merging and the semantic cache (what `surge dedup eval` measures)
        self.decision = decision_from_settings(s)
        self.merges = MergeRegistry(decision=self.decision)
        self.controller = DegradationController(degrade_config(s))
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
        #: items of the embedding call under way (taken from the arrivals, not yet queued), per class
        self._embedding: dict[str, int] = {}
        #: admitted items waiting to be embedded, per class
        self._arrivals: dict[str, deque[Pending]] = {priority: deque() for priority in PRIORITIES}
        self._arrived = asyncio.Event()
        #: when the idle embedding stage waits for company (pipeline/embed_window.py)
        self.embed_window = EmbedWindow(rt.settings.embed_max_wait_ms)
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
        #: each class's recent waits in the model queue (pipeline/queue_wait.py)
        self.queue_wait = QueueWait(max(1, rt.settings.unreachable_window_ms))
        self.unreachable_refused = 0

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
            arrived = sum(len(waiting) for waiting in self._arrivals.values())
            return arrived + sum(self._embedding.values()) + self.scheduler.depth()
        embedding = self._embedding.get(priority, 0)
        return len(self._arrivals[priority]) + embedding + self.scheduler.depth(Priority(priority))

    def status(self) -> dict[str, object]:
        """What /status shows: queue depths, paused topics, open leaders, model calls."""
        return {
            "ready": self.ready.is_set(),
            "depths": {str(priority): n for priority, n in self.scheduler.depths().items()},
            "arrivals_waiting": {priority: len(waiting) for priority, waiting in self._arrivals.items()},
            "blocked_classes": sorted(self._blocked),
            "open_leaders": len(self.merges),
            "followers_waiting": self.merges.followers(),
            "in_flight": len(self._inflight),
            "model_calls": self.model_calls,
            "embed_calls": self.embed_calls,
            "batches": self.batcher.batches,
            "degradation_level": self.controller.level,
            "unacked_records": self.rt.acker.pending(),
            "unacked_by_partition": self.rt.acker.describe(),
            "sends_awaiting_broker": self.rt.acker.awaiting_broker(),
            "sends_reported_stuck": self.rt.acker.stuck_reported,
            "replies_waiting_for_their_record": self.rt.replies_in_order.waiting,
            "given_back_records": self.rt.acker.given_back,
            "acked_again_without_work": self.rt.acker.done_again,
            "work_bound": self.work_bound(),
            "refused_as_unreachable": self.unreachable_refused,
        }

    # ---- admission (one reader per class) ---------------------------------------------------------
    def can_admit(self, priority: str, buffer_filling: bool = False) -> bool:
        """Whether a reader of ``priority`` may take its next record; called before each read.

        Room in the class (embedding backlog included), room in the embedding backlog, and (under
        EDF) nothing waiting in any higher class. Never while the worker is stopping or giving up its
        partitions (a record held then is read again by its partition's owner). ``buffer_filling``:
        the reader's stream buffer is close to full, and holding on for the intake could stop the
        intake itself (:func:`pipeline.intake_backlog.holding_would_block`).
        """
        s = self.rt.settings
        life = self.rt.lifecycle
        if life is not None and (life.stopping or life.revoking):
            return False
        if answers_class_at_once(self, priority):
            # every record of the class is answered at admission (agents/shed.py): it takes no place
            # in the embedding stage or the queue, so neither strict priority nor the work bound holds
            # it back; the intake-first rule and the producer's buffer still do
            if not buffer_filling and self._yields_to_intake(priority):
                return False
            return len(self._arrivals[priority]) < s.embed_queue_limit
        if self.waiting(priority) >= s.queue_limit_per_class:
            return False
        rank = RANK[priority]
        if sum(self.waiting(higher) for higher in PRIORITIES[: rank + 1]) >= self.work_bound():
            return False
        if s.queue_policy != "edf":
            return sum(len(waiting) for waiting in self._arrivals.values()) < s.embed_queue_limit
        # strict priority: a class is read only while no higher class has anything waiting, and
        # lower classes' embedding backlog never holds a higher class back
        if any(self.waiting(higher) for higher in PRIORITIES[:rank]):
            return False
        if not buffer_filling and self._yields_to_intake(priority):
            return False
        return len(self._arrivals[priority]) < s.embed_queue_limit

    def unsent_writes(self) -> int:
        """Writes made and not yet handed to the producer: table writes in Faust's producer buffer,
        the reply book's records in its outbox, and replies waiting (in order) for their records.
        A real-time reply waits behind all of them."""
        rt = self.rt
        book = rt.book_table.waiting() if rt.book_table is not None else 0
        return producer_buffer_size(rt.app) + book + rt.replies_in_order.waiting

    def _yields_to_intake(self, priority: str) -> bool:
        """Batch and offline work waits while this worker's intake is behind on the request topic
        (pipeline.intake_backlog), or while many writes wait to be handed to the producer
        (:meth:`unsent_writes`; docs/architecture.md, "Intake first")."""
        if RANK[priority] < RANK[Priority.BATCH]:
            return False
        s = self.rt.settings
        if s.changelog_buffer_limit_records and self.unsent_writes() > s.changelog_buffer_limit_records:
            return True
        if not s.intake_first_enabled:
            return False
        backlog = self.rt.intake_backlog
        gave_way = backlog.gave_way
        behind = backlog.behind(now_ms())
        if backlog.gave_way != gave_way:
            log.warning(
                "the intake took no request for %d ms although requests wait: batch and offline "
                "reading go on (Faust's producer buffer %d; %d admitted, %d waiting to be embedded)",
                s.intake_first_stall_ms,
                producer_buffer_size(self.rt.app),
                sum(self.waiting(p) for p in PRIORITIES),
                sum(len(w) for w in self._arrivals.values()),
            )
        return behind

    def work_bound(self) -> int:
        """How many items this worker keeps admitted: about ``queue_target_ms`` of measured
        embedding and model time per item, at least two full batches, at most the class limit."""
        s = self.rt.settings
        batch = self.scheduler.config.max_batch_size
        per_item_ms = self.embed_ms_per_item + self.model_ms_per_item
        if per_item_ms <= 0:
            return max(2 * batch, min(s.queue_limit_per_class, 8 * batch))
        return int(min(s.queue_limit_per_class, max(2 * batch, s.queue_target_ms / per_item_ms)))

    async def _wait_admit(self, priority: str, stream: faust.StreamT) -> None:
        while not self.can_admit(priority, stream_buffer_filling(stream)):
            # While this reader waits, Faust's flow control pauses the topic's partitions once the
            # stream buffer (stream_buffer_max_records) is full: the backlog stays in Kafka.
            self._blocked.add(priority)
            self._room.clear()
            if self._yields_to_intake(priority):
                # the intake catching up or the buffer being sent sets no event here: look again shortly
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._room.wait(), INTAKE_RECHECK_S)
            else:
                await self._room.wait()
        self._blocked.discard(priority)

    async def admit(self, priority: str, stream: faust.StreamT, event: EventT) -> None:
        """Called by a work-topic reader for each record, in order."""
        rt = self.rt
        generation = rt.acker.generation
        await self.ready.wait()
        if rt.acker.is_repeat(event, generation):  # dropped untouched, as track() would after the wait
            return
        if rt.acker.done_here(event, generation):  # finished before a rebalance: acked, no work
            await rt.acker.track(event, generation)
            return
        await self._wait_admit(priority, stream)
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
        recorded = rt.recorded(req, work.reply_to)
        if recorded is not None:
            again = await rt.resend(recorded, work.reply_to, req, work.key_id)
            rt.acker.ack_after([ticket], [again])
            return
        pending = self._pending(stream, event, ticket, work)
        key = reply_key(req.tenant, req.user_id, req.request_id, work.reply_to, req.digest)
        first = self._inflight.get(key)
        if first is not None:  # the same request read again while its first copy is in flight
            first.twins.append(pending)
            return
        self._inflight[key] = pending
        degrade_plan = self._plan(pending, self.level())
        pending.template = degrade_plan.use_template and self.template_model is not None
        if pending.template and answers_at_once(self, degrade_plan):
            # answered now when the template reads no vector and the cache holds nothing for it
            # (agents/shed.py); else after the embedding stage, from the cache or the template
            answer = template_answer(self, pending.inp, pending.scope, pending.cache_key)
            if answer is not None:
                await self.replies.send([Outcome(pending, answer, "template")])
                return
        self._arrivals[priority].append(pending)
        self.embed_window.arrived(_clock_ms())
        self._arrived.set()

    def wake_readers(self) -> None:
        """Let readers waiting for admission look again (a rebalance's drain is over)."""
        self._room.set()

    def give_back(self, revoked: set[TP]) -> int:
        """Called by a rebalance's drain once its grace is over: hand back the admitted items of
        ``revoked`` partitions that have not reached the model (waiting to be embedded, or queued),
        with the followers merged into them and their twins. Nothing is answered or acked for them
        here: their partitions' owner reads them again.
        See docs/architecture.md, "Readiness and failover".
        A leader stays when one of its followers or twins is of a partition this worker keeps
        (Faust's rebalances revoke every partition, so that is for safety). Returns how many
        records were given back."""

        def copies(pending: Pending) -> list[Pending]:
            return [pending, *pending.twins]

        def whole(pending: Pending) -> list[Pending]:
            leader = self.merges.get(pending.lead_id)
            followers = [follower for follower, _ in leader.followers] if leader is not None else []
            return [copy for one in [pending, *followers] for copy in copies(one)]

        def movable(pending: Pending) -> bool:
            return all(copy.event.message.tp in revoked for copy in whole(pending))

        items: list[Pending] = []
        for waiting in self._arrivals.values():
            keep: list[Pending] = []
            for pending in waiting:
                (items if movable(pending) else keep).append(pending)
            waiting.clear()
            waiting.extend(keep)
        items.extend(queued.payload for queued in self.scheduler.take_where(lambda q: movable(q.payload)))
        given = 0
        for pending in items:
            for one in [pending, *(follower for follower, _ in self.merges.close(pending.lead_id))]:
                self._answered(one)
                for copy in copies(one):
                    self.rt.acker.put_back(copy.ticket)
                    given += 1
        if items:
            self._room.set()
        return given

    def _pending(self, stream: faust.StreamT, event: EventT, ticket: Ticket, work: WorkItem) -> Pending:
        msg = event.message
        return Pending(
            stream,
            event,
            work,
            scope="",
            inp=request_input(work.request),
            ticket=ticket,
            lead_id=source_key(msg.topic, msg.partition, msg.offset),
        )

    def level(self) -> int:
        """The degradation level requests are planned at now (the intake reads it too: agents/shed.py)."""
        return level_in_force(self.controller.level, self.rt.settings.degrade_enabled)

    def _plan(self, pending: Pending, level: int) -> DegradePlan:
        """Apply degradation ``level`` to an item (at admission, and again when popped if the level
        rose meanwhile); sets its level, parameters, scope and cache key."""
        s = self.rt.settings
        req = pending.work.request
        degrade_plan = request_plan(pending.work, level, s.degrade_max_tokens_cap)
        pending.level = degrade_plan.level_applied
        pending.inp = replace(pending.inp, max_tokens=degrade_plan.max_tokens, logprobs=degrade_plan.logprobs)
        # a degraded answer is cached under the parameters it was made with, not the asked ones
        pending.scope = scope_of(
            req, s.served_model, self.model.version, degrade_plan.max_tokens, degrade_plan.logprobs
        )
        pending.cache_key = cache_key(pending.inp.text, pending.scope) if req.cache else None
        return degrade_plan

    def _answered(self, pending: Pending) -> None:
        req = pending.work.request
        key = reply_key(req.tenant, req.user_id, req.request_id, pending.work.reply_to, req.digest)
        if self._inflight.get(key) is pending:
            del self._inflight[key]

    # ---- embedding, cache, merge ------------------------------------------------------------------
    def _embed_limit(self) -> int:
        """Items the next embedding call takes: about ``embed_budget_ms`` of measured time."""
        s = self.rt.settings
        return embed_batch_limit(s.embed_max_batch_size, s.embed_budget_ms, self.embed_ms_per_item)

    def _take_arrivals(self, realtime_only: bool = False) -> tuple[list[Pending], list[Pending]]:
        """The next embedding batch (:func:`pipeline.routing.take_arrivals`), sized to about
        ``embed_budget_ms`` of measured embedding time, and the items met on the way whose deadline
        has passed: they get ``deadline_exceeded`` without being embedded (docs/architecture.md,
        "Degradation")."""
        limit = self._embed_limit()
        arrivals = self._arrivals
        if realtime_only:  # the other classes' arrivals stay where they are
            arrivals = {p: arrivals[p] if p == Priority.REALTIME else deque() for p in PRIORITIES}
        now = now_ms()
        policy = self.scheduler.config.deadline_policy
        # from level 2 on, an item below real-time that would wait in the model queue past its
        # deadline is refused before its embedding, as if expired (pipeline/queue_wait.py)
        refuses = self.rt.settings.unreachable_window_ms > 0 and self.level() >= UNREACHABLE_FROM_LEVEL
        ahead_ms = limit * self.embed_ms_per_item if refuses else None
        waits = self.queue_wait

        def expired(pending: Pending) -> bool:
            work = pending.work
            rejects = policy[work.priority] is DeadlinePolicy.REJECT
            if expired_before_embedding(work.deadline_at_ms, rejects, now):
                return True
            if ahead_ms is None or not rejects or work.priority is Priority.REALTIME:
                return False
            pending.unreachable = waits.unreachable(str(work.priority), work.deadline_at_ms, now, ahead_ms)
            return pending.unreachable is not None

        return take_arrivals(arrivals, limit, expired)

    def _missed(
        self, pending: Pending, deadline_at_ms: float | None, priority: str, now: float
    ) -> list[Outcome]:
        """The ``deadline_exceeded`` replies of an item whose deadline passed (and of its followers),
        counted as a miss (unless the client set the deadline itself)."""
        late = int(now - (deadline_at_ms or now))
        deadline = int((deadline_at_ms or now) - pending.work.created_at_ms)
        missed = DeadlineExceededError(deadline, late, priority)
        unreachable = pending.unreachable
        if unreachable is not None:
            self.unreachable_refused += 1
            left, wait, ahead = int(unreachable.left_ms), int(unreachable.wait_ms), int(unreachable.ahead_ms)
            missed = DeadlineUnreachableError(deadline, left, wait, ahead, priority)
        self.rt.metrics.deadline_missed.labels(priority=priority).inc()
        # a refusal is the level's own shedding, like a template: counted in the miss rate it held
        # the level up after a failover's backlog (docs/architecture.md, "Degradation")
        if not pending.work.client_deadline and unreachable is None:
            self.misses.record(True, now)
        done = [Outcome.error(pending, missed)]
        for follower, _ in self.merges.close(pending.lead_id):
            done += self._orphaned(follower, now)
        return done

    def _orphaned(self, follower: Pending, now: float) -> list[Outcome]:
        """A follower whose leader missed its deadline: its own ``deadline_exceeded`` when its own
        deadline has passed too, else routed again on its own (it joins another open leader or
        becomes one), with nothing to reply yet. A follower once failed with its leader: a request
        whose client asked for 300 ms took down every request that joined it, with 5 s each
        (docs/architecture.md, "Semantic dedup")."""
        work = follower.work
        if work.deadline_at_ms is not None and work.deadline_at_ms <= now:
            own = int(work.deadline_at_ms - work.created_at_ms)
            late = int(now - work.deadline_at_ms)
            return [Outcome.error(follower, DeadlineExceededError(own, late, str(work.priority)))]
        decision = route(
            follower,
            None,
            rules=self._routing_rules(),
            merges=self.merges,
            enqueue=self.batcher.put,
            vector=follower.vector if self._semantic_ok(follower) else None,
            now_ms=now,
        )
        return [Outcome.error(follower, decision.error)] if isinstance(decision, Refused) else []

    async def embed_loop(self) -> None:
        """Embed arrivals in batches, then answer from cache, merge, or queue each one."""
        await self.ready.wait()
        while True:
            idle = not any(self._arrivals.values())
            await self._arrived.wait()
            if idle:
                await self._hold_window()
            self._arrived.clear()
            items, expired = self._take_arrivals()
            if any(self._arrivals.values()):
                self._arrived.set()
            await self._embed_and_route(items, expired)

    async def _hold_window(self) -> None:
        """The stage was idle and an item arrived: wait a little for company when arrivals come
        often enough that a call of several questions is likely (:class:`EmbedWindow`), so MiniLM
        runs fewer, fuller calls; a real-time arrival or a full batch closes the window."""
        s = self.rt.settings
        if self.embedder is None or not (self.use_vectors or s.dedup_enabled or s.cache_enabled):
            return
        window = self.embed_window
        if not window.open(_clock_ms()):
            return
        limit = min(self._embed_limit(), s.embed_queue_limit)
        arrivals = self._arrivals
        while left_ms := window.left_ms(
            _clock_ms(), sum(map(len, arrivals.values())), limit, bool(arrivals[Priority.REALTIME])
        ):
            self._arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._arrived.wait(), left_ms / 1000)

    async def _embed_and_route(self, items: list[Pending], expired: list[Pending]) -> None:
        """One batch of the embedding stage: the expired ones answered late, the others embedded,
        then answered from cache, merged, or queued."""
        if expired:
            now = now_ms()
            late: list[Outcome] = []
            for pending in expired:
                late += self._missed(pending, pending.work.deadline_at_ms, str(pending.work.priority), now)
            self._room.set()
            await self.replies.send(late, batch_size=0)
        if not items:
            return
        # admission counts them until they are queued (or answered); a real-time batch served in the
        # middle of another adds its own
        counts = Counter(str(pending.work.priority) for pending in items)
        self._embedding = dict(Counter(self._embedding) + counts)
        try:
            await self._embed(items)
            done, templated = await self._route_all(items)
        finally:
            left = Counter(self._embedding)
            left.subtract(counts)
            self._embedding = {p: n for p, n in left.items() if n > 0}
        if templated:
            done += await self._templates(templated)
        self._room.set()
        if done:
            await self.replies.send(done, batch_size=0)

    async def _realtime_first(self) -> None:
        """Between the calls of a lower-class batch: embed and route the real-time arrivals waiting,
        as batches of their own (they never yield, so this does not nest further)."""
        while self._arrivals[Priority.REALTIME]:
            await self._embed_and_route(*self._take_arrivals(realtime_only=True))

    async def _embed(self, items: list[Pending]) -> None:
        """Give each item that needs one its vector (off the event loop); an item the model can take
        the vector of carries it into its model input too. A batch without real-time items is
        embedded one forward pass per call, and real-time arrivals are served between the calls
        (:func:`pipeline.routing.embed_slices`)."""
        s = self.rt.settings
        embedder = self.embedder
        if embedder is None:
            return
        # an item level 3 sends to a template that reads no vector skips the embedding: the level
        # sheds MiniLM's cost, at the price of semantic cache hits (exact ones are still looked up)
        template = self.template_model
        shed = template is not None and not template.template_needs_vectors()
        # a request with ``cache: false`` is never merged, looked up or cached
        # (pipeline/routing.py, ``RoutingRules``): its vector would serve only a model that reads it
        shortcuts = s.dedup_enabled or s.cache_enabled
        want = [
            i
            for i, pending in enumerate(items)
            if (self.use_vectors or (shortcuts and pending.work.request.cache))
            and (self.use_vectors or is_embeddable(pending.inp.text, embedder.multilingual))
            and not (shed and pending.template)
        ]
        if not want:
            return
        self.rt.metrics.embed_batch_size.observe(len(want))
        self.embed_calls += 1
        yields = s.embed_yield_to_realtime and all(items[i].work.priority != Priority.REALTIME for i in want)
        slices = embed_slices([len(items[i].inp.text) for i in want], embedder.batch_size, yields)
        loop = asyncio.get_running_loop()
        for n, part in enumerate(slices):
            if n:
                await self._realtime_first()
            rows = [want[k] for k in part]
            t0 = time.perf_counter()
            try:
                vecs = await loop.run_in_executor(
                    self.embed_pool, embedder.embed, [items[i].inp.text for i in rows]
                )
            except Exception:
                log.exception("embedding %d questions failed; they go on without vectors", len(rows))
                continue
            per_item_ms = (time.perf_counter() - t0) * 1000 / len(rows)
            self.embed_ms_per_item = _ewma(self.embed_ms_per_item, per_item_ms)
            for row, i in enumerate(rows):
                items[i].vector = vecs[row]
                if self.use_vectors:
                    items[i].inp = replace(items[i].inp, vector=vecs[row])

    async def _route_all(self, items: list[Pending]) -> tuple[list[Outcome], list[Pending]]:
        """Look the embedded items up and route each one: the replies due now, and those sent to the
        template answer."""
        done: list[Outcome] = []
        templated: list[Pending] = []
        found = await self._lookups(items)
        for pending, hit in zip(items, found, strict=True):
            try:
                with event_context(pending.event):
                    self._route(pending, hit, done, templated)
            except Exception as exc:
                log.exception("routing %s failed", pending.req_id)
                done.append(Outcome.error(pending, SurgeError(f"internal error: {type(exc).__name__}")))
        return done, templated

    def _semantic_ok(self, pending: Pending) -> bool:
        return pending.vector is not None and (
            self.embedder is None or is_embeddable(pending.inp.text, self.embedder.multilingual)
        )

    def _routing_rules(self) -> RoutingRules:
        s = self.rt.settings
        return RoutingRules(cache_on=s.cache_enabled and self.cache is not None, dedup_on=s.dedup_enabled)

    def _lookup_all(self, items: list[Pending]) -> list[tuple[CachedAnswer, float] | None]:
        """The cached answer for each item, exact else semantic (None where there is none or the
        item may not use the cache). Runs in the embedding thread: the vector search and the merge
        decision stay off the event loop; the cache writes no store here (docs/architecture.md,
        "Semantic dedup")."""
        s = self.rt.settings
        rules = self._routing_rules()
        out: list[tuple[CachedAnswer, float] | None] = []
        for pending in items:
            if self.cache is None or not rules.uses_cache(pending.work):
                out.append(None)
                continue
            assert pending.cache_key is not None
            # semantic_cache_enabled off: exact hits only (a replay's default, docs/architecture.md, "Replay")
            decision = self.decision if s.semantic_cache_enabled else None
            vector = pending.vector if self._semantic_ok(pending) else None
            out.append(
                self.cache.lookup(pending.cache_key, pending.scope, vector, pending.inp.text, decision)
            )
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
        pending: Pending,
        found: tuple[CachedAnswer, float] | None,
        done: list[Outcome],
        templated: list[Pending],
    ) -> None:
        """Route one embedded item (:func:`pipeline.routing.route`) and record what became of it."""
        rules = self._routing_rules()
        if rules.uses_cache(pending.work):
            result = "hit" if found is not None else "miss"
            self.rt.metrics.cache_lookups.labels(layer="semantic", result=result).inc()
        decision = route(
            pending,
            found,
            rules=rules,
            merges=self.merges,
            enqueue=self.batcher.put,
            vector=pending.vector if self._semantic_ok(pending) else None,
            now_ms=now_ms(),
        )
        if isinstance(decision, Cached):
            entry = decision.entry
            answer = ModelOutput(entry.answer, entry.finish_reason)
            done.append(
                Outcome(pending, answer, "cache", entry.request_id, decision.similarity, entry.model_version)
            )
            self._remember(pending, entry, decision.similarity)
        elif isinstance(decision, Templated):
            templated.append(pending)
        elif isinstance(decision, Refused):
            done.append(Outcome.error(pending, decision.error))

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
            self._inflight.pop(
                reply_key(req.tenant, req.user_id, req.request_id, work.reply_to, req.digest), None
            )
            futs.append(
                await rt.error_reply(
                    request_id=req.request_id,
                    user_id=req.user_id,
                    reply_to=work.reply_to,
                    code="internal",
                    message=f"internal error: {type(exc).__name__}",
                    priority=work.priority,
                    created_at_ms=work.created_at_ms,
                    tenant=req.tenant,
                    event=event,
                    digest=req.digest,
                    key_id=work.key_id,
                )
            )
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
            for queued in (*batch.items, *batch.expired):
                self.queue_wait.observe(str(queued.priority), now - queued.enqueued_at_ms, now)
            done: list[Outcome] = []
            for expired in batch.expired:
                done += self._missed(expired.payload, expired.deadline_at_ms, str(expired.priority), now)
            if done:
                await self.replies.send(done, batch_size=0)
            if batch.items:
                try:
                    await self._run(batch.items)
                except Exception as exc:
                    log.exception("batch of %d failed", len(batch.items))
                    err = SurgeError(f"internal error: {type(exc).__name__}")
                    failed: list[Outcome] = []
                    for queued in batch.items:
                        failed.append(Outcome.error(queued.payload, err))
                        failed.extend(
                            Outcome.error(follower, err)
                            for follower, _ in self.merges.close(queued.payload.lead_id)
                        )
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
        s = self.rt.settings
        depths = {priority: self.waiting(priority) for priority in PRIORITIES}
        for priority, n in depths.items():
            m.requests_queue_depth.labels(priority=priority).set(n)
        m.requests_in_queue_per_worker.set(sum(depths.values()))
        if not s.degrade_enabled:
            return 0
        now = now_ms()
        depth = pressure_depth(depths, {p: s.deadline_ms(p) for p in PRIORITIES})
        before = self.controller.level
        level = self.controller.observe(depth, self.misses.miss_rate(now), now)
        m.degradation_level.set(level)
        if level != before:  # a class the level now templates whole may be read at once
            self._room.set()
        return level

    def _degrade_queued(self, items: list[QueuedItem]) -> tuple[list[QueuedItem], list[Pending]]:
        """Apply the current degradation level to popped items (they may have queued at a lower one;
        :func:`pipeline.replan.split_popped`). Returns the items still to run and those that now
        get the template answer."""
        return split_popped(
            items,
            level=self.level(),
            template_available=self.template_model is not None,
            replan=self._plan,
        )

    async def _templates(self, items: list[Pending]) -> list[Outcome]:
        """Template answers for ``items`` (and their followers), computed in a worker thread."""
        assert self.template_model is not None
        loop = asyncio.get_running_loop()
        outs = await loop.run_in_executor(
            self.template_pool, self.template_model.template_answers, [pending.inp for pending in items]
        )
        done: list[Outcome] = []
        for pending, out in zip(items, outs, strict=True):
            answer = out or ModelOutput(BUSY_FALLBACK, "template")
            done.append(Outcome(pending, answer, "template"))
            for follower, _ in self.merges.close(pending.lead_id):
                follower.level = pending.level
                done.append(Outcome(follower, answer, "template"))
        return done

    async def _run(self, items: list[QueuedItem]) -> None:
        loop = asyncio.get_running_loop()
        items, templated = self._degrade_queued(items)
        if templated:
            await self.replies.send(await self._templates(templated), batch_size=0)
        if not items:
            return
        batch: list[Pending] = [queued.payload for queued in items]
        now = now_ms()
        for pending in batch:
            if not pending.work.client_deadline:
                self.misses.record(False, now)
        m = self.rt.metrics
        m.batch_size.observe(len(batch))
        calls: list[int] = []
        t0 = time.perf_counter()
        results = await loop.run_in_executor(
            self.model_pool,
            run_isolated,
            [pending.inp for pending in batch],
            self.model.infer,
            self.retry,
            time.sleep,
            calls.append,
        )
        seconds = time.perf_counter() - t0
        self.model_ms_per_item = _ewma(self.model_ms_per_item, seconds * 1000 / len(batch))
        self.model_calls += len(calls)
        self.batcher.record_batch(len(batch), seconds)
        m.model_inference_latency.labels(model_version=self.model.version).observe(seconds)
        done: list[Outcome] = []
        for pending, res in zip(batch, results, strict=True):
            done.append(
                Outcome(pending, res, "model")
                if isinstance(res, ModelOutput)
                else Outcome.error(pending, res)
            )
            followers = self.merges.close(pending.lead_id)
            for follower, sim in followers:
                m.merged.inc()
                # the level its answer was made at: the leader may have been re-planned higher
                follower.level = pending.level
                done.append(
                    Outcome(follower, res, "merged", pending.req_id, sim)
                    if isinstance(res, ModelOutput)
                    else Outcome.error(follower, res)
                )
            if isinstance(res, ModelOutput) and pending.cache_key and self.cache is not None:
                entry = self._entry(pending, res)
                self._put(pending, entry)
                for follower, sim in followers:
                    self._remember(follower, entry, sim)
        await self.replies.send(done, batch_size=len(batch), inference_ms=seconds * 1000)

    def _remember(self, pending: Pending, entry: CachedAnswer, similarity: float) -> None:
        """Store the answer a merged or semantically cached request got under its own exact key, so
        that its repeats get the same answer at intake (docs/architecture.md, "Semantic dedup")."""
        if self.cache is None or pending.cache_key is None or not self.rt.settings.semantic_cache_enabled:
            return
        remembered = entry.remembered_as(pending.inp.text, similarity, pending.scope)
        if remembered is not None:
            self._put(pending, remembered)

    def _put(self, pending: Pending, entry: CachedAnswer) -> None:
        """Write one cache entry in ``pending``'s event context; a cache failure never costs the reply."""
        assert self.cache is not None and pending.cache_key is not None
        try:
            with event_context(pending.event):
                self.cache.put(pending.cache_key, entry)
        except Exception:
            log.exception("could not store the answer of %s in the cache", pending.req_id)

    def _entry(self, pending: Pending, res: ModelOutput) -> CachedAnswer:
        """The cache entry of a model answer."""
        return CachedAnswer(
            answer=res.answer,
            finish_reason=res.finish_reason,
            model_version=self.model.version,
            created_ms=now_ms(),
            scope=pending.scope,
            text=pending.inp.text,
            request_id=pending.req_id,
            vector=pending.vector.tolist()
            if pending.vector is not None and self._semantic_ok(pending)
            else None,
        )


def _clock_ms() -> float:
    """A monotonic clock in ms, for the embedding window."""
    return time.monotonic() * 1000.0


def _ewma(old: float, new: float, alpha: float = 0.2) -> float:
    return new if old <= 0 else (1 - alpha) * old + alpha * new


def register(rt: Runtime, inf: Inference) -> None:
    """Declare the four work-topic readers and the background loops on ``rt.app``."""
    for priority in PRIORITIES:

        def make(prio: str) -> Any:
            async def reader(stream: faust.StreamT) -> None:
                records = unacked(stream)
                async for event in records.events():
                    try:
                        await inf.admit(prio, records, event)
                    except Exception as exc:
                        log.exception("inference admit failed")
                        await inf.failed(records, event, exc)

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
