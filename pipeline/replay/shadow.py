"""``surge shadow`` (also ``surge replay --shadow PERCENT``): mirror a share of live traffic to a
candidate model whose outputs go only to a shadow topic, with a rolling comparison
(docs/architecture.md, "Replay").

* A sampler reads the live requests topic with its own consumer group (``<app>-shadow-<id>-sampler``; the
  live group and its offsets are never touched), keeps the requests whose id hashes into the share
  (:func:`pipeline.replay.plan.sampled`), rewrites their ``reply_to`` to the shadow's replies topic and
  copies them, throttled, into ``<prefix>shadow.<id>.requests``. It commits a record only once its
  copy is acknowledged, so a shadow restarted with the same id resumes where the copies stopped.
* A candidate worker runs under the shadow's app id and prefix with the replay defaults, the model and
  the ``--set`` settings; its reply policy allows only its own replies topic, so nothing it writes
  reaches a client.
* The live replies of sampled requests (read without a group from the live reply topics, from the
  time the sampler resumes at: :func:`pipeline.replay.plan.live_replies_from`) and the shadow's replies
  are joined on ``(user_id, request_id)``; every ``SURGE_SHADOW_REPORT_INTERVAL_S`` the comparison of
  the last ``window`` sampled requests is written to ``shadow.json`` (replaced atomically), and a PNG
  at the end.
* The sampler, the live-reply reader and the report loop are watched: one that ends stops the shadow
  with a :class:`~pipeline.replay.plan.ShadowTaskError` (its final report still written).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import signal
import time
from collections import OrderedDict
from collections.abc import Awaitable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, ConsumerRecord, TopicPartition
from aiokafka.errors import CommitFailedError

from pipeline.admin import ensure_topics
from pipeline.auth import request_signers
from pipeline.client import partitions_of
from pipeline.compat import READ_COMMITTED, track_sent_topics
from pipeline.devtools.deployment import load_settings
from pipeline.devtools.procs import WorkerProcess
from pipeline.kafka_security import client_options
from pipeline.records import now_ms, salvage_ids
from pipeline.replay import compare, plan
from pipeline.replay.plan import (
    ReplayError,
    ReplayNames,
    ShadowPercentError,
    ShadowTaskError,
    ShadowWindowError,
    Throttle,
)
from pipeline.replay.runner import (
    CandidateOptions,
    Collector,
    clear_state,
    delete_own_topics,
    groupless_consumer,
    request_key,
    start_worker,
)
from pipeline.replyto import ReplyToPolicy
from pipeline.settings import Settings
from pipeline.topics import TopicNames

log = logging.getLogger("surge.shadow")

#: how long the sampler and the live-reply reader may take to start
READY_TIMEOUT_S = 60.0
#: how long a stopping sampler may take to finish its batch (wait for its copies, commit them)
SAMPLER_STOP_S = 10.0
#: how long the first unread request of a partition may take to fetch (for its timestamp)
PEEK_TIMEOUT_S = 10.0


@dataclass
class ShadowOptions(CandidateOptions):
    """What ``surge shadow`` was asked to do."""

    #: the share of live requests mirrored, in percent
    percent: float
    shadow_id: str | None = None
    #: stop after this many seconds (None: until SIGINT/SIGTERM)
    duration_s: float | None = None
    delete_topics: bool = False
    #: the comparison covers the last this many sampled requests
    window: int = 10_000


class _Bounded(OrderedDict[Any, Any]):
    def __init__(self, limit: int) -> None:
        super().__init__()
        self.limit = limit

    def put(self, key: Any, value: Any) -> None:
        if key in self:
            return
        self[key] = value
        while len(self) > self.limit:
            self.popitem(last=False)


class Shadow:
    """One running shadow: sampler, candidate worker, readers and the rolling report."""

    def __init__(self, opts: ShadowOptions, s: Settings, partitions: int | None = None) -> None:
        if not 0 < opts.percent <= 100:
            raise ShadowPercentError(opts.percent)
        if opts.window < 1:
            raise ShadowWindowError(opts.window)
        self.opts, self.s = opts, s
        sid = opts.shadow_id or plan.new_replay_id(now_ms(), secrets.token_hex(3))
        self.names = ReplayNames(s.app_id, s.topic_prefix, sid, kind="shadow")
        self.live_t, self.own_t = TopicNames(s.topic_prefix), self.names.topics
        self.out_dir = Path(opts.out_dir or f"shadow-{sid}")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.report_path = self.out_dir / "shadow.json"
        #: written once the shadow mirrors, removed when it starts and when it ends
        self.ready_path = self.out_dir / "READY"
        self.live_policy = ReplyToPolicy(self.live_t, s.app_id, s.reply_topic_pattern)
        #: a copy's reply_to is rewritten: one live signed, the shadow signs again with the same key
        self.signers = request_signers(s)
        self.env = opts.worker_env(
            s, self.names, self.out_dir, partitions=partitions or s.partitions, role="all"
        )
        self.candidate = load_settings(self.env)
        self.changed = opts.changed(s)
        #: sampled requests, in the order read: key → copy time (monotonic)
        self.sampled: _Bounded = _Bounded(opts.window)
        self.live: _Bounded = _Bounded(4 * opts.window)
        self.counts = {"read": 0, "sampled": 0, "copied": 0}
        self.worker: WorkerProcess | None = None
        self.collector = Collector(s, self.own_t.replies, request_key)
        self.stop = asyncio.Event()
        #: when the live-reply reader starts (epoch ms): set by the sampler once it knows where it
        #: resumes, then :attr:`resumed` is set
        self.live_from_ms: int | None = None
        self.resumed = asyncio.Event()
        #: why the shadow stopped early, if it did (in the final report)
        self.failure: ShadowTaskError | None = None

    @property
    def group_id(self) -> str:
        """The sampler's own consumer group (neither the live one nor the candidate worker's)."""
        return f"{self.names.app_id}-sampler"

    async def run(self) -> dict[str, Any]:
        """Mirror until SIGINT/SIGTERM or ``duration_s``; the final report. Raises
        :class:`ShadowTaskError` (after writing the report) when one of its tasks ended first."""
        self.ready_path.unlink(missing_ok=True)  # an earlier run's: the shadow is not ready yet
        try:
            return await self._run()
        finally:
            self.ready_path.unlink(missing_ok=True)

    async def _run(self) -> dict[str, Any]:
        opts, s = self.opts, self.s
        try:
            await ensure_topics(self.candidate, broker_time=False)  # the copies keep their timestamps
            await self.collector.start()
        except BaseException:
            await self.collector.stop()  # its consumer was made with the shadow: closed, not left open
            raise
        await asyncio.to_thread(clear_state, self.out_dir)  # tables of an earlier run in this folder
        self.worker = start_worker(self.env, self.out_dir / "worker.log", "all", s.replay_nice)
        #: the tasks watched (a stopped sampler is not), and every task, cancelled at the end
        tasks: dict[str, asyncio.Task[Any]] = {}
        started: list[asyncio.Task[Any]] = []
        try:
            await asyncio.to_thread(self.worker.wait_ready, "surge worker ready", opts.start_timeout_s)
            if not opts.quiet:
                print(
                    f"shadow {self.names.replay_id}: candidate ready, mirroring {opts.percent:g} % of "
                    f"{self.live_t.requests} to {self.own_t.requests}",
                    flush=True,
                )
            live_ready = asyncio.Event()
            sampler_ready = asyncio.Event()
            tasks = {
                "live-reply reader": asyncio.create_task(self._read_live(live_ready)),
                "sampler": asyncio.create_task(self._sample(sampler_ready)),
                "report loop": asyncio.create_task(self._report_loop()),
            }
            started = list(tasks.values())
            both = asyncio.gather(live_ready.wait(), sampler_ready.wait())
            if not await self._watch(tasks, both, READY_TIMEOUT_S):
                raise ReplayError(
                    f"the shadow's sampler and live-reply reader not ready in {READY_TIMEOUT_S:g} s"
                )
            self.ready_path.write_text("ready\n")
            await self._watch(tasks, self.stop.wait(), opts.duration_s)
            self.stop.set()  # the sampler finishes its batch, commits it and returns
            await self._finish(tasks, "sampler")
            # replies to the last copies may still be on their way
            await self._watch(tasks, self.collector.wait_for(set(self.sampled), 10.0), None)
        except ShadowTaskError as exc:
            self.failure = exc
            log.error("%s", exc)
        finally:
            await _cancel(started)
            await self.collector.stop()
            self.worker.stop()
        report = self.write_report(final=True)
        if opts.delete_topics:
            report["deleted_topics"] = await delete_own_topics(s, self.names)
        if self.failure is not None:
            raise self.failure
        return report

    async def _watch(
        self, tasks: Mapping[str, asyncio.Task[Any]], until: Awaitable[Any], timeout_s: float | None
    ) -> bool:
        """Wait for ``until`` (at most ``timeout_s``) while watching ``tasks``, which run until they are
        cancelled: one that ends first raises :class:`ShadowTaskError`. Whether ``until`` finished."""
        waiter = asyncio.ensure_future(until)
        try:
            await asyncio.wait(
                [waiter, *tasks.values()], timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            if not waiter.done():
                waiter.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await waiter
        for name, task in tasks.items():
            if task.done():
                raise ShadowTaskError(name, None if task.cancelled() else task.exception())
        if waiter.cancelled():
            return False
        waiter.result()  # an error of ``until`` is raised here
        return True

    async def _finish(self, tasks: dict[str, asyncio.Task[Any]], name: str) -> None:
        """Stop watching ``tasks[name]``, which is stopping, and let it end (at most
        :data:`SAMPLER_STOP_S`): an error it ends with raises :class:`ShadowTaskError`; one still
        running is cancelled at the end."""
        task = tasks.pop(name)
        await asyncio.wait([task], timeout=SAMPLER_STOP_S)
        if not task.done():
            log.warning("the shadow's %s did not stop in %g s; cancelled", name, SAMPLER_STOP_S)
            return
        if not task.cancelled() and task.exception() is not None:
            raise ShadowTaskError(name, task.exception())

    async def _sample(self, ready: asyncio.Event) -> None:
        """Read the live requests with the shadow's own group; copy the sampled share. Returns once
        :attr:`stop` is set, after committing what it copied."""
        s = self.s
        consumer = AIOKafkaConsumer(
            self.live_t.requests,
            bootstrap_servers=s.bootstrap_servers,
            group_id=self.group_id,
            # committed by hand, once the copies are acknowledged: an auto-commit could commit a
            # record whose copy a crash then lost, and a restart would skip it
            enable_auto_commit=False,
            auto_offset_reset="latest",
            fetch_max_wait_ms=50,
            isolation_level=READ_COMMITTED,  # what the live workers read
            **client_options(s),
        )
        producer = AIOKafkaProducer(
            bootstrap_servers=s.bootstrap_servers,
            acks="all",
            linger_ms=2,
            max_request_size=8 << 20,
            **client_options(s),
        )
        track_sent_topics(producer)
        throttle = Throttle(self.opts.rate(s), time.monotonic)
        target = self.own_t.requests
        if not self.names.owns(target):
            raise ReplayError(f"refusing to write {target!r}")
        try:
            await consumer.start()
            await producer.start()
            for _ in range(600):  # the group's first assignment
                if consumer.assignment():
                    break
                await asyncio.sleep(0.1)
            # positions resolved now: nothing sent after this is missed; committed, so a restart
            # resumes here even when this run copies nothing
            positions = {tp: await consumer.position(tp) for tp in consumer.assignment()}
            await _commit(consumer, positions)
            if not self.resumed.is_set():
                self.live_from_ms = await self._resume_ms(consumer, positions)
                self.resumed.set()
            ready.set()
            while not self.stop.is_set():
                batch = await consumer.getmany(timeout_ms=200, max_records=500)
                if batch:
                    await _commit(consumer, await self._copy(batch, producer, throttle))
        finally:
            await producer.stop()
            await consumer.stop()

    async def _copy(
        self,
        batch: Mapping[TopicPartition, list[ConsumerRecord[Any, Any]]],
        producer: AIOKafkaProducer,
        throttle: Throttle,
    ) -> dict[TopicPartition, int]:
        """Copy the sampled records of ``batch`` (until :attr:`stop` is set); the offsets to commit,
        each partition's after its last record handled, once every copy is acknowledged."""
        done: dict[TopicPartition, int] = {}
        acks: list[asyncio.Future[Any]] = []
        for tp, records in batch.items():
            for rec in records:
                if self.stop.is_set():
                    break
                ack = await self._copy_one(rec, producer, throttle)
                if ack is not None:
                    acks.append(ack)
                done[tp] = rec.offset + 1
        await asyncio.gather(*acks)
        self.counts["copied"] += len(acks)
        return done

    async def _copy_one(
        self, rec: ConsumerRecord[Any, Any], producer: AIOKafkaProducer, throttle: Throttle
    ) -> asyncio.Future[Any] | None:
        """Send the copy of ``rec`` when it is sampled; the future of its acknowledgement."""
        self.counts["read"] += 1
        ids = salvage_ids(rec.value)
        if ids is None or not plan.sampled(ids[0], self.opts.percent):
            return None
        self.counts["sampled"] += 1
        copy = plan.rewrite_request(
            rec.value, self.own_t.replies, self.live_policy, rec.headers, self.signers
        )
        wait = throttle.delay()
        if wait > 0:
            await asyncio.sleep(wait)
        ack = await producer.send(
            self.own_t.requests,
            value=copy.value,
            key=rec.key,
            partition=rec.partition,
            timestamp_ms=rec.timestamp,
            headers=list(copy.headers),
        )
        if copy.ids is not None:
            self.sampled.put(copy.ids, time.monotonic())
        return ack

    async def _resume_ms(self, consumer: AIOKafkaConsumer, positions: Mapping[TopicPartition, int]) -> int:
        """Where the live-reply reader starts (:func:`plan.live_replies_from`): the timestamps of the
        first records the sampler has yet to read, fetched by a consumer of its own."""
        ends = await consumer.end_offsets(list(positions))
        behind = {tp: pos for tp, pos in positions.items() if pos < ends[tp]}
        first = await first_timestamps(self.s, behind) if behind else {}
        return plan.live_replies_from(first, now_ms())

    async def _read_live(self, ready: asyncio.Event) -> None:
        """Live replies of sampled requests, from every live reply topic (no group), from the time
        the sampler resumes at (docs/architecture.md, "Replay")."""
        consumer = groupless_consumer(self.s)
        assigned: set[TopicPartition] = set()
        try:
            await consumer.start()
            await self.resumed.wait()
            from_ms = self.live_from_ms
            assert from_ms is not None
            last_scan = 0.0
            while True:
                if time.monotonic() - last_scan > 5:
                    last_scan = time.monotonic()
                    new = await self._live_partitions(consumer) - assigned
                    if new:
                        await _assign_more(consumer, assigned, new, from_ms)
                        assigned |= new
                    ready.set()
                if not assigned:
                    await asyncio.sleep(0.5)
                    continue
                batch = await consumer.getmany(timeout_ms=200, max_records=1000)
                for records in batch.values():
                    for rec in records:
                        try:
                            data = json.loads(rec.value)
                            key = request_key(data)
                        except (ValueError, KeyError, TypeError):
                            continue
                        if plan.sampled(key[1], self.opts.percent):
                            self.live.put(key, data)
        finally:
            await consumer.stop()

    async def _live_partitions(self, consumer: AIOKafkaConsumer) -> set[TopicPartition]:
        """Every partition of every topic the live reply policy allows (none of the shadow's own)."""
        topics = await consumer.topics()
        live = [t for t in topics if self.live_policy.safe(t) == t and not self.names.owns(t)]
        return {TopicPartition(t, p) for t in live for p in await partitions_of(consumer, t, tries=5)}

    async def _report_loop(self) -> None:
        while True:
            await asyncio.sleep(self.s.shadow_report_interval_s)
            try:
                self.write_report()
            except Exception:  # a report that fails to write must not stop the shadow
                log.exception("could not write the shadow report")

    def write_report(self, final: bool = False) -> dict[str, Any]:
        keys = list(self.sampled)
        replies = {k: self.collector.records[k] for k in keys if k in self.collector.records}
        latency = {k: (self.collector.arrived[k] - self.sampled[k]) * 1000 for k in replies}
        report = compare.compare_requests(
            keys, dict(self.live), replies, replay_latency_ms=latency, changed=self.changed
        )
        report["kind"] = "requests"
        report["shadow"] = {
            "id": self.names.replay_id,
            "app_id": self.names.app_id,
            "group_id": self.group_id,
            "topic_prefix": self.names.prefix,
            "shadow_replies_topic": self.own_t.replies,
            "percent": self.opts.percent,
            "model": self.candidate.served_model,
            "sets": self.opts.sets,
            "window": self.opts.window,
            "updated_ms": now_ms(),
            "final": final,
            #: the live-reply reader started from this time (epoch ms)
            "live_replies_from_ms": self.live_from_ms,
            #: why the shadow stopped early (None: it ran until asked to stop)
            "error": None if self.failure is None else str(self.failure),
            **self.counts,
        }
        tmp = self.report_path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(compare.public(report), indent=2, default=str) + "\n", encoding="utf-8")
        os.replace(tmp, self.report_path)
        if final:
            from pipeline.replay.plot import plot_report

            plot_report(report, self.out_dir / "shadow.png", title=f"surge shadow {self.names.replay_id}")
            if not self.opts.quiet:
                for line in compare.summary_lines(report):
                    print(line)
                if self.failure is not None:
                    print(f"stopped early: {self.failure}")
                print(f"report: {self.report_path}")
        return report


