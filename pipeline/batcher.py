"""The scheduler on an asyncio event loop: wait for a batch, wait for room to read more.

Modelled on Ray Serve's ``batching.py``: the window's deadline starts at the first item (the
scheduler's ``flush_at_ms`` counts from the oldest item's ``enqueued_at_ms``), and the waiting side
sleeps on an ``asyncio.Event`` set by ``put`` with a timeout of exactly the time left until the
flush, so it wakes for a new item or for the window's end and never polls.

No Prometheus here: counters are plain attributes, and an optional :class:`BatchObserver` is told
of every enqueue, flush, expiry and demotion, so the agent can feed its metrics from it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

from pipeline.scheduler import PoppedBatch, QueuedItem, Scheduler
from pipeline.terms import Priority


class BatchObserver:
    """Hooks for metrics; every method is a no-op here, override the ones you need.

    Called synchronously on the event loop, so they must be quick and must not raise.
    """

    def on_depth(self, depths: Mapping[Priority, int]) -> None:
        """Items waiting per class, after every put and every flush."""

    def on_flush(self, size: int, limit: int, waits_ms: Sequence[float]) -> None:
        """A batch of ``size`` items left the queue; ``limit`` was the batch limit at the time and
        ``waits_ms`` is each item's time in the queue (flush time minus ``enqueued_at_ms``)."""

    def on_expired(self, item: QueuedItem, late_ms: float) -> None:
        """An item left the queue ``late_ms`` after its deadline, unserved (reply deadline_exceeded)."""

    def on_demoted(self, item: QueuedItem) -> None:
        """An item was moved to a lower class (``item.priority`` is the new class)."""


class AsyncBatcher:
    """Wraps a :class:`Scheduler` for one event loop: producers ``put``, one consumer awaits
    ``next_batch``, and a reader that admits by the queue alone awaits ``wait_admit``.

    Counters (plain attributes, cumulative since construction): ``batches``, ``items_flushed``,
    ``expired``, ``demoted``, ``wait_ms_total``, ``wait_ms_max``, ``fill_ratio_total`` (sum of
    size/limit per batch; ``mean_fill_ratio`` divides it), and ``last_fill_ratio``.
    """

    def __init__(self, scheduler: Scheduler, observer: BatchObserver | None = None) -> None:
        self.scheduler = scheduler
        self.observer = observer or BatchObserver()
        self._arrived = asyncio.Event()
        self._left = asyncio.Event()
        self.batches = 0
        self.items_flushed = 0
        self.expired = 0
        self.demoted = 0
        self.wait_ms_total = 0.0
        self.wait_ms_max = 0.0
        self.fill_ratio_total = 0.0
        self.last_fill_ratio = 0.0

    @property
    def depth(self) -> int:
        """Items waiting in all classes."""
        return self.scheduler.depth()

    @property
    def mean_fill_ratio(self) -> float:
        """Mean of size/limit over the batches flushed so far (0 before the first)."""
        return self.fill_ratio_total / self.batches if self.batches else 0.0

    def put(self, item: QueuedItem) -> None:
        """Queue an item and wake ``next_batch``; called when a work item arrives.

        Raises ``OverloadedError`` (from ``Scheduler.offer``) when its class is full.
        """
        self.scheduler.offer(item)
        self._arrived.set()
        self.observer.on_depth(self.scheduler.depths())

    async def next_batch(self) -> PoppedBatch:
        """Wait until the scheduler is ready, then pop and return the batch.

        Sleeps on the arrival event with a timeout of the time left until ``flush_at_ms`` (forever
        while the queue is empty), rechecking readiness at each wake-up. The returned batch may
        carry only ``expired`` items when every waiting item had passed its deadline.
        """
        sched = self.scheduler
        while True:
            now = sched.clock()
            if sched.ready(now):
                return self._pop(now)
            self._arrived.clear()
            flush_at = sched.flush_at_ms()
            timeout = None if flush_at is None else max(0.0, (flush_at - now) / 1000.0)
            try:
                await asyncio.wait_for(self._arrived.wait(), timeout)
            except TimeoutError:
                pass

    async def wait_admit(self, priority: Priority) -> None:
        """Return once the scheduler's ``can_admit(priority)`` holds, for a reader that admits by the
        queue alone (the inference agent's readers wait on their own rule, which also counts items
        still being embedded).

        Woken whenever items leave the queue (the only event that can turn it from False to True).
        """
        while not self.scheduler.can_admit(priority):
            self._left.clear()
            await self._left.wait()

    def record_batch(self, size: int, seconds: float) -> None:
        """Pass a model call's size and duration to the scheduler's estimator; called after each call."""
        self.scheduler.record_batch(size, seconds)

    def _pop(self, now: float) -> PoppedBatch:
        batch = self.scheduler.pop_batch(now)
        obs = self.observer
        for item in batch.expired:
            late = now - item.deadline_at_ms if item.deadline_at_ms is not None else 0.0
            obs.on_expired(item, late)
        for item in batch.demoted:
            obs.on_demoted(item)
        self.expired += len(batch.expired)
        self.demoted += len(batch.demoted)
        if batch.items:
            waits = [now - item.enqueued_at_ms for item in batch.items]
            ratio = len(batch.items) / batch.limit
            self.batches += 1
            self.items_flushed += len(batch.items)
            self.wait_ms_total += sum(waits)
            self.wait_ms_max = max(self.wait_ms_max, *waits)
            self.fill_ratio_total += ratio
            self.last_fill_ratio = ratio
            obs.on_flush(len(batch.items), batch.limit, waits)
        if batch.items or batch.expired:
            self._left.set()
        obs.on_depth(self.scheduler.depths())
        return batch
