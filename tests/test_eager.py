"""pipeline/eager.py: a coroutine's first step inline, the rest (if any) finished exactly as a task
would have finished it: values, exceptions, bare yields and cancellation."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.eager import Finished, resume, step


async def test_a_coroutine_that_never_waits_finishes_in_its_first_step_in_the_callers_task() -> None:
    ran_in: list[asyncio.Task[object] | None] = []

    async def deliver() -> str:
        ran_in.append(asyncio.current_task())
        return "put"

    first = step(deliver())
    assert isinstance(first, Finished) and first.value == "put"
    assert ran_in == [asyncio.current_task()]


async def test_a_coroutine_that_waits_is_finished_where_it_stopped() -> None:
    gate: asyncio.Future[int] = asyncio.get_running_loop().create_future()
    trail: list[str] = []

    async def deliver() -> int:
        trail.append("before")
        got = await gate
        trail.append(f"after {got}")
        await asyncio.sleep(0)  # a bare yield
        trail.append("end")
        return got * 2

    rest = step(deliver())
    assert not isinstance(rest, Finished) and trail == ["before"]
    task = asyncio.ensure_future(rest)
    await asyncio.sleep(0.01)
    assert trail == ["before"] and not task.done()
    gate.set_result(21)
    assert await task == 42
    assert trail == ["before", "after 21", "end"]


async def test_exceptions_reach_the_coroutine_and_the_caller_as_in_a_task() -> None:
    async def fails_at_once() -> None:
        raise KeyError("first step")

    with pytest.raises(KeyError, match="first step"):
        step(fails_at_once())

    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def handles_its_error() -> str:
        try:
            await gate
        except ValueError as exc:
            return f"handled {exc}"
        return "no error"

    rest = step(handles_its_error())
    assert not isinstance(rest, Finished)
    gate.set_exception(ValueError("late"))
    assert await rest == "handled late"

    async def fails_after_a_wait() -> None:
        await asyncio.sleep(0)
        raise RuntimeError("second step")

    rest2 = step(fails_after_a_wait())
    assert not isinstance(rest2, Finished)
    with pytest.raises(RuntimeError, match="second step"):
        await rest2


async def test_cancelling_the_rest_cancels_what_it_waits_for_and_runs_its_cleanup() -> None:
    gate: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    trail: list[str] = []

    async def blocked() -> None:
        try:
            await gate
        except asyncio.CancelledError:
            trail.append("cancelled inside")
            raise
        finally:
            trail.append("cleanup")

    rest = step(blocked())
    assert not isinstance(rest, Finished)
    task = asyncio.ensure_future(rest)
    await asyncio.sleep(0)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert gate.cancelled()
    assert trail == ["cancelled inside", "cleanup"]


async def test_a_wait_with_a_timeout_inside_the_first_step_times_out_and_completes() -> None:
    """Faust's delivery may wait for its producer's buffer to ebb (``asyncio.wait_for(..., 0.1)``);
    the future that first step awaits carries asyncio's "being waited for" mark, which a task would
    clear (without clearing it, awaiting it again raised "await wasn't used with future": a worker's
    record delivery crashed in the first surge run of this code)."""
    flag = asyncio.Event()

    async def deliver() -> str:
        try:
            await asyncio.wait_for(flag.wait(), timeout=0.02)
        except TimeoutError:
            return "timed out"
        return "set"

    rest = step(deliver())
    assert not isinstance(rest, Finished)
    assert await asyncio.ensure_future(rest) == "timed out"
    rest = step(deliver())
    assert not isinstance(rest, Finished)
    task = asyncio.ensure_future(rest)
    await asyncio.sleep(0.005)
    flag.set()
    assert await task == "set"


async def test_resume_accepts_a_bare_yield_first() -> None:
    async def yields_first() -> str:
        await asyncio.sleep(0)
        return "done"

    coro = yields_first()
    yielded = coro.send(None)
    assert yielded is None
    assert await resume(coro, yielded) == "done"