async def _commit(consumer: AIOKafkaConsumer, offsets: Mapping[TopicPartition, int]) -> None:
    """Commit ``offsets`` for the sampler's group. One refused by a rebalance is read and copied
    again by the partition's next owner (a copy is then sent twice; the report keeps the first reply)."""
    if not offsets:
        return
    try:
        await consumer.commit(dict(offsets))
    except CommitFailedError as exc:
        log.warning("the shadow's sampler could not commit (its records will be copied again): %s", exc)


async def _assign_more(
    consumer: AIOKafkaConsumer, assigned: set[TopicPartition], new: set[TopicPartition], from_ms: int
) -> None:
    """Add ``new`` partitions to a groupless consumer's assignment, each from the first record at or
    after ``from_ms`` (its end where there is none); those ``assigned`` already keep their positions
    (``assign`` forgets them)."""
    kept = {tp: await consumer.position(tp) for tp in assigned}
    consumer.assign(sorted(assigned | new))
    for tp, pos in kept.items():
        consumer.seek(tp, pos)
    found = await consumer.offsets_for_times({tp: from_ms for tp in new})
    at_end = [tp for tp in new if found.get(tp) is None]
    for tp in new:
        hit = found.get(tp)
        if hit is not None:
            consumer.seek(tp, hit.offset)
    if at_end:
        await consumer.seek_to_end(*at_end)
    for tp in new:
        await consumer.position(tp)


