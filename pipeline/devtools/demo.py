"""``surge demo``: embedded Kafka, one worker with the FAQ answerer, a steady stream of questions."""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tqdm import tqdm

from pipeline.admin import ensure_topics
from pipeline.client import SurgeClient
from pipeline.devtools.broker import EmbeddedKafka
from pipeline.devtools.procs import WorkerProcess
from pipeline.devtools.samples import QUESTIONS, REPHRASINGS, USERS
from pipeline.records import InferenceReply
from pipeline.settings import Settings
from pipeline.stats import percentile
from pipeline.terms import PRIORITIES
from pipeline.topics import TopicNames

R = TypeVar("R")


def workload(n: int, seed: int = 7) -> list[dict[str, Any]]:
    """``n`` requests: several users, mostly interactive, some real-time and batch, repeats included."""
    rng = random.Random(seed)
    run = uuid.uuid4().hex[:6]
    out = []
    for i in range(n):
        roll = rng.random()
        if roll < 0.15:
            text = rng.choice(REPHRASINGS)[1]
        else:
            text = rng.choice(QUESTIONS)
        prio = rng.choices(PRIORITIES, weights=[1, 5, 3, 1])[0]  # all four classes
        out.append(
            {
                "request_id": f"demo-{run}-{i}",
                "user_id": rng.choice(USERS),
                "priority": prio,
                "tier": rng.choices(["free", "standard", "premium"], weights=[2, 6, 2])[0],
                "prompt": text,
            }
        )
    return out


class DemoStream:
    """The stream of a demo: items sent evenly at a rate, each answer timed from its item's send
    (monotonic clock) and counted on a progress bar. Both demos (``surge demo``, ``surge risk demo``)
    run one."""

    def __init__(self, items: Sequence[dict[str, Any]], id_field: str, *, desc: str, unit: str) -> None:
        self.items = items
        self.id_field = id_field
        self.sent_at: dict[str, float] = {}
        self.latencies_ms: list[float] = []
        self.bar = tqdm(total=len(items), desc=desc, unit=unit, dynamic_ncols=True)

    def arrived(self, item_id: str, at: float) -> bool:
        """Time and count the answer to ``item_id``, come at ``at``; False when it answers no item of
        this stream (a client sees every answer on its topic)."""
        if item_id not in self.sent_at:
            return False
        self.latencies_ms.append((at - self.sent_at[item_id]) * 1000)
        self.bar.update(1)
        return True

    async def send(
        self,
        rate_per_s: float,
        send: Callable[[dict[str, Any]], Awaitable[asyncio.Future[R]]],
        flush: Callable[[], Awaitable[None]],
        timeout_s: float = 60.0,
    ) -> tuple[list[R], float]:
        """Send the items evenly at ``rate_per_s``, flush, and wait up to ``timeout_s`` for their
        answers: the answers that came, and the seconds from the first send until the wait ended."""
        futures = []
        start = time.monotonic()
        for i, item in enumerate(self.items):
            delay = start + i / rate_per_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            self.sent_at[item[self.id_field]] = time.monotonic()
            futures.append(await send(item))
        await flush()
        done, _ = await asyncio.wait(futures, timeout=timeout_s)
        elapsed = time.monotonic() - start
        return [f.result() for f in done], elapsed

    def latency_ms(self) -> dict[str, float | None]:
        """The median and 99th percentile of the answers' latencies, rounded to 0.1 ms."""
        return {
            q: None if (v := percentile(self.latencies_ms, p)) is None else round(v, 1)
            for q, p in (("p50", 50), ("p99", 99))
        }


@dataclass
class DemoStack:
    """The embedded broker of a demo, the environment pointing at it, and the worker started on it."""

    bootstrap: str
    env: dict[str, str]
    data_dir: Path
    workers: list[WorkerProcess] = field(default_factory=list)

    def start_worker(
        self, what: str, role: str = "all", marker: str | None = None, env: Mapping[str, str] | None = None
    ) -> WorkerProcess:
        """Start ``what`` (``surge worker --role role``, the stack's environment plus ``env``) and wait
        until it logs ``marker``. A second worker logs to ``worker-<n>.log``."""
        print(f"Kafka at {self.bootstrap}; starting {what} ...", flush=True)
        log = self.data_dir / ("worker.log" if not self.workers else f"worker-{len(self.workers)}.log")
        worker = WorkerProcess({**self.env, **(env or {})}, log, role=role).start()
        self.workers.append(worker)
        worker.wait_ready(marker=marker)
        return worker


