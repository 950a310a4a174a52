"""The asyncio wrapper: wakes on put and at the window's end, gates reads, reports to an observer.

The clock is the event loop's own (in epoch-like ms), so the scheduler's idea of time and the
loop's timers agree; the waits are tens of milliseconds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence

import pytest

from pipeline.batcher import AsyncBatcher, BatchObserver
from pipeline.exceptions import OverloadedError
from pipeline.scheduler import Priority, QueuedItem, Scheduler, SchedulerConfig


def loop_ms() -> float:
    return asyncio.get_running_loop().time() * 1000.0


def batcher(observer: BatchObserver | None = None, **cfg: object) -> AsyncBatcher:
    return AsyncBatcher(Scheduler(SchedulerConfig(**cfg), clock=loop_ms), observer)  # type: ignore[arg-type]


def put(b: AsyncBatcher, item_id: str, priority: str = "interactive", deadline_ms: int | None = None) -> None:
    b.put(
        b.scheduler.make_item(
            item_id=item_id, user_id="u" + item_id, priority=priority, deadline_ms=deadline_ms
        )
    )


class Recorder(BatchObserver):
    def __init__(self) -> None:
        self.flushes: list[tuple[int, int, list[float]]] = []
        self.expired: list[tuple[str, float]] = []
        self.depths: list[dict[Priority, int]] = []

    def on_flush(self, size: int, limit: int, waits_ms: Sequence[float]) -> None:
        self.flushes.append((size, limit, list(waits_ms)))

    def on_expired(self, item: QueuedItem, late_ms: float) -> None:
        self.expired.append((item.item_id, late_ms))

    def on_depth(self, depths: Mapping[Priority, int]) -> None:
        self.depths.append(dict(depths))


@pytest.mark.asyncio
async def test_next_batch_wakes_on_put_when_the_batch_fills() -> None:
    b = batcher(base_batch_size=1, max_batch_size=1, max_wait_ms=60_000)
    task = asyncio.create_task(b.next_batch())
    await asyncio.sleep(0.02)
    assert not task.done()  # nothing queued: it waits, without a timeout
    t0 = loop_ms()
    put(b, "a")
    batch = await asyncio.wait_for(task, 1.0)
    assert [i.item_id for i in batch.items] == ["a"]
    assert loop_ms() - t0 < 100  # woken by the put, not by max_wait


@pytest.mark.asyncio
async def test_next_batch_flushes_a_partial_batch_after_max_wait() -> None:
    b = batcher(max_wait_ms=40)
    t0 = loop_ms()
    put(b, "a")
    put(b, "b")  # depth 2 -> limit 9, depth 3 -> limit 12: the window has to time out
    task = asyncio.create_task(b.next_batch())
    await asyncio.sleep(0.01)
    put(b, "c")  # a put during the window does not restart it
    batch = await asyncio.wait_for(task, 2.0)
    elapsed = loop_ms() - t0
    assert [i.item_id for i in batch.items] == ["a", "b", "c"]
    assert 40 <= elapsed < 400
    assert batch.limit == 12 and b.last_fill_ratio == pytest.approx(3 / 12)


@pytest.mark.asyncio
async def test_next_batch_flushes_before_max_wait_for_a_tight_deadline() -> None:
    b = batcher(max_wait_ms=5_000, safety_margin_ms=5)
    b.scheduler.estimator.observe(1, 0.020)
    t0 = loop_ms()
    put(b, "rt", priority="realtime", deadline_ms=100)
    batch = await asyncio.wait_for(b.next_batch(), 2.0)
    elapsed = loop_ms() - t0
    assert [i.item_id for i in batch.items] == ["rt"]
    assert 40 <= elapsed < 100  # before the deadline, well before max_wait


@pytest.mark.asyncio
async def test_wait_admit_blocks_a_lower_class_until_the_higher_one_is_served() -> None:
    b = batcher(base_batch_size=1, max_batch_size=1, max_wait_ms=0)
    put(b, "rt", priority="realtime")
    waiter = asyncio.create_task(b.wait_admit(Priority.BATCH))
    await asyncio.sleep(0.02)
    assert not waiter.done()
    await asyncio.wait_for(b.wait_admit(Priority.REALTIME), 0.5)  # its own class is not blocked
    batch = await b.next_batch()
    assert [i.item_id for i in batch.items] == ["rt"]
    await asyncio.wait_for(waiter, 0.5)


@pytest.mark.asyncio
async def test_put_into_a_full_class_raises_overloaded() -> None:
    b = batcher(queue_limit={Priority.REALTIME: 1})
    put(b, "a", priority="realtime")
    with pytest.raises(OverloadedError) as err:
        put(b, "b", priority="realtime")
    assert (err.value.depth, err.value.limit) == (1, 1)
    assert not b.scheduler.can_admit(Priority.REALTIME)


@pytest.mark.asyncio
async def test_observer_and_counters_see_flushes_waits_depths_and_expiries() -> None:
    rec = Recorder()
    b = batcher(rec, max_wait_ms=20)
    put(b, "late", priority="realtime", deadline_ms=1)
    put(b, "ok", priority="interactive")
    assert rec.depths[-1][Priority.REALTIME] == 1 and rec.depths[-1][Priority.INTERACTIVE] == 1
    await asyncio.sleep(0.03)
    batch = await asyncio.wait_for(b.next_batch(), 1.0)
    assert [i.item_id for i in batch.expired] == ["late"]
    assert [i.item_id for i in batch.items] == ["ok"]
    assert rec.expired[0][0] == "late" and rec.expired[0][1] > 0
    ((size, limit, waits),) = rec.flushes
    assert (size, limit) == (1, 6) and waits[0] >= 20
    assert b.batches == 1 and b.items_flushed == 1 and b.expired == 1
    assert b.wait_ms_max == waits[0] and b.mean_fill_ratio == pytest.approx(1 / 6)
    assert rec.depths[-1] == {p: 0 for p in Priority} and b.depth == 0


def test_batcher_runs_under_plain_asyncio_run_too() -> None:
    async def main() -> list[str]:
        b = batcher(max_wait_ms=5)
        put(b, "x")
        return [i.item_id for i in (await b.next_batch()).items]

    assert asyncio.run(main()) == ["x"]
