"""One isolated surge deployment on a shared broker: its own topics, app id, data folders, workers
and clients.

The one deployment builder of the benchmarks (``pipeline/devtools/bench/common.py``) and the integration
tests (``tests/conftest.py``): both give each arm or test its own topic prefix and app id, so they
share a broker but no topics, consumer groups or tables, and start workers the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from pipeline.client import SurgeClient, partitions_of
from pipeline.devtools.procs import WorkerProcess
from pipeline.metrics import scrape
from pipeline.settings import Settings
from pipeline.topics import TopicNames

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def env_name(key: str) -> str:
    """An environment variable name: ``max_wait_ms`` → ``SURGE_MAX_WAIT_MS``; upper-case names as given."""
    return key if key.isupper() else f"SURGE_{key.upper()}"


def env_value(value: object) -> str:
    """An environment value: booleans as ``true``/``false``, everything else as ``str``."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def deployment_env(
    bootstrap: str,
    *,
    prefix: str,
    app_id: str,
    data_dir: str | Path,
    defaults: Mapping[str, object] | None = None,
    **overrides: object,
) -> dict[str, str]:
    """The environment of an isolated deployment: ``defaults``, then its identity (broker, topic
    prefix, app id, data folder), then ``overrides``. Keys are Settings field names or variable names."""
    env = {env_name(k): env_value(v) for k, v in (defaults or {}).items()}
    env.update(
        {
            "SURGE_BROKER": f"kafka://{bootstrap}",
            "SURGE_TOPIC_PREFIX": prefix,
            "SURGE_APP_ID": app_id,
            "SURGE_DATA_DIR": str(data_dir),
        }
    )
    env.update({env_name(k): env_value(v) for k, v in overrides.items()})
    return env


def load_settings(env: Mapping[str, str]) -> Settings:
    """The Settings a process with ``env`` on top of this one's environment reads (validated)."""
    saved = dict(os.environ)
    try:
        os.environ.update(env)
        return Settings.load()
    finally:
        os.environ.clear()
        os.environ.update(saved)


