"""Commits in offset order: an offset is committed only when every record of its partition from where
this worker started reading is finished (their outputs acknowledged by the broker). See
pipeline/offsets.py for why, and docs/architecture.md, "Guarantees".

One :class:`Acker` per worker. A reader awaits :meth:`Acker.track` as it takes a record; whoever
produces the record's outputs calls :meth:`Acker.ack_after` with the broker's acknowledgement
futures. The Acker commits the released offsets itself (:meth:`Acker.commit`, on a timer and at
every drain) rather than through Faust's ack bookkeeping, which commits past records it never
delivered and forgets acks at a rebalance. On a rebalance the ledgers of revoked partitions are
dropped: records still in flight from them are answered but never committed, so the next owner
reads them again (and the reply table makes that repeat identical). What this worker finished there
but could not commit (behind an unfinished record) is remembered, and every commit names it in its
metadata: whoever reads the partition next, this worker or another, acks those records as they are
read, not worked on and answered again. A rebalance's drain
may also give back admitted work (:meth:`Acker.put_back`): never committed here, read again by the
partition's owner.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from typing import Any

import faust
from faust.types import TP, EventT

from agents.offset_oracle import OffsetOracle
from agents.reply_order import task_is_cancelling
from pipeline.compat import commit_offsets, kafka_producer, producer_backlog, wake_producer
from pipeline.offsets import LedgerError, PartitionLedger, encode_done, not_held

log = logging.getLogger("surge.acks")

#: how long a question to the broker about offsets may take before the Acker goes on without it
ORACLE_TIMEOUT_S = 5.0
#: most records one hole check asks the broker about (past the hole, up to the last one read)
HOLE_SCAN_RECORDS = 5_000
#: how long past the producer's request timeout a send may wait before it is reported as stuck
#: (aiokafka answers a request, fails it or sends it again within that timeout plus its backoff)
STUCK_MARGIN_S = 10.0


def stuck_after_s(producer_request_timeout_ms: int) -> float:
    """How long a send may wait for the broker before it is reported as stuck."""
    return producer_request_timeout_ms / 1000 + STUCK_MARGIN_S


#: how long a commit may take before the Acker goes on without it (the next commit tries again; one
#: that lands late at an older offset only means records read again, never lost)
COMMIT_TIMEOUT_S = 5.0


@dataclass(slots=True)
class SendGroup:
    """The sends of one :meth:`Acker.ack_after`: when they were handed to the producer, and
    whether they were reported as stuck (:func:`report_stuck`)."""

    started: float
    futures: list[Awaitable[Any]]
    reported: bool = False
    #: index of the future being awaited (they are awaited in turn)
    awaiting: int = 0

    def pending(self) -> list[str]:
        """The sends not yet acknowledged, as their reprs say (topic and key for surge's own)."""
        return [
            repr(f) for f in self.futures[self.awaiting :] if not (isinstance(f, asyncio.Future) and f.done())
        ]


def report_stuck(app: faust.App, groups: Iterable[SendGroup], now: float, after_s: float) -> int:
    """Report, once each, the groups that have waited more than ``after_s`` for the broker: log
    each with what the producer still holds, and wake the producer's sender; returns how many were
    reported. Called on a timer with ``after_s`` past the producer's request timeout: by then
    aiokafka has delivered a record, failed it or sent it again (a request unanswered is cut off at
    that timeout), so a group still waiting is stuck inside the producer. It holds its records
    unacked and everything behind them; the log says where it stopped, and a sender that missed a
    wake-up sends it now (docs/architecture.md, "Guarantees")."""
    stuck = [g for g in groups if not g.reported and now - g.started > after_s]
    if not stuck:
        return 0
    for group in stuck:
        group.reported = True
    try:
        producer = kafka_producer(app.producer)
        backlog: object = producer_backlog(producer)
        woken = wake_producer(producer)
    except Exception as exc:  # a report must never stop the timer that makes it
        backlog, woken = f"unknown ({exc!r})", False
    for group in stuck:
        log.error(
            "sends unacknowledged after %.0f s with no error from the producer (more than %.0f s: "
            "past its request timeout): %s; the producer holds %s; its sender %s",
            now - group.started,
            after_s,
            group.pending(),
            backlog,
            "woken" if woken else "was awake",
        )
    return len(stuck)


@dataclass(frozen=True, slots=True)
class Ticket:
    """One tracked record: the ledger it was read into and its offset."""

    tp: TP
    ledger: PartitionLedger[None]
    offset: int


class Acker:
    """Ledgers of every partition this worker reads, and the tasks that wait for broker acks."""

    def __init__(self, app: faust.App, oracle: OffsetOracle | None = None, hole_grace_s: float = 3.0) -> None:
        self.app = app
        #: where a partition's reading starts, and which offsets the log holds; None: trust the first
        #: record read (tools and tests without a broker)
        self.oracle = oracle
        self.hole_grace_s = hole_grace_s
        self._ledgers: dict[TP, PartitionLedger[None]] = {}
        self._committed: dict[TP, int] = {}
        self._metadata: dict[TP, str] = {}  # what was committed with each partition's offset
        self._starts: dict[TP, int] = {}  # where reading starts this generation (set at assignment)
        self._holes: dict[tuple[TP, int], float] = {}  # (partition, offset) -> when first seen
        self._commit_lock = asyncio.Lock()  # one commit at a time: a later point never lands first
        self._tasks: set[asyncio.Task[None]] = set()
        #: ack_after tasks still waiting for the broker to acknowledge their sends
        self._sends: dict[asyncio.Task[None], SendGroup] = {}
        #: send groups reported as stuck (:meth:`report_stuck_sends`)
        self.stuck_reported = 0
        #: whether a hole check found offsets the log does not hold (warned once, then logged at info:
        #: a transactional producer leaves them all the time)
        self.markers_seen = False
        self._idle = asyncio.Event()
        self._idle.set()
        #: per partition, offsets finished here but not committed when it was revoked (their outputs
        #: are on the broker): acked without work if the partition comes back
        self._done_before: dict[TP, set[int]] = {}
        #: records given back by rebalance drains, and records acked again without work
        self.given_back = 0
        self.done_again = 0
        #: bumped on every rebalance: records received before it are stale
        self.generation = 0

    async def track(self, event: EventT, generation: int | None = None) -> Ticket | None:
        """Register a record as taken on; None when it is stale: received before a rebalance that
        happened while its reader waited (``generation`` is :attr:`generation` at receipt), or a
        repeat delivery of an offset already taken on. Either is dropped untouched: a stale record's
        partition is read again from the committed offset by whoever owns it now, and taking it on
        here could commit past another owner's unread records."""
        if generation is None:
            generation = self.generation
        if generation != self.generation:
            return None
        msg = event.message
        ledger = self._ledgers.get(msg.tp)
        if ledger is None:  # a partition new to this generation: reading starts at its committed offset
            start = self._starts.get(msg.tp)
            if start is None:
                start = await self._start_of(msg.tp)
            if generation != self.generation:
                return None
            ledger = self._ledgers.setdefault(msg.tp, PartitionLedger(start))
            if start is not None and msg.offset > start:
                log.info("%s: reading starts at %d, first record delivered is %d", msg.tp, start, msg.offset)
        done = self._done_before.get(msg.tp)
        if done is not None and msg.offset in done and ledger.read(msg.offset, None):
            # finished here before the partition was revoked: its outputs are on the broker
            done.discard(msg.offset)
            ledger.finish(msg.offset)
            self.done_again += 1
            if self.pending() == 0:
                self._idle.set()
            return None
        if not ledger.read(msg.offset, None):  # nothing to hand back: the Acker commits offsets
            # fetched twice (the fetcher may hand over records from an older position first):
            # in flight here or already released
            log.debug("dropping a repeat delivery of %s offset %d", msg.tp, msg.offset)
            return None
        self._idle.clear()
        return Ticket(msg.tp, ledger, msg.offset)

    def is_repeat(self, event: EventT, generation: int) -> bool:
        """Whether :meth:`track` would drop this record now: received before a rebalance, or an
        offset already taken on this generation. Checks only; a reader calls it before waiting for
        admission room, so repeat deliveries pass at reading speed, not at the pace of admissions."""
        if generation != self.generation:
            return True
        ledger = self._ledgers.get(event.message.tp)
        return ledger is not None and ledger.is_repeat(event.message.offset)

    def done_here(self, event: EventT, generation: int) -> bool:
        """Whether this record was finished here before its partition was revoked (so
        :meth:`track` acks it without work); a reader checks before it waits for admission room."""
        done = self._done_before.get(event.message.tp)
        return generation == self.generation and done is not None and event.message.offset in done

    def put_back(self, ticket: Ticket) -> None:
        """Give a record taken on back unfinished (a rebalance's drain, for work that has not
        reached the model): it is never committed here and no drain waits for it any more; its
        partition's owner reads it again."""
        if self._ledgers.get(ticket.tp) is not ticket.ledger:
            return  # revoked meanwhile: nothing of it will be committed here anyway
        try:
            ticket.ledger.put_back(ticket.offset)
        except LedgerError:  # finished or released already: its outputs are on the broker
            return
        self.given_back += 1
        if self.pending() == 0:
            self._idle.set()

    def keep_only(self, assigned: Iterable[TP]) -> None:
        """Called on every assignment with the whole new assignment: drop the ledgers of partitions
        no longer assigned (aiokafka may assign anew without a revocation first, and a ledger of a
        partition owned elsewhere would hold the drain and the hole check for ever)."""
        keep = set(assigned)
        gone = [tp for tp in self._ledgers if tp not in keep]
        if gone:
            log.warning("assignment without a revocation: dropping %d partitions' ledgers", len(gone))
            self.revoke(gone)
        for tp in [tp for tp in self._done_before if tp not in keep]:
            del self._done_before[tp]  # owned elsewhere now: the commit's metadata tells its owner

    async def seek_to_starts(self, tps: Iterable[TP]) -> dict[TP, int]:
        """Called on every assignment, before reading resumes: seek each partition to where this
        generation's reading starts (committed offset, else the log start) and remember it.

        Why: Faust seeks assigned partitions to their committed offsets, and aiokafka's
        ``seek_to_committed`` leaves a partition that has none where it was. A partition kept
        across a rebalance before anything was committed on it would go on from where the previous
        generation's fetch stopped, while Faust discards what that generation had fetched and not
        yet handed over: those records would never be read.
        """
        t0 = time.perf_counter()
        starts: dict[TP, int] = {}
        for tp, start in (await self._starts_of(list(tps))).items():
            starts[tp] = start
            self._drop_done_before(tp, start)
        if starts:
            await self._seek(starts, "to their starts", 2 * ORACLE_TIMEOUT_S)
        self._starts.update(starts)
        log.info(
            "%d partitions sought to their starts in %.0f ms", len(starts), 1000 * (time.perf_counter() - t0)
        )
        return starts

    def resume_points(self, tps: Iterable[TP]) -> dict[TP, int]:
        """Where reading of each partition must go on if the records delivered and not yet taken
        were thrown away: the first offset not taken on (:meth:`PartitionLedger.resume_point`), or
        this generation's start for a partition nothing was taken from yet. Partitions with neither
        are left out (their start is sought at assignment)."""
        points: dict[TP, int] = {}
        for tp in tps:
            ledger = self._ledgers.get(tp)
            point = ledger.resume_point() if ledger is not None else self._starts.get(tp)
            if point is not None:
                points[tp] = point
        return points

    def reseek_soon(self, points: dict[TP, int]) -> None:
        """Seek to ``points`` (:meth:`resume_points`) in a task, unless a rebalance comes first.

        Called when Faust is about to empty every stream buffer (it does so when it resumes the
        flow after a rebalance, docs/architecture.md "Guarantees"): without this, records a blocked
        reader had not taken yet were gone while the fetch position stayed past them."""
        if not points:
            return
        generation = self.generation

        async def reseek() -> None:
            if generation == self.generation:
                await self._seek(points, "back after a buffer clear")

        task = asyncio.get_running_loop().create_task(reseek())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def reading_start(self, tp: TP) -> int | None:
        """Where this generation's reading of ``tp`` starts: found at its assignment
        (:meth:`seek_to_starts`), else asked of the broker now (and kept for :meth:`track`); None
        when the broker could not say. For a reader that takes records in offset order
        (:class:`pipeline.in_order.InOrderGate`)."""
        start = self._starts.get(tp)
        if start is None:
            generation = self.generation
            start = await self._start_of(tp)
            if start is not None and generation == self.generation:
                self._starts.setdefault(tp, start)
        return start

    async def held_from(self, tp: TP, offset: int) -> list[int] | None:
        """The offsets of the committed records the log holds from ``offset`` on (as many as one
        fetch returns), asked by a reader that was handed a record after ``offset``; None when the
        broker could not say (no oracle, or no answer in time)."""
        if self.oracle is None:
            return None
        try:
            return await asyncio.wait_for(
                self.oracle.held_from(tp.topic, tp.partition, offset, known_later=True), ORACLE_TIMEOUT_S
            )
        except Exception as exc:  # the reader asks again later
            log.warning("could not probe %s at offset %d (%r)", tp, offset, exc)
            return None

    async def _seek(self, points: dict[TP, int], why: str, timeout_s: float = ORACLE_TIMEOUT_S) -> None:
        """Seek partitions and wait for it (``seek_wait``: Faust's ``seek`` would call aiokafka from
        this thread, not the consumer's); a failure is logged, never raised."""
        try:
            await asyncio.wait_for(self.app.consumer.seek_wait(points), timeout_s)
        except Exception as exc:  # the hole check (check_holes) asks again
            log.warning("could not seek %d partitions %s (%r)", len(points), why, exc)

    async def _start_of(self, tp: TP) -> int | None:
        """Where this generation reads ``tp`` from (see :meth:`_starts_of`)."""
        return (await self._starts_of([tp])).get(tp)

    async def _starts_of(self, tps: list[TP]) -> dict[TP, int]:
        """Where this generation reads each of ``tps`` from, asked of the broker at once; what the
        committing worker had finished past it (the commit's metadata) joins :attr:`_done_before`.
        Partitions the broker could not answer for are left out."""
        if self.oracle is None or not tps:
            return {}
        try:
            found = await asyncio.wait_for(
                self.oracle.starts_and_done([(tp.topic, tp.partition) for tp in tps]), ORACLE_TIMEOUT_S
            )
        except Exception as exc:  # the broker will be asked again at the next rebalance
            log.warning(
                "could not read where %d partitions start (%r): trusting their first records", len(tps), exc
            )
            return {}
        starts: dict[TP, int] = {}
        for tp in tps:
            start, done = found[(tp.topic, tp.partition)]
            if done:
                self._done_before[tp] = self._done_before.get(tp, set()) | done
            starts[tp] = start
        return starts

    def _drop_done_before(self, tp: TP, start: int) -> None:
        done = self._done_before.get(tp)
        if done is not None:
            done.difference_update([offset for offset in done if offset < start])
            if not done:
                del self._done_before[tp]

    def is_current(self, ticket: Ticket) -> bool:
        """Whether ``ticket``'s partition is still read here into the ledger it was tracked in (not
        revoked since): work not begun on a record whose ticket is not current is left to the
        partition's owner."""
        return self._ledgers.get(ticket.tp) is ticket.ledger

    def ticket_of(self, event: EventT) -> Ticket | None:
        """The ticket of a record already tracked and not yet released, or None."""
        msg = event.message
        ledger = self._ledgers.get(msg.tp)
        if ledger is None or msg.offset not in ledger:
            return None
        return Ticket(msg.tp, ledger, msg.offset)

    def describe(self) -> dict[str, dict[str, int | None]]:
        """For ``/status``: each partition with records in flight, where its release stands, the
        oldest record not finished and the last one read (where a stuck record waits)."""
        return {
            f"{tp.topic}[{tp.partition}]": {
                "in_flight": ledger.in_flight,
                "next_release": ledger.next_release,
                "oldest_unfinished": ledger.oldest_unfinished(),
                "last_read": ledger.last_read,
            }
            for tp, ledger in self._ledgers.items()
            if ledger.in_flight
        }

    def pending(self) -> int:
        """Records read and not yet finished (nor given back), over every partition."""
        return sum(ledger.in_flight for ledger in self._ledgers.values())

    async def finish(self, tickets: Iterable[Ticket]) -> None:
        """Mark records finished and ack the finished prefix of each of their partitions."""
        for ticket in tickets:
            ledger = ticket.ledger
            current = self._ledgers.get(ticket.tp)
            ledger.finish(ticket.offset)
            if current is not ledger:
                continue  # the partition was revoked since: its next owner reads it again
        if self.pending() == 0:
            self._idle.set()

    def ack_after(self, tickets: list[Ticket], futures: Iterable[Awaitable[Any]]) -> None:
        """Finish ``tickets`` once every future has resolved; called right after the sends."""
        group = SendGroup(time.monotonic(), list(futures))
        task = asyncio.get_running_loop().create_task(self._after(tickets, group))
        self._tasks.add(task)
        self._sends[task] = group
        task.add_done_callback(self._sent)

    def _sent(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._sends.pop(task, None)

    def awaiting_broker(self) -> dict[str, float | int | None]:
        """For ``/status``: groups of records whose outputs are sent and not yet acknowledged by the
        broker, and how long the oldest has waited (ms). Records unacked with nothing here wait
        for work; records here wait for the broker (bounded by producer_request_timeout_ms and the
        sends' retries)."""
        oldest = min((group.started for group in self._sends.values()), default=None)
        return {
            "groups": len(self._sends),
            "oldest_ms": None if oldest is None else round((time.monotonic() - oldest) * 1000),
        }

    def report_stuck_sends(self, now: float, after_s: float) -> int:
        """Called on the commit timer: report send groups stuck in the producer
        (:func:`report_stuck`); returns how many were reported now."""
        reported = report_stuck(self.app, self._sends.values(), now, after_s)
        self.stuck_reported += reported
        return reported

    async def _after(self, tickets: list[Ticket], group: SendGroup) -> None:
        try:
            for i, fut in enumerate(group.futures):  # awaited in turn: no task per send
                group.awaiting = i
                await fut
        except (Exception, asyncio.CancelledError) as exc:
            # a send cancelled by someone else is a failed one; returning here instead would leave
            # the records unacked for good and their partitions' commits stuck behind them
            if isinstance(exc, asyncio.CancelledError) and task_is_cancelling():
                raise
            # Runtime.send already retried; an output that cannot be written would leave a gap that
            # blocks every later commit on its partition. Stop the worker instead: its partitions
            # move, and the records are read again by the next owner.
            log.critical("a send failed after retries (%r); stopping the worker so nothing is lost", exc)
            await self.app.crash(exc)
            return
        await self.finish(tickets)

    def commit_points(self) -> dict[TP, tuple[int, str]]:
        """Per partition, the offset to commit for what was released, with metadata naming what is
        finished past it (:func:`pipeline.offsets.encode_done`): where either changed since the last
        commit. Whoever reads the partition next acks those without work."""
        out: dict[TP, tuple[int, str]] = {}
        for tp, ledger in self._ledgers.items():
            point = ledger.commit_point if ledger.commit_point is not None else ledger.next_release
            if point is None:
                continue
            committed = self._committed.get(tp, -1)
            # on the commit timer's path: build the list only when something finished past the point
            finished = ledger.finished_unreleased() if len(ledger) > ledger.in_flight else ()
            metadata = encode_done(finished, point)
            if point > committed or (point == committed and metadata != self._metadata.get(tp, "")):
                out[tp] = (point, metadata)
        return out

    async def commit(self) -> bool:
        """Commit every released run now; called on a timer and at every drain (Faust forgets its
        acks of revoked partitions before the app hears of a rebalance, so its own commit then would
        leave out what was released since its last timer). False when the group refused it."""
        async with self._commit_lock:
            points = self.commit_points()
            if not points:
                return True
            try:
                done = await asyncio.wait_for(commit_offsets(self.app.consumer, points), COMMIT_TIMEOUT_S)
            except TimeoutError:
                # the client keeps retrying while the group coordinator is away (a broker restart);
                # a drain must not wait for it: its rebalance, and the whole group, would wait too
                log.warning(
                    "a commit of %d partitions got no answer in %.0f s", len(points), COMMIT_TIMEOUT_S
                )
                return False
            if not done:
                return False
            for tp, (offset, metadata) in points.items():
                if offset >= self._committed.get(tp, -1):
                    self._committed[tp] = offset
                    self._metadata[tp] = metadata
            return True

    async def check_holes(self, now: float) -> int:
        """Ask the broker about runs that wait for an offset never delivered though later ones
        were, once they have waited ``hole_grace_s``: step over offsets the log does not hold, or
        read the partition again from there. Returns how many holes were stepped over."""
        if self.oracle is None:
            return 0
        resolved = 0
        live: set[tuple[TP, int]] = set()
        for tp, ledger in list(self._ledgers.items()):
            hole = ledger.hole()
            if hole is None:
                continue
            key = (tp, hole)
            live.add(key)
            first_seen = self._holes.setdefault(key, now)
            if now - first_seen < self.hole_grace_s:
                continue
            generation = self.generation
            # the records held up to the last one read, in one answer: every offset missing from it
            # is stepped over when the run reaches it, not one hole per grace period
            span = min(HOLE_SCAN_RECORDS, max(1, (ledger.last_read or hole) - hole + 1))
            try:
                held = await asyncio.wait_for(
                    self.oracle.held_from(tp.topic, tp.partition, hole, span, known_later=True),
                    ORACLE_TIMEOUT_S,
                )
            except Exception as exc:  # asked again on the next tick
                log.warning("could not probe %s at offset %d (%r)", tp, hole, exc)
                continue
            if generation != self.generation or self._ledgers.get(tp) is not ledger or ledger.hole() != hole:
                continue  # a rebalance, or the record arrived meanwhile
            if held and held[0] > hole:
                absent = not_held(hole, held)
                log.log(
                    logging.INFO if self.markers_seen else logging.WARNING,
                    "%s: %d offsets from %d to %d are not in the log (transaction markers?); stepping over",
                    tp,
                    len(absent),
                    hole,
                    held[-1],
                )
                self.markers_seen = True
                ledger.mark_absent(absent)
                resolved += 1
            else:
                log.warning(
                    "%s: offset %d was never delivered; reading the partition again from it", tp, hole
                )
                await self._seek({tp: hole}, f"to the hole at {hole}")  # asked again on the next tick
            self._holes[key] = now
        for key in [k for k in self._holes if k not in live]:
            del self._holes[key]
        return resolved

    def revoke(self, tps: Iterable[TP]) -> None:
        """Drop the ledgers of revoked partitions (called on every rebalance)."""
        self.generation += 1
        self._starts.clear()
        for tp in tps:
            ledger = self._ledgers.pop(tp, None)
            self._committed.pop(tp, None)
            self._metadata.pop(tp, None)
            if ledger is not None:
                base = ledger.next_release
                done = self._done_before.get(tp, set()) | ledger.finished_unreleased()
                done = {offset for offset in done if base is None or offset >= base}
                if done:
                    self._done_before[tp] = done
                else:
                    self._done_before.pop(tp, None)
        if self.pending() == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every tracked record is acked; False on timeout (a graceful stop's drain)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True
