"""The intake's triage: requests taken off the request topic and not yet handled, highest class first.

Every class shares one request topic, and the intake handled its records one at a time, in order: a
real-time request read behind a backlog of lower-class records in its partition (after a restart, or
in a burst) waited for every one of them before any priority could apply. So the intake's reader
takes records off Faust's stream buffer as they come, into this queue, bounded in records and bytes,
and its handler takes them out real-time first, then interactive, batch, offline
(docs/architecture.md, "Triage at the intake"). Within a class the order is the order read, so one
user's requests of one class are still taken up in the order they were sent; across classes no
order was ever kept (each class has its own work topic).

Pure logic: no Faust or Kafka here. The agent decides each record's rank from the class it claims
(a record that cannot be decoded ranks last: its error reply has no deadline to meet).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class _Entry(Generic[T]):
    item: T
    size_bytes: int
    seq: int


class TriageQueue(Generic[T]):
    """A bounded queue of ``ranks`` FIFO lanes; :meth:`pop` serves the lowest rank first.

    ``max_records``: most items queued at once (1: no reordering, each record is handled as it is
    read). ``max_bytes``: most bytes queued at once; one item is always let in, however large, so a
    record as large as the worker accepts still passes.
    """

    def __init__(self, ranks: int, max_records: int, max_bytes: int) -> None:
        if ranks < 1 or max_records < 1 or max_bytes < 1:
            raise ValueError(
                f"ranks, max_records and max_bytes must be >= 1, got {ranks}, {max_records}, {max_bytes}"
            )
        self.max_records = max_records
        self.max_bytes = max_bytes
        self._lanes: list[deque[_Entry[T]]] = [deque() for _ in range(ranks)]
        self._count = 0
        self._bytes = 0
        self._seq = 0
        #: items handed out ahead of an item queued before them (a higher class overtaking)
        self.overtakes = 0

    def __len__(self) -> int:
        return self._count

    @property
    def queued_bytes(self) -> int:
        """Bytes of the items queued now."""
        return self._bytes

    def has_room(self, size_bytes: int) -> bool:
        """Whether an item of ``size_bytes`` may be put now (called by the reader before it takes a
        record on; while False it waits for the handler to take one out)."""
        if self._count == 0:
            return True
        return self._count < self.max_records and self._bytes + size_bytes <= self.max_bytes

    def put(self, rank: int, item: T, size_bytes: int) -> None:
        """Queue ``item`` behind the others of its ``rank`` (0 the highest). The caller checked
        :meth:`has_room`; ranks past the last lane go to the last."""
        lane = self._lanes[min(max(rank, 0), len(self._lanes) - 1)]
        lane.append(_Entry(item, size_bytes, self._seq))
        self._seq += 1
        self._count += 1
        self._bytes += size_bytes

    def pop(self) -> T:
        """Take out the oldest item of the highest rank queued; IndexError when empty."""
        for rank, lane in enumerate(self._lanes):
            if lane:
                entry = lane.popleft()
                self._count -= 1
                self._bytes -= entry.size_bytes
                if any(lower and lower[0].seq < entry.seq for lower in self._lanes[rank + 1 :]):
                    self.overtakes += 1
                return entry.item
        raise IndexError("pop from an empty TriageQueue")

    def remove_if(self, drop: Callable[[T], bool]) -> list[T]:
        """Take out every item for which ``drop`` is true, in queue order per rank (a rebalance gives
        back the records of revoked partitions); the rest keep their order."""
        removed: list[T] = []
        for i, lane in enumerate(self._lanes):
            kept: deque[_Entry[T]] = deque()
            for entry in lane:
                if drop(entry.item):
                    removed.append(entry.item)
                    self._count -= 1
                    self._bytes -= entry.size_bytes
                else:
                    kept.append(entry)
            self._lanes[i] = kept
        return removed
