"""How far a worker's intake is behind its request topic: the batch and offline readers of the same
worker yield to it while it is (docs/architecture.md, "Intake first").

A worker that runs both agents shares one event loop between them. Without this, a backlog of cheap
low-class work (items expired in Kafka, level-3 templates) drained at well over a thousand replies a
second after a surge and starved the intake, so real-time requests waited seconds in the request topic
behind it, before any priority could apply. No Faust or Kafka here: the intake agent reports the offset
of each request it takes, and the high watermark comes from a function the agents pass in.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable

#: a partition's high watermark (its next offset) as the consumer last fetched it; None: unknown
Highwater = Callable[[Hashable], int | None]


class IntakeBacklog:
    """Records left in each request partition behind the last one the intake took.

    ``limit_records``: more than this waiting in any partition makes the intake "behind", and it stays
    behind until no partition has a record waiting (a lower mark of zero: with the same mark both ways,
    the last ``limit_records`` of a backlog, in the test the real-time requests, waited for the whole
    batch drain that resumed at the mark; with a mark of zero both ways, the few records a fetch leaves
    waiting under steady load held batch reading back all the time). The high
    watermark is read when asked, not when the intake took its last record: an intake starved of the
    event loop takes records seldom, and a lag measured at its last take would miss everything fetched
    since.

    A partition counts while it is this worker's: the high watermark function answers None for one not
    assigned (the consumer knows none), and the rebalance forgets revoked ones. How long ago the intake
    took from it does not matter: an intake held up for a while (by the event loop, or by Faust's
    producer buffer) is exactly the one the low classes must yield to, and a time limit made its
    backlog invisible then.
    """

    def __init__(self, limit_records: int, highwater: Highwater) -> None:
        if limit_records < 0:
            raise ValueError(f"limit_records must be >= 0, got {limit_records}")
        self.limit_records = limit_records
        self._highwater = highwater
        self._taken: dict[Hashable, int] = {}
        self._behind = False

    def record(self, partition: Hashable, offset: int) -> None:
        """Called by the intake for each request it takes on."""
        self._taken[partition] = offset

    def forget(self, partitions: Iterable[Hashable]) -> None:
        """Called on a rebalance with the partitions this worker gave up: their next owner reads them,
        and an offset left from before would count records it never takes if one came back."""
        for partition in partitions:
            self._taken.pop(partition, None)

    def _most_waiting(self) -> int:
        """The most records waiting in one partition the intake reads."""
        most = 0
        for partition, offset in self._taken.items():
            highwater = self._highwater(partition)
            if highwater is not None:
                most = max(most, highwater - offset - 1)
        return most

    def behind(self) -> bool:
        """Whether the intake is behind: some partition it reads has more than ``limit_records``
        waiting, or had and still has any."""
        most = self._most_waiting()
        self._behind = most > 0 if self._behind else most > self.limit_records
        return self._behind
