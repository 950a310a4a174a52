"""A worker's life: ready only when it can serve, a bounded drain on every rebalance, and a graceful
stop on SIGTERM (docs/architecture.md, "Readiness and failover").

* Ready: models loaded and warm (before the worker even joins the group), partitions assigned, no
  rebalance under way, table recovery done. ``/readyz`` answers 200 from then on, and the line
  ``surge worker ready`` is printed once (the demo, the benchmarks and the tests wait for it).
* Rebalance: before giving up its partitions, a worker lets the work it admitted finish (at most
  ``drain_timeout_s``), acks it in offset order and commits, so the next owner does not read again
  what was answered. What is still unfinished then is read again and answered from the reply book.
* SIGTERM: stop admitting, drain, commit, leave the group, then stop: a rolling restart loses and
  repeats nothing.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any

import faust
from faust.types import TP

from agents.runtime import Runtime
from pipeline.compat import leave_group

log = logging.getLogger("surge.lifecycle")


class Lifecycle:
    """Readiness and the drains of one worker."""

    def __init__(self, app: faust.App, rt: Runtime) -> None:
        self.app = app
        self.rt = rt
        self.ready = asyncio.Event()

    def can_serve(self) -> bool:
        """True when this worker serves traffic right now."""
        app = self.app
        inf = self.rt.inference
        if inf is not None and not inf.ready.is_set():
            return False
        try:
            assigned = bool(app.consumer.assignment())
        except Exception:  # the consumer is not started yet
            return False
        return (
            assigned
            and not app.rebalancing
            and not app.in_recovery
            and app.tables.recovery.completed.is_set()
        )

    async def watch_ready(self) -> None:
        """Wait until the worker can serve, then announce it (once)."""
        while not self.can_serve():  # noqa: ASYNC110 - Faust has no event for "stable and recovered"
            await asyncio.sleep(0.1)
        self.ready.set()
        print(
            f"surge worker ready: role {self.rt.settings.role}, "
            f"{len(self.app.consumer.assignment())} partitions assigned",
            flush=True,
        )

    async def drain(self, timeout_s: float) -> bool:
        """Let admitted work finish and be acked, then commit; True when nothing was left over."""
        ok = await self.rt.acker.wait_idle(timeout_s)
        try:
            await self.app.consumer.commit()
        except Exception:
            log.exception("commit after drain failed")
        return ok

    async def on_revoked(self, revoked: set[TP]) -> None:
        """Called by Faust on every rebalance, after it paused the partitions."""
        s = self.rt.settings
        ok = await self.drain(min(s.drain_timeout_s, s.session_timeout_s / 2))
        self.rt.acker.revoke(revoked)
        if not ok:
            log.warning("rebalance: in-flight work not finished in time; it will be read again")

    async def graceful_stop(self) -> None:
        """SIGTERM: stop admitting, drain, commit, leave the group."""
        s = self.rt.settings
        inf = self.rt.inference
        if inf is not None:
            inf.stopping = True
        ok = await self.drain(s.drain_timeout_s)
        log.info("graceful stop: drained=%s, %d records unacked", ok, self.rt.acker.pending())
        await leave_group(self.app)


class SurgeWorker(faust.Worker):
    """A Faust worker whose SIGTERM drains and leaves the group before the usual shutdown."""

    def __init__(self, app: faust.App, lifecycle: Lifecycle, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.lifecycle = lifecycle
        self._draining: asyncio.Task[None] | None = None

    def _on_sigterm(self) -> None:
        if self._draining is None:
            self._draining = asyncio.ensure_future(self._drain_then_stop(), loop=self.loop)

    async def _drain_then_stop(self) -> None:
        try:
            await self.lifecycle.graceful_stop()
        except Exception:
            log.exception("graceful stop failed; stopping anyway")
        self._schedule_shutdown(signal.SIGTERM)
