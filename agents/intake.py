"""The intake agent: decode, validate, rate-limit, answer exact repeats, forward by class.

Reads ``surge.requests`` into a triage queue whose handler serves the highest class first
(pipeline/triage.py; docs/architecture.md, "Triage at the intake"). Where requests must be signed
(``kafka_request_auth``), the handler checks each record's signature first and serves it as its
key's tenant, tier and priority (:func:`pipeline.auth.authorize`). Then, for each record exactly one of: an error reply (+ a dead letter for bad input, an unsigned
record included), the reply recorded for it before (a redelivery), a cached reply, the level-3 template
(agents/shed.py), or a WorkItem on ``surge.work.<priority>``. The record's offset is acked, in offset order, only after what it
produced has been acknowledged by the broker (docs/architecture.md, "The path of a request").
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any

import faust
from faust.types import TP, EventT, TableT

from agents.acks import Ticket
from agents.runtime import Runtime, event_context, unacked
from agents.shed import template_at_intake
from pipeline.app import table_store_options
from pipeline.auth import ApiKey, authorize, check_signed_date, header_list
from pipeline.cache import AnswerCache
from pipeline.compat import scan_partition
from pipeline.exceptions import (
    DeadlineExceededError,
    InvalidRequestError,
    RateLimitedError,
    RequestSignatureError,
)
from pipeline.keys import cache_key, scope_of
from pipeline.ratelimit import RateLimitConfig, RateLimiter, SweepSchedule, TierLimits, charge_time_ms
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
from pipeline.scheduler import CLOCK_SLACK_MS, absolute_deadline_ms, client_dated, request_created_ms
from pipeline.settings import Settings
from pipeline.terms import Priority
from pipeline.triage import TriageQueue
from pipeline.write_behind import WriteBehind

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


@dataclass(frozen=True, slots=True)
class Taken:
    """A record the reader took on: its ticket, and its request as decoded (or why it is not one)."""

    event: EventT
    ticket: Ticket
    decoded: InferenceRequest | InvalidRequestError


class Intake:
    """State of the intake agent in one worker: a reader that takes records on in offset order, a
    triage queue, and a handler that serves the queue highest class first."""

    def __init__(
        self, rt: Runtime, ratelimit_table: TableT[str, Any], cache: AnswerCache | None, model_version: str
    ) -> None:
        self.rt = rt
        #: the buckets' newest states, written to the table once per flush interval of their
        #: partition (docs/architecture.md, "Rate-limit buckets: written behind")
        self.buckets = WriteBehind(ratelimit_table, rt.settings.rate_limit_flush_ms)
        self.limiter = RateLimiter(
            rate_limit_config(rt.settings), self.buckets, tenant_shards=rt.settings.partitions
        )
        #: the last record handled of each partition: the table writes of a flush go to its partition
        self.last_event: dict[int, EventT] = {}
        self.cache = cache
        self.model_version = model_version
        self.table = ratelimit_table
        self.sweeps = SweepSchedule()
        self.swept = 0
        #: who may sign a request record; None where records are taken as written (``open``)
        self.signers = rt.signers
        s = rt.settings
        #: how far a signed request's created_at may lie from its record's append time, ms (0: any)
        self.signed_max_age_ms = int(s.signed_request_max_age_s * 1000)
        #: records taken on and not yet handled, one lane per class and one for undecodable records
        self.triage: TriageQueue[Taken] = TriageQueue(
            len(Priority) + 1, s.intake_triage_max_records, s.intake_triage_max_mb << 20
        )
        self._queued = asyncio.Event()  # wakes the handler
        self._room = asyncio.Event()  # wakes the reader
        #: why the handler stopped, if it did (the reader raises it)
        self.handler_failed: BaseException | None = None
        rt.intake = self
        rt.intake_backlog.queued = self.triage.__len__

    async def take(self, event: EventT) -> None:
        """The reader, for each record in offset order: take it on (track it) and queue it for the
        handler by the class it claims, waiting while the triage queue is full (the backlog then
        stays in Faust's buffer and in Kafka). A record that cannot be decoded is queued too, last:
        the handler refuses it."""
        rt, s, msg = self.rt, self.rt.settings, event.message
        generation = rt.acker.generation
        await rt.lifecycle.writes_ready.wait()
        size = len(msg.value) if isinstance(msg.value, bytes) else 0
        while not self.triage.has_room(size):
            self._room.clear()
            await self._room.wait()
            if self.handler_failed is not None:  # left untouched: the agent restarts (see start_handler)
                return
        await rt.lifecycle.hold_if_stopping()
        ticket = await rt.acker.track(event, generation)
        if ticket is None:
            return
        rt.intake_backlog.record(msg.tp, msg.offset, now_ms())
        decoded: InferenceRequest | InvalidRequestError
        try:
            decoded = decode_request(
                msg.value, msg.key, max_record_bytes=s.max_record_bytes, max_content_bytes=s.max_content_bytes
            )
            rank = decoded.priority.rank
        except InvalidRequestError as exc:
            decoded, rank = exc, len(Priority)
        self.triage.put(rank, Taken(event, ticket, decoded), size)
        self._queued.set()

    def start_handler(self) -> asyncio.Task[None]:
        """Start :meth:`run_handler` beside the reader (each time the agent starts). Should it ever
        stop on an error, the reader leaves its record untouched and raises: the agent crashes, and
        Faust's supervisor starts it again with a new handler, which serves what was queued, rather
        than the intake stalling with records taken on that nobody handles."""
        self.handler_failed = None

        def ended(task: asyncio.Task[None]) -> None:
            if not task.cancelled() and task.exception() is not None:
                self.handler_failed = task.exception()
                log.critical("the intake's handler stopped", exc_info=self.handler_failed)
                self._room.set()

        task = asyncio.get_running_loop().create_task(self.run_handler())
        task.add_done_callback(ended)
        return task

    async def run_handler(self) -> None:
        """The handler: take records out of the triage queue, highest class first, and handle each
        (docs/architecture.md, "Triage at the intake"). Runs beside the reader for the agent's life."""
        while True:
            if not self.triage:
                self._queued.clear()
                await self._queued.wait()
                continue
            taken = self.triage.pop()
            self._room.set()
            if not self.rt.acker.is_current(taken.ticket):
                continue  # revoked while it waited here (a drain that ran out): its owner reads it
            with event_context(taken.event):  # the rate-limit table writes to the record's partition
                try:
                    await self.handle(taken)
                except Exception as exc:
                    # the record is tracked; an unexpected failure still answers and dead-letters
                    log.exception("intake failed on %s", taken.event.message.tp)
                    await intake_failed(self.rt, taken.event, exc, self.signed_by(taken.event))

    def give_back(self, revoked: set[TP]) -> int:
        """Called when a rebalance begins: the queued records of ``revoked`` partitions, not yet
        handled, are given back unfinished (their next owner reads them); returns how many."""
        gone = self.triage.remove_if(lambda taken: taken.ticket.tp in revoked)
        for taken in gone:
            self.rt.acker.put_back(taken.ticket)
        if gone:
            self._room.set()
        return len(gone)

    def flush_buckets(self, partitions: set[int] | None = None, *, due_only: bool = True) -> int:
        """Write the buckets' unflushed states of ``partitions`` (None: all) to the rate-limit table,
        each under the last record handled of its partition (Faust writes a table to the current
        record's partition); with ``due_only``, only partitions whose oldest unflushed state is
        ``rate_limit_flush_ms`` old. A partition with unflushed states and no record to write them
        under was revoked while a record of it was being handled: those are dropped (its next owner
        restores the buckets from the changelog). Returns how many states were written."""
        written = 0
        for partition in self.buckets.partitions():
            if partitions is not None and partition not in partitions:
                continue
            event = self.last_event.get(partition)
            if event is None:
                self.buckets.drop({partition})
                continue
            if due_only and not self.buckets.due(partition):
                continue
            try:
                with event_context(event):
                    written += self.buckets.flush(partition)
            except Exception:  # housekeeping: kept for the next flush, never fails a request
                log.warning("writing the rate-limit buckets of partition %d failed", partition, exc_info=True)
        return written

    def buckets_revoked(self, revoked: set[TP]) -> int:
        """Called when a rebalance's drain is over: the unflushed bucket states of revoked request
        partitions are written while their stores are still this worker's, and their records
        forgotten; returns how many states were written."""
        partitions = {tp.partition for tp in revoked if tp.topic == self.rt.topics.requests}
        written = self.flush_buckets(partitions, due_only=False) if self.rt.settings.rate_limit_enabled else 0
        for partition in partitions:
            self.last_event.pop(partition, None)
        self.buckets.drop(partitions)
        return written

    async def handle(self, taken: Taken) -> None:
        """Process one record taken on; its ack follows once its outputs are on the broker."""
        rt, event, ticket = self.rt, taken.event, taken.ticket
        msg = event.message
        futures: list[Awaitable[Any]] = []
        signer: ApiKey | None = None
        try:
            # the signature first: nothing of an unsigned record is served or forwarded
            signer = None if self.signers is None else self.signers.verify(msg.headers, msg.value)
            if isinstance(taken.decoded, InvalidRequestError):
                raise taken.decoded
            req = taken.decoded
            if signer is not None:
                # dated by its signature: a captured copy written again later is refused
                # (docs/architecture.md, "Tenant isolation")
                check_signed_date(req.created_at, int(msg.timestamp * 1000), self.signed_max_age_ms)
                req = authorize(req, signer)
            if req.model is not None and req.model not in rt.settings.accepted_models():
                raise InvalidRequestError(
                    f"unknown model {req.model[:80]!r}; this deployment serves "
                    f"{', '.join(sorted(rt.settings.accepted_models()))}"
                )
            reply_to = await rt.reply_topic(req.reply_to)
        except RequestSignatureError as exc:
            # nobody vouches for this record's reply_to: its refusal goes to the default replies
            # topic, never into a topic the (possibly keyless) producer named
            refusal = await reject(rt, event, exc.code, exc.message, exc.message, own_topic=False)
            rt.acker.ack_after([ticket], refusal)
            return
        except InvalidRequestError as exc:
            refusal = await reject(rt, event, exc.code, exc.message, exc.message, key_id=key_id_of(signer))
            rt.acker.ack_after([ticket], refusal)
            return
        if msg.key is None or msg.partition != await rt.home_partition(msg.topic, msg.key):
            # a record without a key lands on any partition, and a keyed one on whichever its
            # producer chose, but its user's rate-limit bucket lives on the partition the user id
            # hashes to (and a user's requests keep their order there): it is sent on, keyed by its
            # user_id, and handled when it comes back on that partition. Served where they landed,
            # one user's records sprayed over N partitions met N buckets (docs/architecture.md,
            # "Security")
            # sent with its headers: its signature, over the same value, verifies again there
            assert msg.value is not None  # decode_request refused an empty record
            forwarded = await rt.send(
                rt.topics.requests, req.user_id, msg.value, headers=header_list(msg.headers)
            )
            rt.acker.ack_after([ticket], [forwarded])
            return
        key_id = key_id_of(signer)
        recorded = rt.recorded(req, reply_to)
        if recorded is not None:
            futures.append(await rt.resend(recorded, reply_to, req, key_id))
            rt.acker.ack_after([ticket], futures)
            return
        futures.append(await self._decide(req, reply_to, event, key_id))
        rt.acker.ack_after([ticket], futures)
        if rt.settings.rate_limit_enabled:
            if self.sweeps.due(msg.partition):
                self.buckets.partition = msg.partition  # the sweep reads this partition's states
                try:
                    self.sweep(msg.partition, now_ms())
                except Exception:  # housekeeping: the request is already answered, never fail it now
                    log.warning(
                        "sweeping rate-limit buckets of partition %d failed", msg.partition, exc_info=True
                    )
            if self.buckets.due(msg.partition):
                self.flush_buckets({msg.partition})

    def sweep(self, partition: int, now: float) -> int:
        """Delete the idle (full again) buckets among the next keys of ``partition``'s rate-limit
        store; called during a record of that partition (its changelog tombstones go there)."""
        chunk = scan_partition(self.table, partition, self.sweeps.cursor(partition), self.sweeps.keys)
        self.sweeps.moved(partition, chunk[-1][0] if chunk else None, len(chunk))
        gone = 0
        for raw_key, raw_value in chunk:
            try:
                key, value = json.loads(raw_key), json.loads(raw_value) if raw_value else None
            except ValueError:
                continue
            if isinstance(key, str) and (value is None or isinstance(value, dict)):
                if self.buckets.unflushed(key):
                    continue  # changed since it was stored: not idle
                if self.limiter.forgettable(key, value, now):
                    self.buckets.pop(key, None)
                    gone += 1
        self.swept += gone
        return gone

    def signed_by(self, event: EventT) -> str | None:
        """The id of the key that signed ``event``'s record, or None (unsigned, not verified, or
        requests are not signed): for the reply to a record whose handling failed."""
        if self.signers is None:
            return None
        try:
            return self.signers.verify(event.message.headers, event.message.value).key_id
        except Exception:
            return None

    async def _decide(
        self, req: InferenceRequest, reply_to: str, event: EventT, key_id: str | None
    ) -> Awaitable[Any]:
        """Refuse, answer from the cache, or forward one valid request (``key_id``: the key that
        signed it, which signs its reply and travels with its work item)."""
        rt, s = self.rt, self.rt.settings
        record_ms = int(event.message.timestamp * 1000)
        now = now_ms()
        created = request_created_ms(req.created_at, record_ms, now)
        class_ms = s.deadline_ms(req.priority)
        own_ms = req.deadline_ms if s.deadlines_enabled else None
        deadline = absolute_deadline_ms(created, class_ms, own_ms)

        async def refuse(code: str, message: str, retry_after_ms: int | None = None) -> Awaitable[Any]:
            return await rt.error_reply(
                request_id=req.request_id,
                user_id=req.user_id,
                reply_to=reply_to,
                code=code,
                message=message,
                retry_after_ms=retry_after_ms,
                priority=req.priority,
                created_at_ms=created,
                tenant=req.tenant,
                event=event,
                digest=req.digest,
                key_id=key_id,
            )

        if deadline is not None and now >= deadline:
            rt.metrics.deadline_missed.labels(priority=req.priority).inc()
            err = DeadlineExceededError(int(deadline - created), int(now - deadline), req.priority)
            return await refuse(err.code, err.message)
        if s.rate_limit_enabled:
            # charged at the request's own time (never later than now, never much before its record
            # reached the broker): a backlog that waited in Kafka through a stall or a restart is
            # not a burst, and a client's dates cannot refill its bucket
            charged = charge_time_ms(created, record_ms, now, CLOCK_SLACK_MS)
            try:
                # the bucket states of its partition, written later under this record (flush_buckets)
                self.buckets.partition = event.message.partition
                self.last_event[event.message.partition] = event
                self.limiter.check(req.user_id, req.tier, req.tenant, charged, shard=event.message.partition)
            except RateLimitedError as exc:
                rt.metrics.rate_limited.labels(scope=exc.scope).inc()
                return await refuse(exc.code, exc.message, exc.retry_after_ms)
        key = None
        if req.cache and self.cache is not None:
            key = cache_key(req.text(), scope_of(req, s.served_model, self.model_version))
            hit = self.cache.get_exact(key)
            rt.metrics.cache_lookups.labels(layer="exact", result="hit" if hit else "miss").inc()
            if hit is not None:
                reply = InferenceReply(
                    request_id=req.request_id,
                    user_id=req.user_id,
                    status="ok",
                    answer=hit.answer,
                    finish_reason=hit.finish_reason,
                    served_from="cache",
                    # a remembered merge names the request whose model call answered it, as the merge did
                    merged_into=hit.request_id if hit.remembered else None,
                    similarity=hit.similarity,
                    model_version=hit.model_version,
                    priority=req.priority,
                    timings=Timings(total_ms=max(0, now - created)),
                )
                return await rt.publish(
                    reply,
                    tenant=req.tenant,
                    reply_to=reply_to,
                    created_at_ms=created,
                    event=event,
                    digest=req.digest,
                    key_id=key_id,
                )
        # the client shortened the deadline, or dated the request before its record reached the
        # broker: its deadline misses stay out of the degradation controller's miss rate
        dated = (req.deadline_ms is not None and (class_ms is None or req.deadline_ms < class_ms)) or (
            client_dated(created, record_ms, class_ms)
        )
        item = WorkItem(
            request=req,
            priority=req.priority,
            tier=req.tier,
            reply_to=reply_to,
            created_at_ms=created,
            arrival_ms=now,
            deadline_at_ms=None if deadline is None else int(deadline),
            cache_key=key,
            client_deadline=dated,
            key_id=key_id,
        )
        if rt.inference is not None:  # level 3 at the door (agents/shed.py)
            shed = template_at_intake(rt.inference, item)
            if shed is not None:
                return await rt.publish(
                    shed,
                    tenant=req.tenant,
                    reply_to=reply_to,
                    created_at_ms=created,
                    event=event,
                    digest=req.digest,
                    key_id=key_id,
                )
        return await rt.send(rt.topics.work(req.priority), req.user_id, encode(item))


def key_id_of(signer: ApiKey | None) -> str | None:
    """The id of the key that signed a record (None: not signed)."""
    return None if signer is None else signer.key_id


def register(rt: Runtime, cache: AnswerCache | None, model_version: str) -> Intake:
    """Declare the rate-limit table and the intake agent on ``rt.app``."""
    table = rt.app.Table(
        "ratelimit",
        default=None,
        partitions=rt.settings.partitions,
        schema=faust.Schema(key_serializer="json", value_serializer="json"),
        options=table_store_options(rt.settings),
    )
    intake = Intake(rt, table, cache, model_version)

    if rt.settings.rate_limit_enabled:

        @rt.app.timer(interval=max(rt.settings.rate_limit_flush_ms, 100) / 1000)
        async def flush_buckets() -> None:
            """The bucket states of partitions whose records stopped coming: written once due."""
            intake.flush_buckets()

    @rt.app.agent(rt.topic(rt.topics.requests), name="surge.intake")
    async def intake_agent(stream: faust.StreamT) -> None:
        s = unacked(stream)
        handler = intake.start_handler()
        try:
            async for event in s.events():
                try:
                    await intake.take(event)
                except Exception as exc:
                    log.exception("intake could not take on %s", event.message.tp)
                    await intake_failed(rt, event, exc, intake.signed_by(event))
                if intake.handler_failed is not None:
                    raise RuntimeError("the intake's handler stopped") from intake.handler_failed
        finally:
            handler.cancel()

    return intake


async def intake_failed(rt: Runtime, event: EventT, exc: Exception, key_id: str | None = None) -> None:
    """An internal error: an error reply where the ids can be read (signed with ``key_id``, the
    key that signed the record), a dead letter, then the ack."""
    futures = await reject(
        rt,
        event,
        "internal",
        f"internal error: {type(exc).__name__}",
        f"internal error: {exc!r}",
        # a record whose signature did not verify gets its reply on the default topic, as a refused one
        own_topic=rt.signers is None or key_id is not None,
        key_id=key_id,
    )
    ticket = rt.acker.ticket_of(event) or await rt.acker.track(event)
    if ticket is not None:
        rt.acker.ack_after([ticket], futures)


async def reject(
    rt: Runtime,
    event: EventT,
    code: str,
    message: str,
    detail: str,
    *,
    own_topic: bool = True,
    key_id: str | None = None,
) -> list[Awaitable[Any]]:
    """A record that never became a request: an error reply ``code``/``message`` where its ids can be
    read (not recorded: it is the same on every read; signed with ``key_id`` where the record's
    signature verified), and a dead letter with reason ``code`` and ``detail``. Returns the broker's
    acknowledgements to ack after."""
    futures: list[Awaitable[Any]] = []
    raw = event.message.value
    ids = salvage_ids(raw if isinstance(raw, bytes) else None)
    if ids is not None:
        rid, uid, reply_to = ids
        futures.append(
            await rt.error_reply(
                request_id=rid,
                user_id=uid,
                reply_to=await rt.safe_reply_topic(reply_to if own_topic else None),
                code=code,
                message=message,
                record=False,
                key_id=key_id,
            )
        )
    futures.append(await rt.deadletter(event, code, detail))
    return futures
