"""Run a coroutine's first step at once, and finish it as a task only if it has to wait.

Faust hands each fetched record to its streams through ``Service.wait_first(callback(record),
suspend_flow.wait())``: four tasks and an ``asyncio.wait`` per record, so that a delivery blocked by
flow control (a rebalance) can be abandoned. A delivery almost never blocks (the record goes into the
stream's buffer with ``put_nowait``), and the four tasks per record cost the worker a loop turn and
about a tenth of a millisecond each (docs/architecture.md, "Delivering records"). :func:`step`
runs the first step inline; a coroutine that finished there costs nothing more, and one that had to
wait is handed back as an awaitable that finishes it exactly where it stopped (:func:`resume`), for
the usual ``wait_first`` with its cancellation. No Faust here; pipeline/compat.py installs it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any


class Finished:
    """The first step ran the coroutine to its end: its ``value``."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


def step(coro: Coroutine[Any, Any, Any]) -> Finished | Coroutine[Any, Any, Any]:
    """Run ``coro`` up to its first wait. Returns :class:`Finished` when it ended there (its exception,
    if it raised, propagates), else a coroutine that finishes it (:func:`resume`)."""
    try:
        yielded = coro.send(None)
    except StopIteration as stop:
        return Finished(stop.value)
    return resume(coro, yielded)


async def resume(coro: Coroutine[Any, Any, Any], yielded: Any) -> Any:
    """Finish ``coro``, which stopped at its first wait yielding ``yielded`` (the future it waits for,
    or None for a bare yield such as ``asyncio.sleep(0)``): wait for that future here, then go on
    stepping ``coro``. A cancellation of this coroutine cancels that future and is thrown into
    ``coro`` where it waits, as a task would do."""
    while True:
        error: BaseException | None = None
        try:
            if yielded is None:
                await asyncio.sleep(0)
            else:
                # the coroutine's ``await`` marked the future as being waited for, which is the mark
                # a task clears when it takes the future over; we take it over here
                yielded._asyncio_future_blocking = False
                await yielded
        except BaseException as exc:  # thrown into coro, which decides
            error = exc
        try:
            yielded = coro.send(None) if error is None else coro.throw(error)
        except StopIteration as stop:
            return stop.value
