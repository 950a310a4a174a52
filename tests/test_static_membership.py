"""Static group membership on the real broker: a worker stopped with SIGTERM hands its partitions over
at once (it leaves the group by its instance id, which aiokafka alone never does), and a worker killed
and started again within its session gets them back without a rebalance of the survivor."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import pytest

from tests.conftest import Deployment, request
from tests.test_failover_integration import ECHO, repeats

pytestmark = [pytest.mark.integration, pytest.mark.heavy]

#: long enough that waiting for a session to expire cannot pass for a handover
SESSION_S = 30.0


def _assigned(d: Deployment) -> list[int]:
    return [int(w.status()["assigned"]) for w in d.workers if w.running]  # type: ignore[call-overload]


async def _until(what: str, check: Callable[[], bool], timeout_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if check():
            return time.monotonic() - t0
        await asyncio.sleep(0.2)
    raise AssertionError(f"{what}: not within {timeout_s:.0f} s")


async def test_a_static_member_killed_comes_back_without_a_rebalance_and_stopped_hands_over_at_once(
    deployment,
) -> None:
    d: Deployment = deployment(**ECHO, static_membership="true", session_timeout_s=str(SESSION_S))
    a = d.worker(worker_id="a")
    alone = int(a.status()["assigned"])  # type: ignore[call-overload]  # sources and changelogs
    b = d.worker(worker_id="b", data_dir=str(d.tmp / "data-b"))
    c = await d.client()
    await _until("both workers assigned", lambda: len(_assigned(d)) == 2 and all(_assigned(d)), 60)
    before = int(b.status()["assignments"])  # type: ignore[call-overload]
    b_parts = int(b.status()["assigned"])  # type: ignore[call-overload]

    # 1. SIGKILL and a restart within the session: the member gets its partitions back, b never rebalances
    sent = [
        request(
            i,
            f"u{i % 7}",
            f"through the kill {i}",
            priority=("realtime", "interactive", "batch", "offline")[i % 4],
        )
        for i in range(200)
    ]
    futs = []
    for i, req in enumerate(sent):
        futs.append(await c.submit(req))
        if i == 60:
            await c.producer.flush()
            a.kill()
            d.workers.remove(a)
            t_kill = time.monotonic()
            a = d.worker(worker_id="a", wait=False)
        if i % 20 == 0:
            await asyncio.sleep(0.1)
    await c.producer.flush()
    await asyncio.to_thread(a.wait_ready, None, SESSION_S)
    back = time.monotonic() - t_kill
    assert back < SESSION_S, f"the restarted member was ready only after {back:.1f} s"
    _, pending = await asyncio.wait(futs, timeout=90)
    assert not pending, f"{len(pending)} requests unanswered"
    assert int(b.status()["assignments"]) == before, "the survivor went through a rebalance"  # type: ignore[call-overload]
    assert int(b.status()["assigned"]) == b_parts  # type: ignore[call-overload]
    assert int(a.status()["assignments"]) == 1  # type: ignore[call-overload]
    assert not repeats(c.replies)[1], "a repeat differs from the first reply"

    # 2. SIGTERM: the member leaves by its instance id, so b takes everything over long before the
    # session would have expired (aiokafka alone sends no LeaveGroup for a static member)
    t0 = time.monotonic()
    a.terminate()
    await asyncio.to_thread(a.wait_exit, 60)
    d.workers.remove(a)
    await _until("b holds every partition", lambda: _assigned(d) == [alone], SESSION_S + 15)
    took = time.monotonic() - t0
    assert took < SESSION_S / 2, f"handover took {took:.1f} s: the stopped member was waited for"
    futs = [
        await c.submit(request(i, f"u{i % 5}", f"after the stop {i}", priority="interactive"))
        for i in range(20)
    ]
    done, pending = await asyncio.wait(futs, timeout=60)
    assert not pending
    assert all(f.result().status == "ok" for f in done)
