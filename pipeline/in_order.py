"""Taking each partition's records in offset order, for a reader whose work depends on that order
(the risk stages: an entity skips an item at or before the position it last took, so an item
taken after a later one of its partition would be skipped for good; docs/architecture.md,
"Risk: takeover").

A consumer delivers a partition in order, except around the points where the worker moves its
position back: after a rebalance's buffer clear the Acker seeks back to the first offset not
taken, and its hole check seeks back to an offset that never arrived, while records fetched from
the old position may still come first. The gate keeps, per partition and per rebalance
generation, the next offset a reader may take. A record past it (a gap) is taken only once the
broker says nothing lies in between (a transaction marker); otherwise it is dropped untouched and
the partition is read again from the gap, and records past the gap are dropped without asking
again until ``reprobe_after_s`` has passed. Pure: the caller asks the broker and seeks.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class Verdict(enum.Enum):
    """What a reader does with a record (:meth:`InOrderGate.check`)."""

    #: the next offset of its partition (or the first one seen): take it
    TAKE = "take"
    #: before the next offset: taken already this generation, drop it
    REPEAT = "repeat"
    #: past the next offset: ask the broker what lies between, unless a seek back is under way
    GAP = "gap"
    #: past the next offset while a seek back to it is under way: drop it
    WAIT = "wait"


class InOrderGate(Generic[K]):
    """Per partition (any hashable key), the next offset a reader may take, for one generation."""

    def __init__(self, reprobe_after_s: float = 2.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.reprobe_after_s = reprobe_after_s
        self.clock = clock
        self.generation: int | None = None
        self._next: dict[K, int] = {}
        #: partitions read again from their gap: when that was asked
        self._seeking: dict[K, float] = {}
        #: records past a gap dropped, gaps the broker said were empty (counters for /status)
        self.dropped = 0
        self.empty_gaps = 0

    def begin(self, generation: int) -> None:
        """Called with the Acker's generation before each record: a new one (a rebalance) forgets
        every partition's position (reading starts again where the Acker seeks)."""
        if generation != self.generation:
            self.generation = generation
            self._next.clear()
            self._seeking.clear()

    def expected(self, key: K) -> int | None:
        """The next offset the reader may take from ``key``; None before its first record or start."""
        return self._next.get(key)

    def start_at(self, key: K, offset: int) -> None:
        """Where this generation's reading of ``key`` starts (its committed offset); a record
        before it is a repeat, one past it a gap. Ignored once the partition has a position."""
        self._next.setdefault(key, offset)

    def check(self, key: K, offset: int) -> Verdict:
        """What to do with the record at ``offset`` of ``key``; reads nothing in."""
        nxt = self._next.get(key)
        if nxt is None or offset == nxt:
            return Verdict.TAKE
        if offset < nxt:
            return Verdict.REPEAT
        asked = self._seeking.get(key)
        if asked is not None and self.clock() - asked < self.reprobe_after_s:
            self.dropped += 1
            return Verdict.WAIT
        return Verdict.GAP

    def took(self, key: K, offset: int) -> None:
        """The reader took (or acked without work) the record at ``offset``."""
        self._next[key] = offset + 1
        self._seeking.pop(key, None)

    def gap_empty(self, key: K, offset: int) -> None:
        """The broker said no record lies between the next offset and ``offset``: take it next."""
        self._next[key] = offset
        self._seeking.pop(key, None)
        self.empty_gaps += 1

    def seeking(self, key: K) -> None:
        """The record past the gap was dropped and the partition is read again from the gap."""
        self._seeking[key] = self.clock()
        self.dropped += 1
