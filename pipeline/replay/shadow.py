"""``surge shadow`` (also ``surge replay --shadow PERCENT``): mirror a share of live traffic to a
candidate model whose outputs go only to a shadow topic, with a rolling comparison
(docs/architecture.md, "Replay").

* A sampler reads the live requests topic with its own consumer group (``<app>-shadow-<id>-sampler``; the
  live group and its offsets are never touched), keeps the requests whose id hashes into the share
  (:func:`pipeline.replay.plan.sampled`), rewrites their ``reply_to`` to the shadow's replies topic and
  copies them, throttled, into ``<prefix>shadow.<id>.requests``.
* A candidate worker runs under the shadow's app id and prefix with the replay defaults, the model and
  the ``--set`` settings; its reply policy allows only its own replies topic, so nothing it writes
  reaches a client.
* The live replies of sampled requests (read without a group from the live reply topics) and the
  shadow's replies are joined on ``(user_id, request_id)``; every ``SURGE_SHADOW_REPORT_INTERVAL_S``
  the comparison of the last ``window`` sampled requests is written to ``shadow.json`` (replaced
  atomically), and a PNG at the end.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from pipeline.admin import ensure_topics
from pipeline.client import partitions_of
from pipeline.compat import track_sent_topics
from pipeline.devtools.deployment import load_settings
from pipeline.devtools.procs import WorkerProcess
from pipeline.kafka_security import client_options
from pipeline.records import now_ms, salvage_ids
from pipeline.replay import compare, plan
from pipeline.replay.plan import ReplayError, ReplayNames, Throttle
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
            raise ReplayError(f"--shadow {opts.percent}: a percentage above 0 and at most 100")
        self.opts, self.s = opts, s
        sid = opts.shadow_id or plan.new_replay_id(now_ms(), secrets.token_hex(3))
        self.names = ReplayNames(s.app_id, s.topic_prefix, sid, kind="shadow")
        self.live_t, self.own_t = TopicNames(s.topic_prefix), self.names.topics
        self.out_dir = Path(opts.out_dir or f"shadow-{sid}")
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.report_path = self.out_dir / "shadow.json"
        self.live_policy = ReplyToPolicy(self.live_t, s.app_id, s.reply_topic_pattern)
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

    @property
    def group_id(self) -> str:
        """The sampler's own consumer group (neither the live one nor the candidate worker's)."""
        return f"{self.names.app_id}-sampler"

    async def run(self) -> dict[str, Any]:
        opts, s = self.opts, self.s
        await ensure_topics(self.candidate, broker_time=False)  # the copies keep their timestamps
        await self.collector.start()
        await asyncio.to_thread(clear_state, self.out_dir)  # tables of an earlier run in this folder
        self.worker = start_worker(self.env, self.out_dir / "worker.log", "all", s.replay_nice)
        tasks: list[asyncio.Task[Any]] = []
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
            tasks = [
                asyncio.create_task(self._read_live(live_ready)),
                asyncio.create_task(self._sample(sampler_ready)),
                asyncio.create_task(self._report_loop()),
            ]
            await asyncio.wait_for(asyncio.gather(live_ready.wait(), sampler_ready.wait()), 60)
            (self.out_dir / "READY").write_text("ready\n")
            if opts.duration_s is not None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.stop.wait(), opts.duration_s)
            else:
                await self.stop.wait()
            # replies to the last copies may still be on their way
            await self.collector.wait_for(set(self.sampled), 10.0)
        finally:
            for t in tasks:
                t.cancel()
            for t in tasks:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await t
            await self.collector.stop()
            self.worker.stop()
        report = self.write_report(final=True)
        if opts.delete_topics:
            report["deleted_topics"] = await delete_own_topics(s, self.names)
        return report

    async def _sample(self, ready: asyncio.Event) -> None:
        """Read the live requests with the shadow's own group; copy the sampled share."""
        s = self.s
        consumer = AIOKafkaConsumer(
            self.live_t.requests,
            bootstrap_servers=s.bootstrap_servers,
            group_id=self.group_id,
            enable_auto_commit=True,
            auto_offset_reset="latest",
            fetch_max_wait_ms=50,
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
        await consumer.start()
        await producer.start()
        try:
            for _ in range(600):  # the group's first assignment
                if consumer.assignment():
                    break
                await asyncio.sleep(0.1)
            for tp in consumer.assignment():  # positions resolved now: nothing sent after this is missed
                await consumer.position(tp)
            ready.set()
            while True:
                batch = await consumer.getmany(timeout_ms=200, max_records=500)
                for records in batch.values():
                    for rec in records:
                        self.counts["read"] += 1
                        ids = salvage_ids(rec.value)
                        if ids is None or not plan.sampled(ids[0], self.opts.percent):
                            continue
                        self.counts["sampled"] += 1
                        copy = plan.rewrite_request(rec.value, self.own_t.replies, self.live_policy)
                        wait = throttle.delay()
                        if wait > 0:
                            await asyncio.sleep(wait)
                        await producer.send(
                            target,
                            value=copy.value,
                            key=rec.key,
                            partition=rec.partition,
                            timestamp_ms=rec.timestamp,
                        )
                        self.counts["copied"] += 1
                        if copy.ids is not None:
                            self.sampled.put(copy.ids, time.monotonic())
        finally:
            await producer.stop()
            await consumer.stop()

    async def _read_live(self, ready: asyncio.Event) -> None:
        """Live replies of sampled requests, from every live reply topic (no group)."""
        consumer = groupless_consumer(self.s)
        await consumer.start()
        assigned: set[TopicPartition] = set()
        try:
            last_scan = 0.0
            while True:
                if time.monotonic() - last_scan > 5:
                    last_scan = time.monotonic()
                    topics = await consumer.topics()
                    live = [t for t in topics if self.live_policy.safe(t) == t and not self.names.owns(t)]
                    tps = {
                        TopicPartition(t, p) for t in live for p in await partitions_of(consumer, t, tries=5)
                    }
                    new = tps - assigned
                    if new:
                        assigned |= new
                        consumer.assign(sorted(assigned))
                        await consumer.seek_to_end(*new)
                        for tp in new:
                            await consumer.position(tp)
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
                print(f"report: {self.report_path}")
        return report


async def run_shadow(opts: ShadowOptions, settings: Settings | None = None) -> dict[str, Any]:
    """Run a shadow until SIGINT/SIGTERM or ``opts.duration_s``; the final report."""
    s = settings or Settings.load()
    consumer = groupless_consumer(s)
    await consumer.start()
    try:
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
