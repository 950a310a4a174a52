"""The risk agents: four stages (account, card, device, ip) over RocksDB tables, the rules reader,
and the worker that runs them (``surge worker --role risk``). docs/architecture.md, "Risk".

Thin wiring of :mod:`pipeline.risk`: each stage reads its topic (``surge.risk.events`` for the
account, a repartition topic for the others), runs :class:`pipeline.risk.stages.Stage` on what it
read, sends the items on, the decisions and the late events, waits until the broker has
acknowledged all of it, then writes the changed entity states to its table's store and changelog,
and only then finishes the records it read in the worker's Acker, which commits in offset order
(agents/acks.py; docs/architecture.md, "Risk: takeover"). A crash at any point leaves either nothing or the outputs
without the state: the records are read again, recomputed from the same state, and the outputs are
repeated identically; an entity that already holds the event's id skips it (its outputs are known to
be on the broker).

Records are taken in batches of whatever has arrived while the previous batch was in flight (at most
``risk_batch_max_records``): one broker round trip per batch, not per event.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, NamedTuple, cast

import faust
from aiokafka.errors import KafkaError
from faust.types import TP, EventT, StoreT, TableT

from agents.acks import SendGroup, Ticket, report_stuck, stuck_after_s
from agents.batch_send import BatchSender, SentBatch
from agents.lifecycle import Lifecycle, commit_in_order, on_partitions, serve_pages
from agents.risk_escalation import Escalations, case_record, escalate_topic
from agents.runtime import Runtime, event_context, unacked
from pipeline.admin import ensure_topics
from pipeline.app import create_app, table_store_options
from pipeline.client import partitions_of
from pipeline.compat import delete_in_partition, kafka_producer, producer_partitions_for, scan_partition
from pipeline.in_order import InOrderGate, Verdict
from pipeline.kafka_security import client_options
from pipeline.metrics import create_metrics
from pipeline.records import now_ms
from pipeline.risk import jsonio
from pipeline.risk.decide import Thresholds, decide
from pipeline.risk.expiry import SweepPlan, sweep
from pipeline.risk.features import FeatureConfig, cents
from pipeline.risk.records import (
    ENTITY_KINDS,
    InvalidRiskEventError,
    check_event_time,
    decode_event,
    salvage_event_ids,
)
from pipeline.risk.rules import DEFAULT_RULES, RuleBook, RuleSet
from pipeline.risk.stages import (
    REKEYED_KINDS,
    Position,
    RepartitionRecordError,
    Stage,
    StageResult,
    StateCache,
    decision_record,
    full_features,
    new_item,
    pack,
    partition_for,
    unpack,
)
from pipeline.risk_client import publish_rules
from pipeline.settings import Settings

log = logging.getLogger("surge.risk")

#: how the state tables serialise their keys (the store's and the changelog's keys alike)
STATE_KEY_SERIALIZER = "json"

#: how long a stage waits for a pinned rule-set version it has not read yet
RULES_WAIT_S = 1.0


def table_name(kind: str) -> str:
    """The Faust table of one kind of entity; the risk role's Faust app id is ``<app_id>-risk``
    (``Settings.group_id``), so its changelog is :func:`changelog_topic`."""
    return kind


def changelog_topic(settings: Settings, kind: str) -> str:
    """The changelog of one kind's state table: ``<app_id>-risk-<kind>-changelog``."""
    return f"{settings.app_id}-risk-{table_name(kind)}-changelog"


def repartition_topic(settings: Settings, kind: str) -> str:
    """The internal topic that re-keys events by ``kind`` (named like Kafka Streams' repartition topics)."""
    return f"{settings.app_id}-risk-by-{kind}-repartition"


def source_topics(settings: Settings) -> list[str]:
    """The topics a risk worker reads through its Acker: the events, one repartition topic per
    re-keyed kind, and, with an escalation key, the decisions waiting for the model path (a worker
    without one does not subscribe to it: each topic a worker reads costs it on every poll)."""
    from pipeline.topics import TopicNames

    return [
        TopicNames(settings.topic_prefix).risk_events,
        *(repartition_topic(settings, k) for k in REKEYED_KINDS),
        *([escalate_topic(settings)] if reads_escalations(settings) else []),
    ]


def reads_escalations(settings: Settings) -> bool:
    """Whether a risk worker runs the escalation agent: whenever it has a key, so cases written while
    escalation was on are still decided after it was turned off (docs/architecture.md,
    "Risk: escalation")."""
    return settings.risk_escalation_key is not None


