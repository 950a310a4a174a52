"""Load generators over a :class:`SurgeClient`: closed loop (fixed concurrency) and open loop (fixed rate).

Called by the scenario modules. Latency is measured here, from just before a request is handed to
the producer to the moment its reply is read off the reply topic (the client's view, so it includes
every Kafka hop). Every run is bounded by a request count and a time limit; requests still without
a reply at the limit are counted as ``lost``, never waited for forever.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pipeline.client import SurgeClient
from pipeline.devtools.bench.common import BenchError, progress
from pipeline.records import InferenceReply

if TYPE_CHECKING:
    from tqdm import tqdm


@dataclass
class LoadResult:
    """What one load run saw: replies and latencies by request_id, and the wall time it took."""

    sent: int = 0
    replies: dict[str, InferenceReply] = field(default_factory=dict)
    latency_ms: dict[str, float] = field(default_factory=dict)
    started: float = 0.0
    finished: float = 0.0

    @property
    def lost(self) -> int:
        return self.sent - len(self.replies)

    @property
    def elapsed_s(self) -> float:
        return max(1e-9, self.finished - self.started)

    @property
    def throughput(self) -> float:
        """Replies per second over the run (first send to last reply)."""
        return len(self.replies) / self.elapsed_s

    def ok_latencies(self) -> list[float]:
        return [self.latency_ms[r] for r, rep in self.replies.items() if rep.status == "ok"]

    def counts(self) -> dict[str, int]:
        """Requests sent, answered, lost and answered with an error: how every arm's summary begins."""
        return {
            "sent": self.sent,
            "answered": len(self.replies),
            "lost": self.lost,
            "errors": sum(1 for rep in self.replies.values() if rep.status != "ok"),
        }

    def require_replies(self, arm: str, detail: str = "") -> None:
        """Raise :class:`BenchError` when arm ``arm`` answered nothing (``detail``: why, e.g. a log tail)."""
        if not self.replies:
            raise BenchError(f"arm {arm!r} answered nothing{detail}")

    def merge(self, other: LoadResult) -> None:
        """Add another segment of the same arm (interleaved runs): elapsed times add up."""
        span = self.finished - self.started
        self.sent += other.sent
        self.replies.update(other.replies)
        self.latency_ms.update(other.latency_ms)
        if self.started == 0.0:
            self.started = other.started
            span = 0.0
        self.finished = self.started + span + other.elapsed_s


def _watch(
    fut: asyncio.Future[InferenceReply], rid: str, t0: float, res: LoadResult, bar: tqdm | None
) -> None:
    def done(f: asyncio.Future[InferenceReply]) -> None:
        if f.cancelled() or f.exception() is not None:
            return
        res.latency_ms[rid] = (time.perf_counter() - t0) * 1000
        res.replies[rid] = f.result()
        res.finished = time.perf_counter()
        if bar is not None:
            bar.update(1)

    fut.add_done_callback(done)


async def closed_loop(
    client: SurgeClient,
    requests: Sequence[dict[str, Any]],
    *,
    concurrency: int,
    timeout_s: float,
    desc: str | None = None,
) -> LoadResult:
    """Send ``requests`` keeping at most ``concurrency`` without a reply; stop at ``timeout_s``.
    ``desc``: the label of a progress bar of the replies (none without)."""
    res = LoadResult()
    slots = asyncio.Semaphore(concurrency)
    pending: list[asyncio.Future[InferenceReply]] = []
    with _bar(len(requests), desc) as bar:
        res.started = res.finished = time.perf_counter()
        deadline = res.started + timeout_s
        for req in requests:
            left = deadline - time.perf_counter()
            if left <= 0:
                break
            try:
                await asyncio.wait_for(slots.acquire(), left)
            except TimeoutError:
                break
            t0 = time.perf_counter()
            fut = await client.submit(req)
            fut.add_done_callback(lambda _f: slots.release())
            _watch(fut, req["request_id"], t0, res, bar)
            pending.append(fut)
            res.sent += 1
        await _wait_all(pending, deadline)
    return res


async def open_loop(
    client: SurgeClient,
    requests: Sequence[dict[str, Any]],
    *,
    rate_per_s: float,
    timeout_s: float,
    drain_s: float = 15.0,
    desc: str | None = None,
) -> LoadResult:
    """Send ``requests`` at ``rate_per_s`` on a fixed schedule (not slowed by replies), then wait up
    to ``drain_s`` for the last replies. ``created_at`` is the scheduled send time. ``desc``: the
    label of a progress bar of the replies (none without)."""
    from pipeline.records import now_ms

    res = LoadResult()
    pending: list[asyncio.Future[InferenceReply]] = []
    with _bar(len(requests), desc) as bar:
        res.started = res.finished = time.perf_counter()
        stop_sending = res.started + timeout_s
        for i, req in enumerate(requests):
            due = res.started + i / rate_per_s
            if due > stop_sending:
                break
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            t0 = time.perf_counter()
            fut = await client.submit({**req, "created_at": now_ms()})
            _watch(fut, req["request_id"], t0, res, bar)
            pending.append(fut)
            res.sent += 1
        await client.producer.flush()
        await _wait_all(pending, time.perf_counter() + drain_s)
    return res


def _bar(total: int, desc: str | None) -> contextlib.AbstractContextManager[tqdm | None]:
    """A progress bar (:func:`pipeline.devtools.bench.common.progress`) labelled ``desc``; None without."""
    return progress(total, desc) if desc is not None else contextlib.nullcontext()


async def _wait_all(futs: list[asyncio.Future[InferenceReply]], deadline: float) -> None:
    left = deadline - time.perf_counter()
    if futs and left > 0:
        await asyncio.wait(futs, timeout=left)
    for f in futs:
        if not f.done():
            f.cancel()
