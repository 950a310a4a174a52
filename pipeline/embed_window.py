"""The embedding stage's batch window: when a lone arrival waits a little for company.

MiniLM on a CPU costs about 6 ms for one short question embedded alone and under 3 ms each in
batches of eight (measured on the project's 2-core machine); in a worker under load the gap is wider,
10 ms a question alone against about 6 ms in batches of two or three, because each lone call
finds the weights cold. A stage that embeds every arrival the moment it comes, as long as it is
idle, runs one question per call at moderate load (at 60 requests/s 1,343 calls for 1,800
questions) and so spends the most CPU per request just where CPU runs short. The window holds the
idle stage a few milliseconds after an arrival when the recent arrival rate says more will come
within it, so calls carry several questions (docs/architecture.md, "The embedding window").

It never holds a real-time arrival (one closes the window at once), never holds a full batch, and
stays shut while arrivals are rare (the demo's 20 requests/s: a question waits for no one) or the
stage is busy (items that arrived during the last call are taken at once). Pure logic: the agent
asks :meth:`EmbedWindow.left_ms` and sleeps on its arrival event with that timeout.
"""

from __future__ import annotations

import math


class ArrivalRate:
    """An exponentially decayed count of arrivals: about the arrival rate per second over the last
    ``tau_ms``, for bursts (a Kafka fetch hands many records at once) as for steady streams."""

    def __init__(self, tau_ms: float = 1000.0) -> None:
        if tau_ms <= 0:
            raise ValueError(f"tau_ms must be > 0, got {tau_ms}")
        self.tau_ms = tau_ms
        self._level = 0.0
        self._at_ms: float | None = None

    def _decayed(self, now_ms: float) -> float:
        if self._at_ms is None:
            return 0.0
        return self._level * math.exp(-max(0.0, now_ms - self._at_ms) / self.tau_ms)

    def add(self, now_ms: float, n: int = 1) -> None:
        """Count ``n`` arrivals at ``now_ms``."""
        self._level = self._decayed(now_ms) + n
        self._at_ms = now_ms

    def per_s(self, now_ms: float) -> float:
        """Arrivals per second, as of ``now_ms``."""
        return self._decayed(now_ms) * 1000.0 / self.tau_ms


class EmbedWindow:
    """When the embedding loop may wait for more arrivals before it takes a batch.

    Called on the event loop: :meth:`arrived` for every item admitted to the arrivals;
    :meth:`open` when the stage, idle, wakes for an arrival; :meth:`left_ms` then, and again after
    each further arrival, until it says 0 and the batch is taken.
    """

    def __init__(self, max_wait_ms: float, tau_ms: float = 1000.0) -> None:
        if max_wait_ms < 0:
            raise ValueError(f"max_wait_ms must be >= 0, got {max_wait_ms}")
        self.max_wait_ms = max_wait_ms
        self.rate = ArrivalRate(tau_ms)
        self._opened_at_ms: float | None = None

    def arrived(self, now_ms: float, n: int = 1) -> None:
        """``n`` items were admitted to the arrivals at ``now_ms``."""
        self.rate.add(now_ms, n)

    def company_expected(self, now_ms: float) -> bool:
        """Whether another arrival is expected within the window: the mean gap between arrivals,
        at the recent rate, is no longer than ``max_wait_ms``."""
        per_s = self.rate.per_s(now_ms)
        return self.max_wait_ms > 0 and per_s * self.max_wait_ms >= 1000.0

    def open(self, now_ms: float) -> bool:
        """The idle stage woke for an arrival at ``now_ms``: whether it holds the window open (the
        deadline then counts from here, the first item's arrival)."""
        self._opened_at_ms = now_ms if self.company_expected(now_ms) else None
        return self._opened_at_ms is not None

    def left_ms(self, now_ms: float, waiting: int, limit: int, realtime_waiting: bool) -> float:
        """Milliseconds the window stays open from ``now_ms``, with ``waiting`` items in the
        arrivals, ``limit`` a full batch; 0 closes it (for good, until the next :meth:`open`): a
        real-time item waits, the batch is full, or the time is up."""
        opened = self._opened_at_ms
        if opened is None:
            return 0.0
        left = opened + self.max_wait_ms - now_ms
        if realtime_waiting or waiting >= limit or left <= 0:
            self._opened_at_ms = None
            return 0.0
        return left