def internal_topics(settings: Settings) -> tuple[list[str], list[str]]:
    """``(plain, compacted)`` topics a risk worker needs besides the shared ones."""
    from pipeline.topics import TopicNames

    t = TopicNames(settings.topic_prefix)
    plain = [*source_topics(settings), t.risk_decisions, t.risk_late]
    if reads_escalations(settings):  # a deployment that never escalates gets no reply topic for it
        plain.append(settings.risk_escalation_replies)
    compacted = [t.risk_rules, *(changelog_topic(settings, k) for k in ENTITY_KINDS)]
    return plain, compacted


async def ensure_risk_topics(settings: Settings) -> list[str]:
    """Create the risk topics, repartition topics and table changelogs that do not exist yet."""
    plain, compacted = internal_topics(settings)
    return await ensure_topics(settings, extra=plain, compacted_extra=compacted)


def feature_config(s: Settings) -> FeatureConfig:
    return FeatureConfig(
        grace_ms=s.risk_grace_ms,
        horizon_ms=s.risk_horizon_ms,
        small_amount_cents=cents(s.risk_small_amount),
        dedup_ids=s.risk_dedup_ids,
        seen_max=s.risk_seen_max,
        distinct_max=s.risk_distinct_max,
        state_ttl_ms=s.risk_state_ttl_s * 1000,
    )


class Taken(NamedTuple):
    """A record a stage's reader took on: its ticket in the Acker's ledger, and the Acker's
    generation when it was read (a rebalance since makes it stale: its partition is read again)."""

    event: EventT
    ticket: Ticket
    generation: int


class _Batches:
    """Records read but not yet processed: the reader appends, the processor takes all there is."""

    def __init__(self, max_records: int) -> None:
        self.max = max_records
        self.items: list[Taken] = []
        self.ready = asyncio.Event()
        self.space = asyncio.Event()
        self.space.set()
        self.full = asyncio.Event()

    async def put(self, taken: Taken) -> None:
        while len(self.items) >= 2 * self.max:
            self.space.clear()
            await self.space.wait()
        self.items.append(taken)
        self.ready.set()
        if len(self.items) >= self.max:
            self.full.set()

    async def take(self, linger_s: float = 0.0) -> list[Taken]:
        """What has arrived (at most ``max``): waits for a first record, then up to ``linger_s`` more
        for the batch to fill (bigger batches: fewer broker records and table writes per event)."""
        await self.ready.wait()
        if linger_s > 0 and len(self.items) < self.max:
            self.full.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.full.wait(), linger_s)
        batch = self.items[: self.max]
        del self.items[: self.max]
        if not self.items:
            self.ready.clear()
        self.space.set()
        return batch

    def clear(self) -> None:
        """Drop what is waiting (a rebalance made it stale)."""
        self.items.clear()
        self.ready.clear()
        self.space.set()


