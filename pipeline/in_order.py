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

What the broker said is kept: one answer lists the committed records it holds from an offset on
(:meth:`InOrderGate.learn`), and a later gap inside that stretch is answered from the list without
asking again (:meth:`InOrderGate.known_empty`). A producer that writes one transaction per record
leaves a marker after each, so its every record is past a gap; asked each time, the reader decided
a backlog of them at a sixth of its speed (docs/architecture.md, "Transactional producers"). The
list stays true for good: an offset never changes what it holds, and a record of a transaction still
open is past every record the broker returned.
"""

from __future__ import annotations

import bisect
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
        #: per partition, what the broker last said it holds: (the offset asked, the committed
        #: records' offsets from there, ascending); kept across generations
        self._held: dict[K, tuple[int, list[int]]] = {}
        #: records past a gap dropped, gaps the broker said were empty, of which answered from
        #: what it had said before (counters for /status)
        self.dropped = 0
        self.empty_gaps = 0
        self.known_gaps = 0

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

    def learn(self, key: K, asked: int, held: list[int]) -> None:
        """The broker's answer for ``key``: the offsets of the committed records it holds from
        ``asked`` on (ascending; as many as it returned). Nothing between them, nor between
        ``asked`` and the first, is a record a reader could be handed."""
        if held:
            self._held[key] = (asked, held)

    def known_empty(self, key: K, expected: int, offset: int) -> bool:
        """Whether an earlier answer (:meth:`learn`) already says that no record lies from
        ``expected`` up to ``offset`` (delivered, past the gap). False when it does not cover the
        stretch or holds a record in it: ask the broker."""
        found = self._held.get(key)
        if found is None:
            return False
        asked, held = found
        if expected < asked or offset > held[-1]:
            return False
        i = bisect.bisect_left(held, expected)
        if i < len(held) and held[i] < offset:
            return False
        self.known_gaps += 1
        return True
