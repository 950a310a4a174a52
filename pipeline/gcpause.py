"""How long each garbage collection stops the process: a ``gc.callbacks`` hook (pure logic).

A full collection walks every tracked object with the event loop stopped; in a worker with torch
and the models loaded that was about 0.3 s, every few seconds under load, until the worker froze
its start-up heap (docs/architecture.md, "Readiness and failover"). :class:`GcPauseTimer` times each
collection and hands ``(generation, seconds)`` to ``observe``; the worker observes them into
``surge_gc_pause_seconds`` (docs/architecture.md, "Metrics").

``observe`` runs inside the collector, in whichever thread triggered it: it must not take a lock that
code allocating objects may hold. Prometheus children made before the hook is installed qualify
(their locks guard float arithmetic only); ``labels()`` does not.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable
from typing import Any

#: generations CPython collects
GENERATIONS = (0, 1, 2)


class GcPauseTimer:
    """A ``gc.callbacks`` entry: times each collection from its "start" to its "stop" call."""

    def __init__(
        self, observe: Callable[[int, float], None], clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.observe = observe
        self.clock = clock
        self._started: float | None = None

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        """Called by the collector with phase "start", then "stop" (no collection nests)."""
        if phase == "start":
            self._started = self.clock()
            return
        if phase == "stop" and self._started is not None:
            seconds, self._started = self.clock() - self._started, None
            self.observe(int(info["generation"]), seconds)

    def install(self) -> GcPauseTimer:
        """Start timing every collection of this process (once per process: the worker's start)."""
        if self not in gc.callbacks:
            gc.callbacks.append(self)
        return self

    def remove(self) -> None:
        """Stop timing."""
        if self in gc.callbacks:
            gc.callbacks.remove(self)
