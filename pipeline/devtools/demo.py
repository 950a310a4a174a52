"""``surge demo``: embedded Kafka, one worker with the FAQ answerer, a steady stream of questions."""

from __future__ import annotations

import asyncio
import os
import random
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

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


async def _drive(settings: Settings, n: int, rate_per_s: float, quiet: bool) -> dict[str, Any]:
    topics = TopicNames(settings.topic_prefix)
    requests = workload(n)
    sent_at: dict[str, float] = {}
    latencies: list[float] = []
    bar = tqdm(total=n, desc="answered", unit="req", dynamic_ncols=True)
    questions = {r["request_id"]: r for r in requests}

    def on_reply(reply: InferenceReply) -> None:
        if reply.request_id not in sent_at:
            return
        latencies.append((time.perf_counter() - sent_at[reply.request_id]) * 1000)
        bar.update(1)
        if not quiet:
            q = questions[reply.request_id]
            what = (
                reply.answer if reply.status == "ok" else f"ERROR {reply.error.code}: {reply.error.message}"
            )  # type: ignore[union-attr]
            bar.write(
                f"{q['priority']:>11} {q['user_id']:<6} [{reply.served_from or '-':>8} {latencies[-1]:6.0f} ms] "
                f"Q: {q['prompt']}\n{'':>20}A: {what}"
            )

    async with SurgeClient(
        settings.bootstrap_servers,
        requests_topic=topics.requests,
        reply_topic=topics.replies,
        on_reply=on_reply,
    ) as client:
        futs = []
        start = time.perf_counter()
        for i, req in enumerate(requests):
            delay = start + i / rate_per_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            sent_at[req["request_id"]] = time.perf_counter()
            futs.append(await client.submit(req))
        await client.producer.flush()
        done, _ = await asyncio.wait(futs, timeout=60)
        elapsed = time.perf_counter() - start
    bar.close()
    replies = [f.result() for f in done]
    errors = Counter(r.error.code for r in replies if r.error is not None)
    return {
        "sent": n,
        "answered": len(replies),
        "ok": sum(r.status == "ok" for r in replies),
        "errors": dict(errors),
        "served_from": dict(Counter(r.served_from for r in replies if r.served_from)),
        "latency_ms": {q: _ms(percentile(latencies, p)) for q, p in (("p50", 50), ("p99", 99))},
        "requests_per_s": round(len(replies) / elapsed, 1),
        "seconds": round(elapsed, 2),
    }


def _ms(value: float | None) -> float | None:
    return None if value is None else round(value, 1)


def run_demo(n: int, rate_per_s: float, data_dir: Path, quiet: bool = False) -> dict[str, Any]:
    """Start Kafka and a worker, stream ``n`` questions at ``rate_per_s``, stop everything; the summary."""
    data_dir.mkdir(parents=True, exist_ok=True)
    base = Settings()
    kafka = EmbeddedKafka(data_dir / "kafka", cache_dir=base.kafka_cache_dir, version=base.kafka_version)
    worker: WorkerProcess | None = None
    print(f"starting Apache Kafka {base.kafka_version} (KRaft) ...", flush=True)
    kafka.start()
    try:
        env = {"SURGE_BROKER": f"kafka://{kafka.bootstrap}", "SURGE_DATA_DIR": str(data_dir / "tables")}
        os.environ.update(env)
        settings = Settings()
        asyncio.run(ensure_topics(settings))
        print(
            f"Kafka at {kafka.bootstrap}; starting a worker (FAQ answerer, MiniLM embedder) ...", flush=True
        )
        worker = WorkerProcess(env, data_dir / "worker.log").start()
        worker.wait_ready()
        print(f"worker ready; sending {n} questions at {rate_per_s:g}/s\n", flush=True)
        summary = asyncio.run(_drive(settings, n, rate_per_s, quiet))
        summary["worker_log"] = str(worker.log_path)
    finally:
        if worker is not None:
            worker.stop()
        kafka.stop()
    print(
        f"\nsent {summary['sent']}, answered {summary['answered']} (ok {summary['ok']}, errors {summary['errors']}), "
        f"served from {summary['served_from']}\n"
        f"latency p50 {summary['latency_ms']['p50']} ms, p99 {summary['latency_ms']['p99']} ms, "
        f"{summary['requests_per_s']} requests/s"
    )
    return summary