async def first_timestamps(s: Settings, positions: Mapping[TopicPartition, int]) -> dict[TopicPartition, int]:
    """The timestamp of the record at (or the first after) each offset of ``positions``, read by a
    consumer with no group; a partition with none in :data:`PEEK_TIMEOUT_S` is left out."""
    consumer = groupless_consumer(s, auto_offset_reset="earliest")
    found: dict[TopicPartition, int] = {}
    try:
        await consumer.start()
        consumer.assign(sorted(positions))
        for tp, pos in positions.items():
            consumer.seek(tp, pos)
        deadline = time.monotonic() + PEEK_TIMEOUT_S
        while len(found) < len(positions) and time.monotonic() < deadline:
            batch = await consumer.getmany(timeout_ms=200, max_records=len(positions))
            for tp, records in batch.items():
                if records and tp not in found:
                    found[tp] = records[0].timestamp
                    consumer.pause(tp)
    finally:
        await consumer.stop()
    return found


async def _cancel(tasks: Iterable[asyncio.Task[Any]]) -> None:
    """Cancel ``tasks`` and wait for them; an error one ended with is logged, not swallowed."""
    tasks = list(tasks)
    for t in tasks:
        t.cancel()
    for t in tasks:
        try:
            await t
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("a shadow task failed")


async def run_shadow(opts: ShadowOptions, settings: Settings | None = None) -> dict[str, Any]:
    """Run a shadow until SIGINT/SIGTERM or ``opts.duration_s``; the final report."""
    s = settings or Settings.load()
    consumer = groupless_consumer(s)
    try:
        await consumer.start()
        parts = await partitions_of(consumer, TopicNames(s.topic_prefix).requests)
    finally:
        await consumer.stop()
    if not parts:
        raise ReplayError(f"live requests topic {TopicNames(s.topic_prefix).requests!r} does not exist")
    shadow = Shadow(opts, s, partitions=len(parts))
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, shadow.stop.set)
    return await shadow.run()


def run(opts: ShadowOptions) -> dict[str, Any]:
    return asyncio.run(run_shadow(opts))