@contextlib.contextmanager
def demo_stack(data_dir: Path, env: Mapping[str, str] | None = None) -> Iterator[DemoStack]:
    """Start an embedded broker under ``data_dir`` and point this process's environment at it
    (``SURGE_BROKER``, ``SURGE_DATA_DIR``, then ``env``); on the way out the worker started with
    :meth:`DemoStack.start_worker` stop, then the broker."""
    data_dir.mkdir(parents=True, exist_ok=True)
    base = Settings()
    kafka = EmbeddedKafka(data_dir / "kafka", cache_dir=base.kafka_cache_dir, version=base.kafka_version)
    print(f"starting Apache Kafka {base.kafka_version} (KRaft) ...", flush=True)
    kafka.start()
    own = {"SURGE_BROKER": f"kafka://{kafka.bootstrap}", "SURGE_DATA_DIR": str(data_dir / "tables")}
    stack = DemoStack(kafka.bootstrap, {**own, **(env or {})}, data_dir)
    try:
        os.environ.update(stack.env)
        yield stack
    finally:
        for worker in reversed(stack.workers):
            worker.stop()
        kafka.stop()


async def _drive(settings: Settings, n: int, rate_per_s: float, quiet: bool) -> dict[str, Any]:
    topics = TopicNames(settings.topic_prefix)
    requests = workload(n)
    stream = DemoStream(requests, "request_id", desc="answered", unit="req")
    questions = {r["request_id"]: r for r in requests}

    def on_reply(reply: InferenceReply) -> None:
        if stream.arrived(reply.request_id, time.monotonic()) and not quiet:
            q = questions[reply.request_id]
            error = reply.error
            what = (
                reply.answer
                if reply.status == "ok" or error is None
                else f"ERROR {error.code}: {error.message}"
            )
            took = stream.latencies_ms[-1]
            stream.bar.write(
                f"{q['priority']:>11} {q['user_id']:<6} [{reply.served_from or '-':>8} {took:6.0f} ms] "
                f"Q: {q['prompt']}\n{'':>20}A: {what}"
            )

    async with SurgeClient(
        settings.bootstrap_servers,
        requests_topic=topics.requests,
        reply_topic=topics.replies,
        on_reply=on_reply,
    ) as client:
        replies, elapsed = await stream.send(rate_per_s, client.submit, client.producer.flush)
    stream.bar.close()
    errors = Counter(r.error.code for r in replies if r.error is not None)
    return {
        "sent": n,
        "answered": len(replies),
        "ok": sum(r.status == "ok" for r in replies),
        "errors": dict(errors),
        "served_from": dict(Counter(r.served_from for r in replies if r.served_from)),
        "latency_ms": stream.latency_ms(),
        "requests_per_s": round(len(replies) / elapsed, 1),
        "seconds": round(elapsed, 2),
    }


def run_demo(n: int, rate_per_s: float, data_dir: Path, quiet: bool = False) -> dict[str, Any]:
    """Start Kafka and a worker, stream ``n`` questions at ``rate_per_s``, stop everything; the summary."""
    with demo_stack(data_dir) as stack:
        settings = Settings()
        asyncio.run(ensure_topics(settings))
        worker = stack.start_worker("a worker (FAQ answerer, MiniLM embedder)")
        print(f"worker ready; sending {n} questions at {rate_per_s:g}/s\n", flush=True)
        summary = asyncio.run(_drive(settings, n, rate_per_s, quiet))
        summary["worker_log"] = str(worker.log_path)
    print(
        f"\nsent {summary['sent']}, answered {summary['answered']} (ok {summary['ok']}, errors {summary['errors']}), "
        f"served from {summary['served_from']}\n"
        f"latency p50 {summary['latency_ms']['p50']} ms, p99 {summary['latency_ms']['p99']} ms, "
        f"{summary['requests_per_s']} requests/s"
    )
    return summary
