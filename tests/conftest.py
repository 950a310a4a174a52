"""Fixtures: one real Kafka broker for the session, and factories for workers and clients.

Each test gets its own topic prefix and app id, so tests share the broker but not their topics,
consumer groups or tables (quixstreams' containerhelper/factory-fixture style).
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka import AIOKafkaConsumer, TopicPartition

from pipeline.broker import EmbeddedKafka
from pipeline.client import SurgeClient
from pipeline.procs import WorkerProcess
from pipeline.settings import Settings
from pipeline.topics import TopicNames

#: deadlines long enough that a test about something else never sees deadline_exceeded
RELAXED = {"deadline_interactive_ms": "60000", "deadline_batch_ms": "60000"}
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedKafka]:
    """A real Apache Kafka 4.x broker (KRaft) for the whole test run."""
    k = EmbeddedKafka(tmp_path_factory.mktemp("kafka"), partitions=4, heap_mb=768)
    k.start()
    yield k
    k.stop()


class Deployment:
    """One isolated surge deployment on the shared broker: env, workers, clients."""

    def __init__(self, kafka: EmbeddedKafka, tmp: Path, **env: Any) -> None:
        tag = uuid.uuid4().hex[:8]
        self.tmp = tmp
        self.env: dict[str, str] = {
            "SURGE_BROKER": f"kafka://{kafka.bootstrap}",
            "SURGE_TOPIC_PREFIX": f"t{tag}.",
            "SURGE_APP_ID": f"surge-{tag}",
            "SURGE_PARTITIONS": "4",
            "SURGE_MODEL": "echo",
            "SURGE_DATA_DIR": str(tmp / "data"),
            "SURGE_COMMIT_INTERVAL_MS": "200",
        }
        self.env.update(
            {k if k.startswith("SURGE_") else f"SURGE_{k.upper()}": str(v) for k, v in env.items()}
        )
        self.bootstrap = kafka.bootstrap
        self.topics = TopicNames(self.env["SURGE_TOPIC_PREFIX"])
        self.workers: list[WorkerProcess] = []
        self.clients: list[SurgeClient] = []

    @property
    def settings(self) -> Settings:
        saved = dict(os.environ)
        try:
            os.environ.update(self.env)
            return Settings()
        finally:
            os.environ.clear()
            os.environ.update(saved)

    def worker(self, role: str = "all", wait: bool = True, **env: Any) -> WorkerProcess:
        extra = {k if k.startswith("SURGE_") else f"SURGE_{k.upper()}": str(v) for k, v in env.items()}
        n = len(self.workers)
        if n and role != self.workers[-1].env["SURGE_ROLE"]:
            # two live workers never share a RocksDB folder; a restarted one (same role) reuses it
            extra.setdefault("SURGE_DATA_DIR", str(self.tmp / f"data-{role}"))
        w = WorkerProcess({**self.env, **extra}, self.tmp / f"worker-{n}.log", role=role)
        self.workers.append(w.start())
        if wait:
            w.wait_ready()
        return w

    async def client(self, **kw: Any) -> SurgeClient:
        from pipeline.admin import ensure_topics

        await ensure_topics(self.settings)
        c = SurgeClient(
            self.bootstrap, requests_topic=self.topics.requests, reply_topic=self.topics.replies, **kw
        )
        await c.start()
        self.clients.append(c)
        return c

    async def read_topic(self, topic: str, min_count: int = 0, timeout_s: float = 20.0) -> list[Any]:
        """All records of ``topic`` from the beginning (waits for at least ``min_count``)."""
        consumer = AIOKafkaConsumer(bootstrap_servers=self.bootstrap, enable_auto_commit=False)
        await consumer.start()
        try:
            parts = consumer.partitions_for_topic(topic) or set()
            for _ in range(50):
                if parts:
                    break
                await consumer._client.force_metadata_update()
                parts = consumer.partitions_for_topic(topic) or set()
                await asyncio.sleep(0.1)
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

    async def close(self) -> None:
        for c in self.clients:
            await c.stop()
        for w in self.workers:
            w.stop()


@pytest.fixture
async def deployment(kafka: EmbeddedKafka, tmp_path: Path) -> AsyncIterator[Callable[..., Deployment]]:
    """Factory: ``deployment(model="faq", ...)`` makes an isolated deployment; closed at teardown."""
    made: list[Deployment] = []

    def make(**env: Any) -> Deployment:
        d = Deployment(kafka, tmp_path / f"d{len(made)}", **env)
        made.append(d)
        return d

    yield make
    for d in made:
        await d.close()


def request(i: int | str, user: str = "u1", text: str | None = None, **kw: Any) -> dict[str, Any]:
    """A valid InferenceRequest dict."""
    return {"request_id": f"r-{i}", "user_id": user, "prompt": text or f"question number {i}", **kw}


def decode(record: Any) -> dict[str, Any]:
    return json.loads(record.value)