class RiskAgents:
    """State of the risk path in one worker: rules, model, stages, tables."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt
        s = self.s = rt.settings
        self.metrics = rt.metrics.risk
        self.cfg = feature_config(s)
        self.book = RuleBook()
        self.rules_ready = asyncio.Event()
        self._rules_changed = asyncio.Event()
        self.model: Any = None
        review, decline = s.risk_review_score, s.risk_decline_score
        if s.risk_model_enabled:
            from models.risk import RiskModel

            self.model = RiskModel.load(s.risk_model_path)
            review = review if review is not None else self.model.meta["review_threshold"]
            decline = decline if decline is not None else self.model.meta["decline_threshold"]
        self.thresholds = Thresholds(review_score=review or 0.5, decline_score=decline or 0.9)
        self.escalations = Escalations(rt, self.metrics)
        self.tables: dict[str, TableT[str, bytes]] = {}
        #: states serialised by a batch whose outputs the broker has not acknowledged yet
        self.pending: dict[str, dict[str, bytes]] = {}
        self.caches: dict[str, StateCache] = {}
        self.stages: dict[str, Stage] = {}
        for kind in ENTITY_KINDS:
            table = rt.app.Table(
                table_name(kind),
                default=None,
                partitions=s.partitions,
                # bytes: the store and the changelog keep the state's own JSON as is (Faust takes a
                # table's value serializer from its value type, not from the schema)
                value_type=bytes,
                schema=faust.Schema(key_serializer=STATE_KEY_SERIALIZER, value_serializer="raw"),
                options=table_store_options(s),
            )
            self.tables[kind] = table
            cache = self.caches[kind] = StateCache(s.risk_feature_cache_entries)
            pending = self.pending[kind] = {}
            self.stages[kind] = Stage(kind, self.cfg, s.partitions, cache, self._loader(table, pending))
        self._counted = {k: (0, 0) for k in ENTITY_KINDS}
        #: per stage, where the sweep of expired states looks next in each partition's store
        self.sweeps = {k: SweepPlan() for k in ENTITY_KINDS}
        self._changelogs: dict[str, str] = {}
        self._sender: BatchSender | None = None
        #: per stage, the records read and not yet processed
        self._buffers: dict[str, _Batches] = {}
        #: each source partition's next offset: records are taken in offset order (_in_order)
        self.gate: InOrderGate[TP] = InOrderGate()
        #: the newest changelog offset written to each partition's store (never moved back)
        self._persisted: dict[TP, int] = {}
        self.decided = 0
        #: items skipped because their entity had taken them before a crash (input read again)
        self.reread_skipped = 0
        #: items skipped because an upstream stage sent them again (it died before writing its state)
        self.resent_skipped = 0
        #: settle tasks still waiting for the broker to acknowledge their batch's outputs
        self.sending: dict[asyncio.Future[None], SendGroup] = {}
        #: batches reported as stuck in the producer (report_stuck_sends)
        self.stuck_reported = 0

    @staticmethod
    def _loader(table: TableT[str, bytes], pending: dict[str, bytes]) -> Callable[[str, Any], bytes | None]:
        def load(key: str, ctx: Any) -> bytes | None:
            data = pending.get(key)  # written by a batch still waiting for the broker
            if data is not None:
                return data
            with event_context(ctx):
                return table.get(key)

        return load

    def clear_caches(self) -> None:
        for c in self.caches.values():
            c.clear()
        self._persisted.clear()

    def forget_in_flight(self) -> None:
        """Called on every rebalance once the drain is over and the Acker has moved to a new
        generation: whatever is still in flight is stale (its records are read again by their
        partitions' owners), so the states it serialised, the cached states it changed and the
        records waiting to be processed are dropped; batches still in flight write no state and
        ack nothing (docs/architecture.md, "Risk: takeover")."""
        self.clear_caches()
        for pending in self.pending.values():
            pending.clear()
        for buffer in self._buffers.values():
            buffer.clear()

    # ---- rules -------------------------------------------------------------------------------------
    def apply_rule_records(self, records: list[tuple[bytes | None, bytes | None]]) -> None:
        """Records of the rules topic read together: one change, one new version."""
        before = self.book.current
        rs, errors = self.book.apply_many(records)
        for exc in errors:
            log.error("%s; the rule keeps its previous version", exc.message)
        if rs is not before:
            self._rules_changed.set()
            self._rules_changed = asyncio.Event()
            log.info("risk rules now %s (%d rules)", rs.version, len(rs))

    async def read_rules(self) -> None:
        """Keep the rule book equal to ``surge.risk.rules`` (every partition, from the beginning,
        committed records only), and publish the default rules, in one transaction, if the topic
        holds none (pipeline/risk_client.py, ``publish_rules``)."""
        from aiokafka import AIOKafkaConsumer, TopicPartition

        topic = self.rt.topics.risk_rules
        opts = client_options(self.s)
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.s.bootstrap_servers,
            enable_auto_commit=False,
            fetch_max_wait_ms=100,
            isolation_level="read_committed",
            **opts,
        )
        try:
            await consumer.start()
            parts = await partitions_of(consumer, topic, tries=100)
            tps = [TopicPartition(topic, p) for p in parts]
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            end = await consumer.end_offsets(tps)
            read = 0  # committed records read, tombstones included
            while True:
                batch = await consumer.getmany(timeout_ms=200)
                records = [(rec.key, rec.value) for recs in batch.values() for rec in recs]
                if records:
                    read += len(records)
                    self.apply_rule_records(records)
                if self.rules_ready.is_set():
                    continue
                positions = {tp: await consumer.position(tp) for tp in tps}
                if not all(positions[tp] >= end[tp] for tp in tps):
                    continue
                if read == 0 and self.s.risk_publish_default_rules:
                    # empty (or holding only aborted records): publish, unless another worker
                    # has meanwhile, then read on to the new end
                    try:
                        if await publish_rules(
                            self.s.bootstrap_servers, topic, DEFAULT_RULES, options=opts, only_if_empty=True
                        ):
                            log.info(
                                "surge.risk.rules was empty: published the %d default rules",
                                len(DEFAULT_RULES),
                            )
                    except KafkaError as exc:
                        log.warning("publishing the default rules failed (%r); trying again", exc)
                        await asyncio.sleep(1.0)
                    end = await consumer.end_offsets(tps)
                    continue
                self.rules_ready.set()
                print(
                    f"surge risk ready: rules {self.book.current.version} ({len(self.book.current)}), "
                    f"model {self.model.version if self.model else 'off'}",
                    flush=True,
                )
        finally:
            await consumer.stop()

    async def ruleset(self, version: str) -> tuple[RuleSet, str | None]:
        """The rule set an item was pinned to, waiting briefly for a version not read yet; else the
        current one and a note saying so."""
        rs = self.book.get(version)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + RULES_WAIT_S
        while rs is None and loop.time() < deadline:
            try:
                await asyncio.wait_for(self._rules_changed.wait(), deadline - loop.time())
            except TimeoutError:
                break
            rs = self.book.get(version)
        if rs is not None:
            return rs, None
        cur = self.book.current
        return cur, f"rules {version} not known to this worker; applied {cur.version}"

    # ---- stages ------------------------------------------------------------------------------------
    async def run_stage(self, kind: str, stream: faust.StreamT) -> None:
        """Reader half of a stage: takes each record on in the Acker's ledger (which commits in
        offset order, agents/acks.py) and hands it to the processor, which takes them in batches."""
        acker, life = self.rt.acker, self.rt.lifecycle
        batches = self._buffers[kind] = _Batches(self.s.risk_batch_max_records)
        processor = asyncio.ensure_future(self._process_loop(kind, batches))
        try:
            async for event in unacked(stream).events():
                if processor.done():
                    break
                generation = acker.generation
                await life.hold_if_stopping()
                if not await self._in_order(event, generation):
                    continue
                ticket = await acker.track(event, generation)
                if generation == acker.generation:  # taken, or acked without work (done before)
                    self.gate.took(event.message.tp, event.message.offset)
                if ticket is None:  # stale, or a repeat delivery of an offset taken on already
                    continue
                await batches.put(Taken(event, ticket, generation))
        finally:
            processor.cancel()

    async def _in_order(self, event: EventT, generation: int) -> bool:
        """Whether the reader takes ``event`` now: it is the next offset of its partition (or the
        broker says nothing lies before it that was not taken). A record past a gap is dropped
        untouched and its partition read again from the gap: an entity skips an item at or before
        the position it last took, so taking a later record first would leave the earlier one
        without a decision (:mod:`pipeline.in_order`; docs/architecture.md, "Risk: takeover")."""
        acker, gate = self.rt.acker, self.gate
        if generation != acker.generation:
            return False  # stale: track would drop it too
        gate.begin(generation)
        msg = event.message
        tp = msg.tp
        if gate.expected(tp) is None:
            start = await acker.reading_start(tp)
            if generation != acker.generation:
                return False
            if start is not None:
                gate.start_at(tp, start)
        verdict = gate.check(tp, msg.offset)
        if verdict is Verdict.TAKE:
            return True
        if verdict is not Verdict.GAP:  # a repeat, or past a gap being read again
            return False
        expected = cast(int, gate.expected(tp))
        if gate.known_empty(tp, expected, msg.offset):  # the broker said so before
            gate.gap_empty(tp, msg.offset)
            return True
        held = await acker.held_from(tp, expected)
        if generation != acker.generation:
            return False
        if held is not None:
            gate.learn(tp, expected, held)
        if held and held[0] >= msg.offset:  # only markers between: nothing to read
            gate.gap_empty(tp, msg.offset)
            return True
        log.warning(
            "%s: offset %d delivered before %d (not taken yet); reading the partition again from %d",
            tp,
            msg.offset,
            expected,
            expected,
        )
        gate.seeking(tp)
        acker.reseek_soon({tp: expected})
        return False

    async def _process_loop(self, kind: str, batches: _Batches) -> None:
        """Processor half: a batch is processed and its outputs sent at once; waiting for the broker,
        writing the states and acking happen in a settle task per batch, chained in batch order, so the
        next batch waits for a broker round trip only when ``risk_batches_in_flight`` batches are in flight;
        what arrives meanwhile makes the next batch bigger, and a bigger batch costs less per event."""
        await self.rules_ready.wait()
        acker = self.rt.acker
        settling: list[asyncio.Future[None]] = []
        while True:
            taken = await batches.take(self.s.risk_batch_wait_ms / 1000)
            generation = acker.generation
            fresh = [t for t in taken if t.generation == generation]  # read before a rebalance: dropped
            if not fresh:
                continue
            tickets = [t.ticket for t in fresh]
            try:
                futures, writes = await self.process(kind, [t.event for t in fresh], generation)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                await self._fail(kind, exc)
                return
            prev = settling[-1] if settling else None
            task = asyncio.ensure_future(self._settle(kind, tickets, generation, futures, writes, prev))
            self.sending[task] = SendGroup(time.monotonic(), futures)
            task.add_done_callback(self._settled)
            settling.append(task)
            settling = [f for f in settling if not f.done()]
            if len(settling) >= self.s.risk_batches_in_flight:
                await settling[0]

    def _settled(self, task: asyncio.Future[None]) -> None:
        self.sending.pop(task, None)

    def report_stuck_sends(self, now: float) -> int:
        """Called on a timer: report batches whose outputs have waited past the producer's request
        timeout, and wake the producer (agents/acks.report_stuck)."""
        after_s = stuck_after_s(self.s.producer_request_timeout_ms)
        reported = report_stuck(self.rt.app, self.sending.values(), now, after_s)
        self.stuck_reported += reported
        return reported

    async def _fail(self, kind: str, exc: BaseException) -> None:
        # an output that cannot be written: stop the worker rather than ack what was not done
        log.critical("risk %s stage failed (%r); stopping the worker so nothing is lost", kind, exc)
        await self.rt.app.crash(exc)

    async def _settle(
        self,
        kind: str,
        tickets: list[Ticket],
        generation: int,
        futures: list[Awaitable[Any]],
        writes: list[tuple[str, bytes, Any]],
        prev: asyncio.Future[None] | None,
    ) -> None:
        """Once the batch's outputs are on the broker (and the previous batch has settled): write its
        states to the table's store and send their changelog records, in batch order; its records are
        finished once the broker has those too (:meth:`_ack_when_logged`). A batch that a rebalance
        overtook writes nothing and finishes nothing: its partitions may be another worker's now, and
        their owner reads its records again and repeats its outputs identically."""
        if prev is not None:
            await asyncio.shield(prev)
        try:
            for fut in futures:
                await fut
            if self.rt.acker.generation != generation:
                return
            logged = await self._write_states(kind, writes)
        except Exception as exc:
            await self._fail(kind, exc)
            raise
        task = asyncio.ensure_future(self._ack_when_logged(kind, tickets, generation, logged))
        self.sending[task] = SendGroup(time.monotonic(), [b.ack for b in logged])
        task.add_done_callback(self._settled)

    async def _write_states(self, kind: str, writes: list[tuple[str, bytes, Any]]) -> list[SentBatch]:
        """Write the changed states to the local store and send their changelog records, batched per
        partition (:mod:`agents.batch_send`); the batches sent.

        The same two steps as the table's own ``table[key] = value`` (the store, then the record on
        the key's partition of the changelog, its key serialised as the table serialises it), without
        Faust's per-write message objects, buffer and callbacks, and the producer's per-record send:
        together about a fifth of a risk worker's CPU (docs/architecture.md, "Risk: the chain")."""
        table, pending = self.tables[kind], self.pending[kind]
        store = table.data
        dumps_key = self.rt.app.serializers.dumps_key
        by_partition: dict[int, list[tuple[str, bytes, Any]]] = {}
        for w in writes:
            by_partition.setdefault(w[2].message.partition, []).append(w)
        records: dict[int, list[tuple[bytes | None, bytes]]] = {}
        for partition, group in by_partition.items():
            with event_context(group[0][2]):
                for key, data, _ in group:
                    store[key] = data
            records[partition] = [
                (dumps_key(None, key, serializer=STATE_KEY_SERIALIZER), data) for key, data, _ in group
            ]
            for key, data, _ in group:
                if pending.get(key) is data:
                    del pending[key]
        return await self._batch_sender().send(self._changelog_topic(kind), records)

    def _batch_sender(self) -> BatchSender:
        """The sender of whole batches over Faust's producer (made once that has started)."""
        producer = kafka_producer(self.rt.app.producer)
        if self._sender is None or self._sender.producer is not producer:
            self._sender = BatchSender(producer)
        return self._sender

    def _changelog_topic(self, kind: str) -> str:
        name = self._changelogs.get(kind)
        if name is None:
            name = self._changelogs[kind] = self.tables[kind].changelog_topic.get_topic_name()
        return name

    async def _ack_when_logged(
        self, kind: str, tickets: list[Ticket], generation: int, logged: list[SentBatch]
    ) -> None:
        """Finish the batch's records once its changelog records are on the broker (the Acker
        commits them in offset order, whatever order batches finish in), and remember the newest
        changelog offset of each partition in the store (where a restart's recovery starts reading
        the changelog: what Faust's table does after each of its own changelog sends). After a
        rebalance, neither: a partition moved away may have changelog records of its new owner's
        past this offset."""
        newest: dict[int, int] = {}
        try:
            for batch in logged:
                newest[batch.partition] = batch.last_offset(await batch.ack)
        except Exception as exc:
            await self._fail(kind, exc)
            raise
        if self.rt.acker.generation != generation:
            return
        store = cast(StoreT, self.tables[kind].data)
        changelog = self._changelog_topic(kind)
        for partition, offset in newest.items():
            tp = TP(changelog, partition)
            if offset > self._persisted.get(tp, -1):
                self._persisted[tp] = offset
                store.set_persisted_offset(tp, offset)
        await self.rt.acker.finish(tickets)

    async def process(
        self, kind: str, events: Sequence[EventT], generation: int
    ) -> tuple[list[Awaitable[Any]], list[tuple[str, bytes, Any]]]:
        """One batch of one stage: decode, run the stage, send what it made. Returns the broker's
        acknowledgements to wait for and the states to write after them (serialised now: the next
        batch changes them in memory); no states once a rebalance overtook the batch (``generation``
        is the Acker's when it was taken), whose changes of cached states were dropped with it."""
        futures: list[Awaitable[Any]] = []
        batch: list[tuple[dict[str, Any], Any]] = []
        positions: list[Position] = []
        now = now_ms()
        if kind == "account":
            rv = self.book.current.version
            for ev in events:
                msg = ev.message
                try:
                    risk_event = check_event_time(
                        decode_event(msg.value, msg.key, max_record_bytes=self.s.max_record_bytes),
                        now,
                        self.s.risk_max_ahead_ms,
                    )
                except InvalidRiskEventError as exc:
                    futures += await self._invalid(ev, exc.message)
                    continue
                batch.append((new_item(risk_event.model_dump(), rv, int(msg.timestamp * 1000), now), ev))
                positions.append((msg.partition, msg.offset, 0))
        else:
            for ev in events:
                msg = ev.message
                try:
                    items = unpack(msg.value, (msg.topic, msg.partition, msg.offset), kind)
                except RepartitionRecordError as exc:
                    futures.append(await self.rt.deadletter(ev, "internal", exc.message))
                    continue
                batch += [(item, ev) for item in items]
                positions += [(msg.partition, msg.offset, i) for i in range(len(items))]
        if self.rt.acker.generation != generation:
            return futures, []
        res = self.stages[kind].run(batch, positions, self._end_of(events[0].message.topic), now)
        if res.expired:
            self.metrics.states_expired.labels(kind=kind, how="read").inc(res.expired)
        self.reread_skipped += res.reread
        self.resent_skipped += res.resent
        futures += await self._emit(res)
        if self.rt.acker.generation != generation:
            return futures, []
        pending = self.pending[kind]
        writes = []
        for key, (state, ctx) in res.dirty.items():
            data = pending[key] = state.dumps()
            writes.append((key, data, ctx))
        self._count_cache(kind)
        futures += await self._sweep(kind, positions, res.new, now)
        return futures, writes

    async def _sweep(
        self, kind: str, positions: Sequence[Position], new: dict[int, int], now: int
    ) -> list[Awaitable[Any]]:
        """Delete expired states from the stores of the batch's partitions, as many as they owe
        (:class:`pipeline.risk.expiry.SweepPlan`), with their changelog tombstones; the tombstones'
        acks. Called once the batch's changed states are in ``pending``, and synchronous up to the
        send: a state a batch in flight changed (this one included) is left for that batch to write."""
        ttl_ms = self.s.risk_state_ttl_s * 1000
        if ttl_ms <= 0 or not positions:
            return []
        plan, table = self.sweeps[kind], self.tables[kind]
        pending, cache = self.pending[kind], self.caches[kind]
        tombstones: dict[int, list[tuple[bytes | None, bytes | None]]] = {}

        def busy(raw: bytes) -> bool:
            return jsonio.loads(raw) in pending

        for partition, items in Counter(p[0] for p in positions).items():
            scan = functools.partial(scan_partition, table, partition)
            gone = sweep(plan, partition, items, new.get(partition, 0), scan, now, ttl_ms, busy)
            if gone:
                delete_in_partition(table, partition, gone)
                for raw in gone:
                    cache.discard(jsonio.loads(raw))
                tombstones[partition] = [(raw, None) for raw in gone]
        if not tombstones:
            return []
        self.metrics.states_expired.labels(kind=kind, how="swept").inc(sum(map(len, tombstones.values())))
        return [b.ack for b in await self._batch_sender().send(self._changelog_topic(kind), tombstones)]

    def _end_of(self, topic: str) -> Callable[[int], int | None]:
        """The end offset (high watermark) of a partition of ``topic`` as the consumer last saw it: a
        state's position past it is from an earlier incarnation of the topic."""
        consumer = self.rt.app.consumer

        def end_of(partition: int) -> int | None:
            return cast(int | None, consumer.highwater(TP(topic, partition)))

        return end_of

    def _count_cache(self, kind: str) -> None:
        c = self.caches[kind]
        hits, misses = self._counted[kind]
        if c.hits > hits:
            self.metrics.feature_cache.labels(kind=kind, result="hit").inc(c.hits - hits)
        if c.misses > misses:
            self.metrics.feature_cache.labels(kind=kind, result="miss").inc(c.misses - misses)
        self._counted[kind] = (c.hits, c.misses)

    async def _send(
        self, topic: str, key: str | None, value: bytes, partition: int | None = None
    ) -> Awaitable[Any]:
        """Straight to Faust's producer (the transport, not a Topic: no per-record message objects);
        the awaitable resolves when the broker has acknowledged the record."""
        return await self.rt.app.producer.send(
            topic, key.encode() if key is not None else None, value, partition, None, None
        )

    async def _emit(self, res: StageResult) -> list[Awaitable[Any]]:
        futures: list[Awaitable[Any]] = []
        sender = self._batch_sender()
        forward: dict[str, dict[int, list[tuple[bytes | None, bytes]]]] = {}
        for (nxt, partition), items in res.forward.items():
            forward.setdefault(nxt, {})[partition] = [(None, pack(items))]
        for nxt, records in forward.items():
            # a closed batch goes out without the producer's linger: a hop of the chain waits less
            futures += [b.ack for b in await sender.send(repartition_topic(self.s, nxt), records)]
        if res.decide:
            rows = [(item["e"], full_features(item["f"])) for item, _ in res.decide]
            scores = self.model.score_many(rows) if self.model is not None else [None] * len(rows)
            decided = now_ms()
            topic = self.rt.topics.risk_decisions
            partitions = len(await producer_partitions_for(self.rt.app.producer, topic))
            by_partition: dict[int, list[tuple[bytes | None, bytes]]] = {}
            #: borderline decisions, with their events, by account, for the model path
            #: (agents/risk_escalation.py)
            escalate: dict[str, list[tuple[bytes | None, bytes]]] = {}
            esc = self.escalations
            outcomes: Counter[str] = Counter()
            hits: Counter[str] = Counter()
            for (item, _), (ev, feats), score in zip(res.decide, rows, scores, strict=True):
                rules, note = await self.ruleset(item["rv"])
                verdict = decide(ev, feats, rules, score, self.thresholds, self.model)
                reasons = verdict.reasons + ([note] if note else [])
                rec = decision_record(
                    item,
                    decision=verdict.decision,
                    score=verdict.score,
                    reasons=reasons,
                    rule_version=rules.version,
                    model_version=self.model.version if self.model else None,
                    decided_ms=decided,
                    features=feats,
                )
                account = ev["account"]
                hits.update(hit.rule_id for hit in verdict.hits)
                if esc.wanted(verdict.decision, verdict.score):
                    # counted once decided (decisions, latency), by the escalation agent
                    escalate.setdefault(account, []).append((account.encode(), case_record(rec, ev)))
                    continue
                by_partition.setdefault(partition_for(account, partitions), []).append(
                    (account.encode(), _dumps(rec))
                )
                outcomes[verdict.decision] += 1
                self.metrics.decision_latency.observe(max(0, decided - item["ts"]) / 1000)
            # keyed by account, on the partition the producer's own partitioner would choose
            futures += [b.ack for b in await sender.send(topic, by_partition)]
            if escalate:
                futures += await self._escalate(escalate)
            for outcome, n in outcomes.items():
                self.metrics.decisions.labels(decision=outcome).inc(n)
            for rule_id, n in hits.items():
                self.metrics.rule_hits.labels(rule=rule_id).inc(n)
            self.decided += len(rows)
        for item, watermark, ctx in res.late:
            futures += await self._late(item, watermark, ctx)
        return futures

    async def _escalate(self, cases: dict[str, list[tuple[bytes | None, bytes]]]) -> list[Awaitable[Any]]:
        """Send borderline decisions, by account, to the escalate topic, each on the partition the
        producer's own partitioner gives its account (so one account's cases stay in order)."""
        topic = escalate_topic(self.s)
        partitions = len(await producer_partitions_for(self.rt.app.producer, topic))
        by_partition: dict[int, list[tuple[bytes | None, bytes]]] = {}
        for account, records in cases.items():
            by_partition.setdefault(partition_for(account, partitions), []).extend(records)
        return [b.ack for b in await self._batch_sender().send(topic, by_partition)]

    async def _late(self, item: dict[str, Any], watermark: int, ctx: EventT) -> list[Awaitable[Any]]:
        ev, msg = item["e"], ctx.message
        late_by = watermark - ev["event_time_ms"]
        self.metrics.late_events.inc()
        record = {
            "event": ev,
            "watermark_ms": watermark,
            "late_by_ms": late_by,
            "grace_ms": self.s.risk_grace_ms,
            "source_partition": msg.partition,
            "source_offset": msg.offset,
        }
        now = now_ms()
        rec = decision_record(
            item,
            decision="review",
            score=None,
            rule_version=item["rv"],
            model_version=None,
            decided_ms=now,
            reasons=[
                f"late_event: {late_by} ms behind the account's latest event, grace {self.s.risk_grace_ms} ms; "
                "scored on no features"
            ],
            late=True,
        )
        self.metrics.decisions.labels(decision="review").inc()
        self.metrics.decision_latency.observe(max(0, now - item["ts"]) / 1000)
        return [
            await self._send(self.rt.topics.risk_late, ev["account"], _dumps(record)),
            await self._send(self.rt.topics.risk_decisions, ev["account"], _dumps(rec)),
        ]

    async def _invalid(self, event: EventT, message: str) -> list[Awaitable[Any]]:
        """An error decision (when the event id and account can be read) and a dead letter."""
        futures = []
        ids = salvage_event_ids(event.message.value)
        if ids is not None:
            eid, account = ids
            rec = {
                "event_id": eid,
                "account": account,
                "decision": "error",
                "reasons": [message],
                "error": {"code": "invalid_request", "message": message},
            }
            futures.append(await self._send(self.rt.topics.risk_decisions, account, _dumps(rec)))
            self.metrics.decisions.labels(decision="error").inc()
        futures.append(await self.rt.deadletter(event, "invalid_request", message))
        return futures

    def status(self) -> dict[str, Any]:
        hits = sum(c.hits for c in self.caches.values())
        reads = hits + sum(c.misses for c in self.caches.values())
        return {
            "rules_version": self.book.current.version,
            "rules": len(self.book.current),
            "model_version": self.model.version if self.model else None,
            "decided": self.decided,
            "reread_skipped": self.reread_skipped,
            "resent_skipped": self.resent_skipped,
            "sends_reported_stuck": self.stuck_reported,
            # records read and not finished, per partition (agents/acks.py): where a stuck one waits
            "unacked_by_partition": self.rt.acker.describe(),
            # records delivered past one not taken yet: dropped and read again in order (_in_order)
            "out_of_order_dropped": self.gate.dropped,
            "empty_gaps_stepped_over": self.gate.empty_gaps,
            "empty_gaps_known_before": self.gate.known_gaps,
            "acked_again_without_work": self.rt.acker.done_again,
            "feature_cache_hit_share": round(hits / reads, 4) if reads else None,
            "feature_cache_entries": {k: len(c) for k, c in self.caches.items()},
            "escalation": self.escalations.status(),
        }


