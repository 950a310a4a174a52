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
    took from one partition does not matter: an intake held up for a while (by the event loop, or by
    Faust's producer buffer) is exactly the one the low classes must yield to.

    ``stall_ms``: a hold must never stop the worker. When the intake has taken nothing at all for this
    long while it is behind, what holds it up is not the low classes' work (they are held), and the
    hold gives way until the intake takes a record again; :attr:`gave_way` counts those times. (An
    earlier version ignored each partition a second after its last take, and lost the hold whenever
    the intake was slow; with no time limit at all, a worker stopped answering in one benchmark run:
    the intake took nothing for minutes while records waited, and the batch and offline readers held
    on for it.)
    """

    def __init__(self, limit_records: int, stall_ms: float, highwater: Highwater) -> None:
        if limit_records < 0 or stall_ms <= 0:
            raise ValueError(f"limit_records must be >= 0 and stall_ms > 0, got {limit_records}, {stall_ms}")
        self.limit_records = limit_records
        self.stall_ms = stall_ms
        self._highwater = highwater
        self._taken: dict[Hashable, int] = {}
        self._last_take_ms: float | None = None
        self._behind = False
        self._gave_way = False
        #: times the hold gave way to a stalled intake
        self.gave_way = 0
        #: how many requests the intake took off its partitions and has not handled yet (its triage
        #: queue, pipeline/triage.py): they wait behind it as much as those still in the partitions;
        #: the intake sets it when it starts
        self.queued: Callable[[], int] = lambda: 0

    def record(self, partition: Hashable, offset: int, now_ms: float) -> None:
        """Called by the intake for each request it takes on."""
        self._taken[partition] = offset
        self._last_take_ms = now_ms
        self._gave_way = False

    def forget(self, partitions: Iterable[Hashable]) -> None:
        """Called on a rebalance with the partitions this worker gave up: their next owner reads them,
        and an offset left from before would count records it never takes if one came back."""
        for partition in partitions:
            self._taken.pop(partition, None)

    def _most_waiting(self) -> int:
        """The most records waiting in one partition the intake reads, or in its triage queue."""
        most = self.queued()
        for partition, offset in self._taken.items():
            highwater = self._highwater(partition)
            if highwater is not None:
                most = max(most, highwater - offset - 1)
        return most

    def behind(self, now_ms: float) -> bool:
        """Whether the low classes yield to the intake: some partition it reads has more than
        ``limit_records`` waiting, or had and still has any; unless the intake has taken nothing for
        ``stall_ms``."""
        most = self._most_waiting()
        self._behind = most > 0 if self._behind else most > self.limit_records
        if not self._behind or self._last_take_ms is None:
            return self._behind
        if now_ms - self._last_take_ms <= self.stall_ms:
            return True
        if not self._gave_way:
            self._gave_way = True
            self.gave_way += 1
        return False


#: a held reader's stream buffer past this share of its capacity is not held any longer: Faust pauses a
#: partition's fetch at 80 % (``maxsize / 1.25``), one poll (at most a tenth of the buffer, see
#: ``stream_buffer_max_records``) may still arrive after that, and a full buffer blocks the delivery of
#: records to every stream of the worker, the intake's too, which the hold then waits for
HOLD_RELEASE_FILL = 0.9


def holding_would_block(queued: int, capacity: int) -> bool:
    """Whether a reader holding back while ``queued`` records fill its stream buffer of ``capacity``
    risks that buffer filling up (0 capacity: unbounded, never)."""
    return capacity > 0 and queued > HOLD_RELEASE_FILL * capacity
