"""How long each class's items recently waited in the model queue, and whether an item about to be
embedded can still begin inference by its deadline (docs/architecture.md, "Degradation").

Past the model's speed an item of a class the queue serves late is embedded, queued, and expires
there: at twice the model's limit 55 % of the embedding work went to such items, on the event loop
the intake needs too. The inference agent records, as each batch leaves the queue, every item's wait
(an expired item's wait so far: a lower bound); :meth:`QueueWait.unreachable` then says that an item
whose time left is shorter than its class's recent median wait plus the embedding call ahead of it
would expire too, so it is answered ``deadline_exceeded`` before it costs an embedding. The agent
asks only for classes below real-time: the queue serves real-time first, and its expired items'
waits made its mean wait refuse most real-time items at 2 L, handing the model to interactive work.

Only waits from the last ``window_ms`` count: a class whose items are all refused records none, so
after a window with none it is embedded again and its estimate starts over from what the queue does
then (the refusal cannot hold itself in place after the surge). Pure: times are epoch ms passed in.
"""

from __future__ import annotations

import statistics
from collections import deque
from dataclasses import dataclass

#: the degradation level from which items are refused as unreachable: below it the worker keeps up,
#: and a refusal would be an error reply where the queue's wait was a passing one
UNREACHABLE_FROM_LEVEL = 2


@dataclass(frozen=True, slots=True)
class Unreachable:
    """An item that would expire in the queue: its time left, its class's recent wait for the
    model and the embedding call ahead of it."""

    left_ms: float
    wait_ms: float
    ahead_ms: float


class QueueWait:
    """Recent model-queue waits per class (at most ``max_samples`` each, within ``window_ms``)."""

    def __init__(self, window_ms: float = 2_000.0, max_samples: int = 256) -> None:
        if window_ms <= 0 or max_samples < 1:
            raise ValueError(f"window_ms must be > 0 and max_samples >= 1, got {window_ms}, {max_samples}")
        self.window_ms = window_ms
        self._samples: dict[str, deque[tuple[float, float]]] = {}
        self._max = max_samples
        #: each class's median over its current samples, until they change (asked once per item taken
        #: for embedding, while samples change once per batch)
        self._median: dict[str, float] = {}

    def observe(self, priority: str, wait_ms: float, now_ms: float) -> None:
        """Called as an item leaves the queue (into a batch, or expired) after ``wait_ms`` in it."""
        samples = self._samples.get(priority)
        if samples is None:
            samples = self._samples[priority] = deque(maxlen=self._max)
        samples.append((now_ms, max(0.0, wait_ms)))
        self._median.pop(priority, None)

    def expected_ms(self, priority: str, now_ms: float) -> float | None:
        """The class's median wait over the window; None when no item of it left the queue in it.
        The median, not the mean: a few items expired after a long wait (a failover's backlog)
        must not make a queue that serves most items in time refuse them."""
        samples = self._samples.get(priority)
        if not samples:
            return None
        cutoff = now_ms - self.window_ms
        if samples[0][0] < cutoff:
            self._median.pop(priority, None)
            while samples and samples[0][0] < cutoff:
                samples.popleft()
            if not samples:
                return None
        median = self._median.get(priority)
        if median is None:
            median = self._median[priority] = float(statistics.median(wait for _, wait in samples))
        return median

    def unreachable(
        self, priority: str, deadline_at_ms: float | None, now_ms: float, ahead_ms: float
    ) -> Unreachable | None:
        """Whether an item with this deadline, taken for embedding now (``ahead_ms``: the embedding
        call it joins), would wait past its deadline: the numbers (:class:`Unreachable`), else None
        (no deadline, no recent wait of its class, or time enough)."""
        if deadline_at_ms is None:
            return None
        expected = self.expected_ms(priority, now_ms)
        if expected is None:
            return None
        left = deadline_at_ms - now_ms
        if left >= expected + ahead_ms:
            return None
        return Unreachable(left_ms=left, wait_ms=expected, ahead_ms=ahead_ms)