def _dumps(obj: dict[str, Any]) -> bytes:
    return jsonio.dumps(obj)


def register(rt: Runtime) -> RiskAgents:
    """Declare the risk tables, the four stage agents and the rules reader on ``rt.app``."""
    risk = RiskAgents(rt)
    app = rt.app

    def stage_agent(kind: str, topic_name: str) -> None:
        async def agent(stream: faust.StreamT) -> None:
            await risk.run_stage(kind, stream)

        agent.__name__ = f"risk_{kind}"
        app.agent(rt.topic(topic_name), name=f"surge.risk.{kind}")(agent)

    stage_agent("account", rt.topics.risk_events)
    for kind in REKEYED_KINDS:
        stage_agent(kind, repartition_topic(rt.settings, kind))

    esc = risk.escalations
    if reads_escalations(rt.settings):

        async def escalation_agent(stream: faust.StreamT) -> None:
            await esc.run(stream)

        app.agent(rt.topic(escalate_topic(rt.settings)), name="surge.risk.escalate")(escalation_agent)

        @app.task
        async def escalation_replies() -> None:
            await esc.read_replies()

    @app.task
    async def risk_rules() -> None:
        await risk.read_rules()

    @app.timer(interval=1.0)
    async def report_stuck_sends() -> None:
        risk.report_stuck_sends(time.monotonic())

    async def clear_caches(_: set[TP]) -> None:
        risk.clear_caches()

    on_partitions(app.on_partitions_assigned, clear_caches)

    return risk


def build_risk_app(settings: Settings) -> tuple[faust.App, Runtime]:
    """A worker with the risk role only: no answer model, no answer caches."""
    app = create_app(settings)
    rt = Runtime(settings, app, create_metrics())
    risk = register(rt)
    rt.risk = risk
    life = rt.lifecycle = Lifecycle(app, rt, source_topics=source_topics(settings))

    async def forget(_: set[TP]) -> None:
        risk.forget_in_flight()

    # the Acker commits in offset order, like the request path's (docs/architecture.md, "Risk: takeover")
    commit_in_order(life, on_revoked=forget)

    @app.task
    async def announce_ready() -> None:
        await life.watch_ready()

    def ready() -> bool:
        return life.ready.is_set() and risk.rules_ready.is_set()

    serve_pages(life, ready=ready, describe=risk.status)

    return app, rt
