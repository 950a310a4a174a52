"""How far a worker's intake is behind its request topic: the batch and offline readers of the same
worker yield to it while it is (docs/architecture.md, "Intake first").

A worker that runs both agents shares one event loop between them. Without this, a backlog of cheap
low-class work (items expired in Kafka, level-3 templates) drained at well over a thousand replies a
second after a surge and starved the intake, so real-time requests waited seconds in the request topic
behind it, before any priority could apply. No Faust or Kafka here: the intake agent reports the offset
of each request it takes, and the high watermark comes from a function the agents pass in.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

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
    since. ``stale_ms``: a partition whose last take is older than this is ignored, so a partition the
    intake gave up (revoked, or the worker stopping) holds nobody back for long.
    """

    def __init__(self, limit_records: int, stale_ms: float, highwater: Highwater) -> None:
        if limit_records < 0 or stale_ms <= 0:
            raise ValueError(f"limit_records must be >= 0 and stale_ms > 0, got {limit_records}, {stale_ms}")
        self.limit_records = limit_records
        self.stale_ms = stale_ms
        self._highwater = highwater
        self._taken: dict[Hashable, tuple[int, float]] = {}
        self._behind = False

    def record(self, partition: Hashable, offset: int, now_ms: float) -> None:
        """Called by the intake for each request it takes on."""
        self._taken[partition] = (offset, now_ms)

    def _most_waiting(self, now_ms: float) -> int:
        """The most records waiting in one partition taken from lately."""
        most = 0
        for partition, (offset, at) in self._taken.items():
            highwater = self._highwater(partition) if now_ms - at <= self.stale_ms else None
            if highwater is not None:
                most = max(most, highwater - offset - 1)
        return most

    def behind(self, now_ms: float) -> bool:
        """Whether the intake is behind: some partition taken from lately has more than
        ``limit_records`` waiting, or had and still has any."""
        most = self._most_waiting(now_ms)
        self._behind = most > 0 if self._behind else most > self.limit_records
        return self._behind
