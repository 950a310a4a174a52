"""A worker's life: ready only when it can serve, a bounded drain on every rebalance, and a graceful
stop on SIGTERM (docs/architecture.md, "Readiness and failover").

* Ready: models loaded and warm (before the worker even joins the group), partitions assigned, no
  rebalance under way, table recovery done. ``/readyz`` answers 200 from then on, and the line
  ``surge worker ready`` is printed once (the demo, the benchmarks and the tests wait for it).
* Rebalance: before giving up its partitions, a worker admits nothing more and lets the work it
  admitted finish for ``rebalance_grace_ms``; then it gives back what has not reached the model
  (read again by the partition's owner: no reply was sent for it) and waits only for the batches in
  the model (at most ``drain_timeout_s`` in all). It acks in offset order and commits, so the next
  owner does not read again what was answered; what it finished behind a given-back record is named
  in the commit's metadata, and the partition's next owner acks it without work. The whole group
  waits for the slowest member's
  drain, so under overload this keeps a rebalance from stalling every worker for the full timeout.
* SIGTERM: stop admitting, drain, commit, then the usual shutdown, which leaves the group: a
  rolling restart loses and repeats nothing. A static member (``SURGE_STATIC_MEMBERSHIP``) leaves
  too (:func:`pipeline.compat.leave_group_on_close_as_static_member`); a killed one is waited for
  until its session times out, and one back before then gets its partitions without a rebalance.
"""

from __future__ import annotations

import asyncio
import atexit
import gc
import logging
import os
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Iterable
from typing import Any, cast

import faust
from faust.tables import TableManager
from faust.types import TP
from mode import SignalT
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from agents.acks import stuck_after_s
from agents.runtime import Runtime
from pipeline.admin import changelog_topics
from pipeline.compat import before_flow_resume, blind_read_offsets, producer_partitions_for
from pipeline.terms import PRIORITIES

log = logging.getLogger("surge.lifecycle")

#: what a worker does with the partitions of a rebalance (see :func:`on_partitions`)
PartitionsHandler = Callable[[set[TP]], Awaitable[None]]


def on_partitions(signal: SignalT[Any], handler: PartitionsHandler) -> None:
    """Call ``handler`` with the partitions of each rebalance that ``signal`` announces:
    ``app.on_partitions_revoked`` or ``app.on_partitions_assigned``, which Faust sends as
    ``(app, partitions)`` (and mode's ``signal=`` keyword)."""

    async def receiver(sender: object, /, *args: set[TP], **_: Any) -> None:
        (partitions,) = args
        await handler(partitions)

    signal.connect(receiver)


def freeze_startup_heap() -> int:
    """Called once the models are loaded, before the worker starts: move every object alive now
    (the models, torch, the libraries: about half a million) out of the cyclic garbage collector's
    reach, for good; returns how many. They live as long as the worker, yet each full collection
    walked all of them, with the event loop stopped: about 0.35 s each, and Faust's table stores run
    one per table on every rebalance (1.5 s of a survivor's takeover, measured), besides the ones
    Python starts on its own while serving. Objects made later are collected as usual; at exit they
    are handed back, so that shutdown frees them as before.
    See docs/architecture.md, "Readiness and failover"."""
    gc.collect()
    gc.freeze()
    atexit.register(gc.unfreeze)
    global _frozen_at_startup
    # counted once: get_freeze_count walks every frozen object (about 70 ms with the event loop
    # stopped), and /status, which reports it, is polled every 0.5 s by the benchmarks
    _frozen_at_startup = gc.get_freeze_count()
    return _frozen_at_startup


#: objects :func:`freeze_startup_heap` froze (0 before it ran)
_frozen_at_startup = 0


def frozen_objects() -> int:
    """How many objects :func:`freeze_startup_heap` froze, as it counted them (``/status``)."""
    return _frozen_at_startup