class Deployment:
    """A deployment's environment, the workers and clients started for it, and how to stop them."""

    def __init__(self, name: str, env: Mapping[str, str], bootstrap: str, tmp: Path) -> None:
        self.name = name
        self.env = dict(env)
        self.bootstrap = bootstrap
        self.tmp = tmp
        self.workers: list[WorkerProcess] = []
        self._started = 0
        self.clients: list[SurgeClient] = []

    @property
    def topics(self) -> TopicNames:
        return TopicNames(self.env["SURGE_TOPIC_PREFIX"])

    def settings(self) -> Settings:
        """The Settings a worker of this deployment reads (validated here, before any start)."""
        return load_settings(self.env)

    def worker(self, role: str = "all", wait: bool = True, **env: object) -> WorkerProcess:
        """Start one ``surge worker``; ``wait``: until it reports ready. ``env`` overrides settings
        for this worker only. Two live workers of different roles never share a RocksDB folder; a
        worker started again in the same role reuses its predecessor's."""
        extra = {env_name(k): env_value(v) for k, v in env.items()}
        n = len(self.workers)
        if n and role != self.workers[-1].env["SURGE_ROLE"]:
            extra.setdefault("SURGE_DATA_DIR", str(self.tmp / f"data-{self.name}-{role}"))
        self._started += 1  # a worker started again after one was removed gets a log of its own
        log = self.tmp / f"{self.name}-worker-{self._started - 1}.log"
        w = WorkerProcess({**self.env, **extra}, log, role=role)
        self.workers.append(w.start())
        if wait:
            w.wait_ready()
        return w

    def start_worker(self) -> WorkerProcess:
        """:meth:`worker` without waiting (the benchmarks start all arms, then wait for them)."""
        return self.worker(wait=False)

    async def client(self, **kw: Any) -> SurgeClient:
        """A started client of this deployment's request and reply topics (topics created first)."""
        from pipeline.admin import ensure_topics

        await ensure_topics(load_settings(self.env))
        kw.setdefault("reply_topic", self.topics.replies)
        c = SurgeClient(self.bootstrap, requests_topic=self.topics.requests, **kw)
        await c.start()
        self.clients.append(c)
        return c

    async def replies(self, futures: Sequence[asyncio.Future[Any]], timeout_s: float = 90.0) -> list[Any]:
        """Every future's reply, in order. On timeout, an AssertionError that says which requests
        are unanswered, whether their replies are on the reply topic all the same (the client's
        reader missed them) or not (no worker answered), and the end of every worker's log."""
        futures = list(futures)
        _, pending = await asyncio.wait(futures, timeout=timeout_s) if futures else (set(), set())
        if not pending:
            return [f.result() for f in futures]
        waiting = {id(f): key for c in self.clients for key, f in c.waiting().items()}
        missing = sorted(waiting.get(id(f), "?") for f in pending)
        on_topic: set[str] = set()
        with contextlib.suppress(Exception):
            for record in await self.read_topic(self.topics.replies, timeout_s=5):
                with contextlib.suppress(ValueError):
                    on_topic.add(json.loads(record.value).get("request_id"))
        found = [k for k in missing if k in on_topic]
        logs = "\n".join(f"--- {w.name} ({w.log_path}):\n{w.tail(3000)}" for w in self.workers)
        raise AssertionError(
            f"{len(pending)} of {len(futures)} requests unanswered after {timeout_s:g} s: "
            f"{missing[:10]}{' ...' if len(missing) > 10 else ''}; {len(found)} of them have a reply on "
            f"{self.topics.replies} that the client did not read ({found[:10]})\n"
            f"{await self.where_records_wait()}\n{logs}"
        )

    async def where_records_wait(self) -> str:
        """For a failure message: each live worker's ``/status`` (queues, unacked records) and, per
        partition of the request and work topics, the group's committed offset against the end, so
        an unanswered request shows whether it waits in Kafka, in a worker, or was never written."""
        lines = []
        for w in self.workers:
            try:
                status = json.dumps(await asyncio.to_thread(w.status), default=str)
            except Exception as exc:  # a dead or stalled worker is what the message is about
                status = f"no status: {exc!r}"
            lines.append(f"--- {w.name} /status: {status[:3000]}")
        try:
            lines.append(f"--- committed/end per partition: {await self._lag()}")
        except Exception as exc:
            lines.append(f"--- no offsets: {exc!r}")
        return "\n".join(lines)

    async def _lag(self) -> dict[str, str]:
        from aiokafka import AIOKafkaConsumer, TopicPartition

        from pipeline.compat import refresh_metadata

        t = self.topics
        topics = [t.requests, *(t.work(p) for p in ("realtime", "interactive", "batch", "offline"))]
        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.bootstrap, group_id=self.env["SURGE_APP_ID"], enable_auto_commit=False
        )
        try:
            await consumer.start()
            await refresh_metadata(consumer)
            tps = [
                TopicPartition(x, p) for x in topics for p in sorted(consumer.partitions_for_topic(x) or ())
            ]
            ends = await asyncio.wait_for(consumer.end_offsets(tps), 10)
            out = {}
            for tp in tps:
                committed = await asyncio.wait_for(consumer.committed(tp), 10)
                if ends[tp] or committed:
                    out[f"{tp.topic}[{tp.partition}]"] = f"{committed}/{ends[tp]}"
            return out
        finally:
            await consumer.stop()

    def metrics(self, worker: int = 0) -> Samples:
        """A worker's /metrics, parsed (the first worker's by default)."""
        return scrape(self.workers[worker].metrics())

    async def read_topic(self, topic: str, min_count: int = 0, timeout_s: float = 20.0) -> list[Any]:
        """Every record of ``topic`` from the beginning, waiting up to ``timeout_s`` for ``min_count``."""
        from aiokafka import AIOKafkaConsumer, TopicPartition

        consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, enable_auto_commit=False)
        try:
            await consumer.start()
            parts = await partitions_of(consumer, topic, tries=50)
            tps = [TopicPartition(topic, p) for p in parts]
            consumer.assign(tps)
            await consumer.seek_to_beginning(*tps)
            out: list[Any] = []
            loop = asyncio.get_running_loop()
            end = loop.time() + timeout_s
            while loop.time() < end:
                batch = await consumer.getmany(timeout_ms=300)
                for records in batch.values():
                    out.extend(records)
                if len(out) >= min_count and not batch:
                    break
            return out
        finally:
            await consumer.stop()

    def stop_workers(self, timeout_s: float = 30.0) -> None:
        for w in self.workers:
            w.stop(timeout_s=timeout_s)

    async def close(self, timeout_s: float = 30.0) -> None:
        """Stop the clients (10 s each at most), then the workers."""
        for c in self.clients:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(c.stop(), 10)
        self.clients.clear()
        self.stop_workers(timeout_s)
