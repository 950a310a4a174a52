"""Acks in offset order: a record is acked to Faust only when it and every record before it on its
partition are finished (their outputs acknowledged by the broker). See pipeline/offsets.py for why,
and docs/architecture.md, "Guarantees".

One :class:`Acker` per worker. A reader calls :meth:`Acker.track` as it takes a record; whoever
produces the record's outputs calls :meth:`Acker.ack_after` with the broker's acknowledgement
futures. On a rebalance the ledgers of revoked partitions are dropped: records still in flight from
them are answered but never acked, so the next owner reads them again (and the reply table makes
that repeat identical).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Iterable
from dataclasses import dataclass
from typing import Any

import faust
from faust.types import TP, EventT

from pipeline.offsets import PartitionLedger

log = logging.getLogger("surge.acks")


@dataclass(frozen=True, slots=True)
class Ticket:
    """One tracked record: the ledger it was read into, its offset, and how to ack it."""

    tp: TP
    ledger: PartitionLedger[tuple[faust.StreamT, EventT]]
    offset: int


class Acker:
    """Ledgers of every partition this worker reads, and the tasks that wait for broker acks."""

    def __init__(self, app: faust.App) -> None:
        self.app = app
        self._ledgers: dict[TP, PartitionLedger[tuple[faust.StreamT, EventT]]] = {}
        self._tasks: set[asyncio.Task[None]] = set()
        self._idle = asyncio.Event()
        self._idle.set()
        #: bumped on every rebalance: records received before it are stale
        self.generation = 0

    def track(self, stream: faust.StreamT, event: EventT, generation: int | None = None) -> Ticket | None:
        """Register a record as taken on; None when it is stale: received before a rebalance that
        happened while its reader waited (``generation`` is :attr:`generation` at receipt). A stale
        record is dropped untouched: its partition is read again from the committed offset by
        whoever owns it now, and acking it here could commit past another owner's unread records."""
        if generation is not None and generation != self.generation:
            return None
        msg = event.message
        ledger = self._ledgers.get(msg.tp)
        if ledger is None or (ledger.last_read is not None and msg.offset <= ledger.last_read):
            # a new partition, or one read again from its committed offset after a rebalance
            ledger = self._ledgers[msg.tp] = PartitionLedger()
        ledger.read(msg.offset, (stream, event))
        self._idle.clear()
        return Ticket(msg.tp, ledger, msg.offset)

    def ticket_of(self, event: EventT) -> Ticket | None:
        """The ticket of a record already tracked and not yet released, or None."""
        msg = event.message
        ledger = self._ledgers.get(msg.tp)
        if ledger is None or msg.offset not in ledger:
            return None
        return Ticket(msg.tp, ledger, msg.offset)

    def pending(self) -> int:
        """Records read and not yet acked, over every partition."""
        return sum(len(ledger) for ledger in self._ledgers.values())

    async def finish(self, tickets: Iterable[Ticket]) -> None:
        """Mark records finished and ack the finished prefix of each of their partitions."""
        for ticket in tickets:
            ledger = ticket.ledger
            current = self._ledgers.get(ticket.tp)
            releasable = ledger.finish(ticket.offset)
            if current is not ledger:
                continue  # the partition was revoked (or re-read) since: its next owner reads it again
            for stream, event in releasable:
                await stream.ack(event)
        if self.pending() == 0:
            self._idle.set()

    def ack_after(self, tickets: list[Ticket], futures: Iterable[Awaitable[Any]]) -> None:
        """Finish ``tickets`` once every future has resolved; called right after the sends."""
        task = asyncio.get_running_loop().create_task(self._after(tickets, list(futures)))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _after(self, tickets: list[Ticket], futures: list[Awaitable[Any]]) -> None:
        try:
            for fut in futures:  # awaited in turn: no task per send
                await fut
        except Exception as exc:
            # Runtime.send already retried; an output that cannot be written would leave a gap that
            # blocks every later commit on its partition. Stop the worker instead: its partitions
            # move, and the records are read again by the next owner.
            log.critical("a send failed after retries (%r); stopping the worker so nothing is lost", exc)
            await self.app.crash(exc)
            return
        await self.finish(tickets)

    def revoke(self, tps: Iterable[TP]) -> None:
        """Drop the ledgers of revoked partitions (called on every rebalance)."""
        self.generation += 1
        for tp in tps:
            self._ledgers.pop(tp, None)
        if self.pending() == 0:
            self._idle.set()

    async def wait_idle(self, timeout_s: float) -> bool:
        """Wait until every tracked record is acked; False on timeout (a graceful stop's drain)."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
        except TimeoutError:
            return False
        return True