class Lifecycle:
    """Readiness and the drains of one worker."""

    def __init__(self, app: faust.App, rt: Runtime, source_topics: Iterable[str] = ()) -> None:
        self.app = app
        self.rt = rt
        #: topics read by agents that commit through the Acker (see SurgeWorker.on_first_start)
        self.source_topics = tuple(source_topics)
        self.ready = asyncio.Event()
        #: set on SIGTERM: readers take on nothing new
        self.stopping = False
        #: set while a rebalance's drain runs: readers take on nothing new until it is over
        self.revoking = False
        #: the producer knows every topic surge writes (tables pick changelog partitions with the
        #: producer's partitioner, which needs a topic's metadata before its first write)
        self.writes_ready = asyncio.Event()
        #: assignments whose source partitions are still being sought to where reading starts
        #: (agents/acks.py, ``seek_to_starts``): not ready until the latest one is done
        self.seeking = 0
        #: partition assignments this worker received (one per rebalance it took part in)
        self.assignments = 0

        async def count(_: set[TP]) -> None:
            self.assignments += 1

        on_partitions(app.on_partitions_assigned, count)

    async def warm_writes(self) -> None:
        """Load the producer's metadata of every topic this worker writes; then ``writes_ready``."""
        s = self.rt.settings
        topics = self.rt.topics
        producer = self.app.producer
        await producer.maybe_start()
        names = [
            *changelog_topics(s),
            topics.replies,
            topics.deadletter,
            *(topics.work(p) for p in PRIORITIES),
        ]
        for name in names:
            await producer_partitions_for(producer, name)
        self.writes_ready.set()

    def can_serve(self) -> bool:
        """True when this worker serves traffic right now."""
        app = self.app
        inf = self.rt.inference
        if not self.writes_ready.is_set() or (inf is not None and not inf.ready.is_set()):
            return False
        try:
            assigned = bool(app.consumer.assignment())
        except Exception:  # the consumer is not started yet
            return False
        return (
            assigned
            and not self.seeking
            and not app.rebalancing
            and not app.in_recovery
            # app.tables is typed as the TableManagerT interface, which does not declare the
            # recovery that the app's TableManager has
            and cast(TableManager, app.tables).recovery.completed.is_set()
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

    async def drain(
        self, timeout_s: float, give_back_after_s: float | None = None, revoked: set[TP] | None = None
    ) -> bool:
        """Let admitted work finish and be acked, then commit; True when nothing was left over.

        ``give_back_after_s`` (a rebalance, of the ``revoked`` partitions): after that long, work that
        has not reached the model is given back (:meth:`agents.inference.Inference.give_back`), again
        every 0.2 s for what the embedding stage hands on meanwhile, and only the batches in the model
        are waited for."""
        t0 = time.perf_counter()
        acker = self.rt.acker
        inf = self.rt.inference
        if give_back_after_s is None or inf is None or not revoked:
            ok = await acker.wait_idle(timeout_s)
        else:
            ok = await acker.wait_idle(min(give_back_after_s, timeout_s))
            given = 0
            while not ok and (left := timeout_s - (time.perf_counter() - t0)) > 0:
                given += inf.give_back(revoked)
                ok = await acker.wait_idle(min(0.2, left))
            if given:
                log.warning("rebalance: gave back %d records that had not reached the model", given)
        committed = False
        try:
            committed = await self.rt.acker.commit()
        except Exception:
            log.exception("commit after drain failed")
        log.warning(
            "drained in %.2f s: finished=%s committed=%s, %d records unacked",
            time.perf_counter() - t0,
            ok,
            committed,
            self.rt.acker.pending(),
        )
        return ok

    async def on_revoked(self, revoked: set[TP]) -> None:
        """Called by Faust on every rebalance, after it paused the partitions."""
        s = self.rt.settings
        self.revoking = True
        self.rt.intake_backlog.forget(revoked)
        if self.rt.intake is not None:  # queued, not begun: the next owner reads them
            given = self.rt.intake.give_back(set(revoked))
            if given:
                log.info("rebalance: %d queued requests of revoked partitions given back", given)
        try:
            ok = await self.drain(
                s.drain_timeout_s, give_back_after_s=s.rebalance_grace_ms / 1000, revoked=set(revoked)
            )
            self.rt.acker.revoke(revoked)
        finally:
            self.revoking = False
            if self.rt.intake is not None:  # while the revoked tables are still this worker's
                self.rt.intake.buckets_revoked(set(revoked))
            if self.rt.inference is not None:
                self.rt.inference.wake_readers()
        if not ok:
            log.warning("rebalance: in-flight work not finished in time; it will be read again")

    async def graceful_stop(self) -> None:
        """SIGTERM: stop admitting, drain, commit; Faust's shutdown then leaves the group (a static
        member too)."""
        self.stopping = True
        await self.drain(self.rt.settings.drain_timeout_s)
        if self.rt.intake is not None:  # the rate-limit buckets' unflushed states, before leaving
            self.rt.intake.flush_buckets(due_only=False)

    async def hold_if_stopping(self) -> None:
        """Called by every reader before it takes on a record: once the worker is stopping, the
        record is left untouched (not worked on, not acked) for the next owner, and the reader
        waits for the shutdown to cancel it."""
        if self.stopping:
            await asyncio.Future()


def commit_in_order(
    life: Lifecycle,
    *,
    on_revoked: PartitionsHandler | None = None,
    on_commit_timer: Callable[[], None] | None = None,
) -> None:
    """Wire the Acker (agents/acks.py) into the rebalances and timers of a worker whose agents read
    ``life.source_topics`` with it; the same for every role (docs/architecture.md, "Guarantees").

    * revoked: :meth:`Lifecycle.on_revoked` (drain, commit, drop the revoked ledgers), then
      ``on_revoked`` (what the role forgets of work begun before the rebalance);
    * assigned: each source partition is sought to its committed offset, else the log start;
    * flow resumed: Faust empties the stream buffers, so reading goes on from the first offset not
      taken on;
    * every ``commit_interval_ms``: commit what was released, look for holes, report stuck sends,
      then ``on_commit_timer()``.
    """
    app, rt = life.app, life.rt
    settings = rt.settings

    async def revoked(tps: set[TP]) -> None:
        await life.on_revoked(tps)
        if on_revoked is not None:
            await on_revoked(tps)

    async def seek_sources(assigned: set[TP]) -> None:
        rt.acker.keep_only(assigned)
        life.seeking += 1
        try:
            await rt.acker.seek_to_starts([tp for tp in assigned if tp.topic in life.source_topics])
        finally:
            life.seeking -= 1

    on_partitions(app.on_partitions_revoked, revoked)
    on_partitions(app.on_partitions_assigned, seek_sources)

    def before_buffers_cleared() -> None:
        try:
            assigned = [tp for tp in app.consumer.assignment() if tp.topic in life.source_topics]
        except Exception:  # no consumer yet (the first resume comes before any assignment)
            return
        rt.acker.reseek_soon(rt.acker.resume_points(assigned))

    before_flow_resume(app, before_buffers_cleared)

    @app.timer(interval=settings.commit_interval_ms / 1000)
    async def commit_released() -> None:
        await rt.acker.commit()
        await rt.acker.check_holes(time.monotonic())
        rt.acker.report_stuck_sends(time.monotonic(), stuck_after_s(settings.producer_request_timeout_ms))
        if on_commit_timer is not None:
            on_commit_timer()


def serve_pages(
    life: Lifecycle,
    *,
    ready: Callable[[], bool],
    describe: Callable[[], dict[str, object]],
    before_scrape: Callable[[], None] | None = None,
) -> None:
    """The pages a worker is watched by, the same for every role (docs/architecture.md, "Security"):
    ``/readyz`` (200 once ``ready()``, and whether it serves right now; see "Readiness and failover"),
    ``/metrics`` (after ``before_scrape()``), ``/status`` (role, partitions assigned, objects out of the
    garbage collector's reach (:func:`freeze_startup_heap`), then ``describe()``) and ``/healthz``."""
    app, settings, metrics = life.app, life.rt.settings, life.rt.metrics
    content_type = CONTENT_TYPE_LATEST.split(";")[0]

    @app.page("/readyz")
    async def readyz(view: faust.web.View, request: faust.web.Request) -> faust.web.Response:
        is_ready = ready()
        return view.json({"ready": is_ready, "serving": life.can_serve()}, status=200 if is_ready else 503)

    @app.page("/metrics")
    async def metrics_page(view: faust.web.View, request: faust.web.Request) -> faust.web.Response:
        if before_scrape is not None:
            before_scrape()
        return view.bytes(generate_latest(metrics.registry), content_type=content_type)

    @app.page("/status")
    async def status(view: faust.web.View, request: faust.web.Request) -> faust.web.Response:
        body: dict[str, object] = {
            "role": settings.role,
            "assigned": len(app.consumer.assignment()),
            "assignments": life.assignments,
            "gc_frozen_objects": frozen_objects(),
            # allocations between young collections, then young collections per older one
            # (SURGE_GC_YOUNG_THRESHOLD_OBJECTS)
            "gc_thresholds": list(gc.get_threshold()),
            # "uvloop" or "asyncio" (SURGE_EVENT_LOOP)
            "event_loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
        }
        body.update(describe())
        return view.json(body)

    @app.page("/healthz")
    async def healthz(view: faust.web.View, request: faust.web.Request) -> faust.web.Response:
        return view.json(
            {"ok": True, "worker": settings.worker_id or f"{socket.gethostname()}:{os.getpid()}"}
        )


class SurgeWorker(faust.Worker):
    """A Faust worker whose SIGTERM drains and leaves the group before the usual shutdown."""

    def __init__(self, app: faust.App, lifecycle: Lifecycle, **kwargs: Any) -> None:
        super().__init__(app, **kwargs)
        self.lifecycle = lifecycle
        self._draining: asyncio.Task[None] | None = None

    async def on_first_start(self) -> None:
        """Before the consumer starts: Faust's read offsets go blind for the Acker's source topics
        (:func:`pipeline.compat.blind_read_offsets` says why; docs/architecture.md, "Guarantees")."""
        await super().on_first_start()
        if self.lifecycle.source_topics:
            blind_read_offsets(self.app.consumer, self.lifecycle.source_topics)

    async def on_stop(self) -> None:
        await super().on_stop()
        oracle = self.lifecycle.rt.acker.oracle
        if oracle is not None:
            await oracle.close()

    def _on_sigterm(self) -> None:
        log.warning("SIGTERM: no new work; draining, committing, then stopping")
        if self._draining is None:
            self._draining = asyncio.ensure_future(self._drain_then_stop(), loop=self.loop)

    async def _drain_then_stop(self) -> None:
        try:
            await self.lifecycle.graceful_stop()
        except Exception:
            log.exception("graceful stop failed; stopping anyway")
        log.warning("graceful stop done; shutting down")
        self._schedule_shutdown(signal.SIGTERM)
