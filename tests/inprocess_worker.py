"""Run a surge worker inside the test's own event loop, so a failing agent shows its own traceback.

The worker is the one ``surge worker`` runs (``pipeline/cli.py``): the app of
:func:`agents.worker.build_worker_app` under :class:`agents.lifecycle.SurgeWorker`, which also makes
Faust's read offsets blind for the Acker's source topics. Two things differ, both about sharing a
process with pytest: the worker neither takes over the process's signals nor reconfigures its
logging.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from collections.abc import AsyncIterator, Iterable
from typing import Any

import faust

from agents.lifecycle import SurgeWorker
from agents.runtime import Runtime
from agents.worker import build_worker_app
from pipeline.admin import ensure_topics
from pipeline.settings import Settings

#: how long a worker may take to become ready (join the group, recover its tables, seek its sources)
READY_TIMEOUT_S = 60.0
#: how long the tasks of a stopped worker may take to end on their own
SETTLE_S = 5.0


class InProcessWorker(SurgeWorker):
    """:class:`SurgeWorker` without signal handlers: SIGINT and SIGTERM stay pytest's."""

    def install_signal_handlers(self) -> None:
        return None


@contextlib.asynccontextmanager
async def running_worker(
    settings: Settings, extra_topics: Iterable[str] = ()
) -> AsyncIterator[tuple[faust.App, Runtime]]:
    """Create the topics (and ``extra_topics``), start a worker of ``settings`` in this loop, and
    yield its app and runtime once it serves.

    On exit the worker is stopped, every task it started must have ended, and its data folder is
    removed; a worker that leaves a task running fails the test that started it. Start any client
    inside the block and stop it before the block ends: its tasks would count as left over.
    """
    await ensure_topics(settings, extra=extra_topics)
    before = asyncio.all_tasks()
    app, rt = build_worker_app(settings)
    worker = InProcessWorker(
        app,
        rt.lifecycle,
        loglevel="WARNING",
        quiet=True,
        redirect_stdouts=False,
        override_logging=False,
        daemon=False,
    )
    worker.spinner = None  # as `surge worker` does (pipeline/cli.py)
    try:
        await worker.start()
        # ready means tables recovered and every source partition sought to where reading starts
        await asyncio.wait_for(rt.lifecycle.ready.wait(), READY_TIMEOUT_S)
        yield app, rt
    finally:
        await worker.stop()
        left = await _settled(before)
        shutil.rmtree(settings.data_dir)
    assert not left, f"the stopped worker left tasks running: {sorted(_name(t) for t in left)}"


async def _settled(before: set[asyncio.Task[Any]]) -> set[asyncio.Task[Any]]:
    """The tasks started since ``before`` that are still running after at most ``SETTLE_S``."""
    loop = asyncio.get_running_loop()
    end = loop.time() + SETTLE_S
    me = asyncio.current_task()
    while True:
        left = {t for t in asyncio.all_tasks() - before if t is not me and not t.done()}
        if not left or loop.time() >= end:
            return left
        await asyncio.sleep(0.05)


def _name(task: asyncio.Task[Any]) -> str:
    coro = task.get_coro()
    return str(getattr(coro, "__qualname__", None) or task.get_name())
