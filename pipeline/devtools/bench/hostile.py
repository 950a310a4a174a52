"""``surge bench hostile``: a worker's memory under requests made to grow its state.

100,000 requests (4,000 with ``--quick``) are written straight to the request topic by a plain
aiokafka producer, each built to create per-key state if the worker let it: 40 % name a random
model (refused: an error reply and a dead letter each), 30 % come from a new user id (a rate-limit
bucket, a model call and a cache entry each), 20 % carry a new system message (a new cache scope
each) and 10 % a new tenant (a new scope and a new tenant bucket). The worker runs the echo model
with caches, merging and rate limits on; its cache bound is lowered to ``CACHE_ENTRIES`` so that the
bound is reached within the run. Its RSS (with children) is sampled every second; the backlog is
kept at most ``Plan.backlog`` requests ahead of the replies.

Targets: every request gets one reply; the RSS of the second half of the run grows by at most 10 %
of the RSS at half-way (state stops growing once its bounds are reached); the peak stays under the
bound this file states (:func:`stated_bound_mib`). docs/architecture.md, "Security", has the bounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.client import partitions_of
from pipeline.devtools.bench.background import plain_consumer
from pipeline.devtools.bench.common import (
    BenchDeployment,
    BenchEnv,
    BenchRun,
    long_deadlines,
    progress,
    target,
)
from pipeline.devtools.bench.report import figure, report
from pipeline.devtools.bench.surge import tree_rss_kb
from pipeline.settings import Settings

#: the cache bound of the run (entries); the default (100,000) would take the whole run to reach
CACHE_ENTRIES = 5_000
#: what one cache entry may cost at most: its 384-float vector twice (index rows double as they
#: grow), its question and answer, and the LRU and index bookkeeping, KiB
ENTRY_KIB = 4
#: tables whose stores grow with what clients send: rate limits, answers, the reply book
GROWING_TABLES = 3
#: caches of per-text work that every distinct question passes through, MiB, each bounded by bytes
#: (``pipeline.textcache.TextCache``): normal forms 8, guard features 32, the merge decision's
#: profiles 32, so at most 72 MiB whatever the texts
TEXT_CACHES_MIB = 80
#: the worker's settings: the echo model; caches and merging on (their defaults) and rate limits on
#: (BASE_ENV turns them off); the cache bound lowered; tenant buckets too large to refuse anything;
#: deadlines no request reaches
WORKER: dict[str, object] = {
    "model": "echo",
    "rate_limit_enabled": True,
    "cache_max_entries": CACHE_ENTRIES,
    "tenant_rate_per_s": 1_000_000,
    "tenant_burst": 2_000_000,
    **long_deadlines(600_000),
}


@dataclass(frozen=True)
class Plan:
    requests: int
    warmup: int
    backlog: int
    timeout_s: float


FULL = Plan(requests=100_000, warmup=500, backlog=4_000, timeout_s=1_800)
QUICK = Plan(requests=4_000, warmup=200, backlog=1_500, timeout_s=300)


def hostile_request(i: int, tag: str) -> tuple[bytes, dict[str, Any]]:
    """Request ``i`` of the run: its record key and body (kinds by ``i % 10``, see the module doc)."""
    rid = f"{tag}-{i}"
    token = uuid.uuid5(uuid.NAMESPACE_URL, rid).hex[:12]
    kind = i % 10
    body: dict[str, Any] = {
        "request_id": rid,
        "user_id": f"u-{i % 1000}",
        "prompt": f"what is the fee for card {i}",
    }
    if kind < 4:
        body["model"] = f"model-{token}"
    elif kind < 7:
        body["user_id"] = f"user-{token}"
    elif kind < 9:
        body.pop("prompt")
        body["messages"] = [
            {"role": "system", "content": f"answer as assistant {token}"},
            {"role": "user", "content": f"what is the fee for card {i}"},
        ]
    else:
        body["tenant"] = f"tenant-{token}"
    return body["user_id"].encode(), body


def stated_bound_mib(start_mib: float, s: Settings) -> float:
    """The RSS a worker may reach: what it held after warm-up, plus a full answer cache, full text
    caches, and every growing table store at its RocksDB memory bound (two write buffers and the
    block cache)."""
    stores = GROWING_TABLES * s.partitions
    per_store = 2 * s.table_write_buffer_mb + s.table_block_cache_mb
    return start_mib + s.cache_max_entries * ENTRY_KIB / 1024 + TEXT_CACHES_MIB + stores * per_store


async def _drive(env: BenchEnv, d: BenchDeployment, plan: Plan, pid: int) -> dict[str, Any]:
    from aiokafka import AIOKafkaProducer, TopicPartition

    from pipeline.admin import ensure_topics

    await ensure_topics(d.settings())
    topics = d.topics
    consumer = plain_consumer(env.bootstrap)
    producer = AIOKafkaProducer(bootstrap_servers=env.bootstrap, linger_ms=5, acks=1)
    await consumer.start()
    await producer.start()
    seen: set[str] = set()
    codes: Counter[str] = Counter()
    examples: dict[str, list[str]] = {}  # a few error messages per code, to show why
    repeats = 0
    samples: list[tuple[float, int, float]] = []  # (t, replies, rss MiB)
    arrived = asyncio.Event()

    async def replies_reach(count: int, timeout_s: float) -> None:
        end = time.monotonic() + timeout_s
        while len(seen) < count and time.monotonic() < end:
            arrived.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(arrived.wait(), 0.5)

    try:
        tps = [TopicPartition(topics.replies, p) for p in await partitions_of(consumer, topics.replies, 100)]
        consumer.assign(tps)
        await consumer.seek_to_end(*tps)

        async def read() -> None:
            nonlocal repeats
            while True:
                batch = await consumer.getmany(timeout_ms=200, max_records=2000)
                for records in batch.values():
                    for r in records:
                        try:
                            rep = json.loads(r.value)
                        except ValueError:
                            continue
                        rid = str(rep.get("request_id"))
                        if rid in seen:
                            repeats += 1
                            continue
                        seen.add(rid)
                        arrived.set()
                        error = rep.get("error") or {}
                        code = "ok" if rep.get("status") == "ok" else str(error.get("code", "?"))
                        if not rid.startswith("run-"):
                            continue  # warm-up replies count only towards the start
                        codes[code] += 1
                        if code != "ok" and len(examples.setdefault(code, [])) < 3:
                            examples[code].append(f"{rid}: {error.get('message', '')}"[:300])

        reader = asyncio.create_task(read())
        t0 = time.monotonic()

        async def sample() -> None:
            while True:
                rss = tree_rss_kb(pid)
                if rss:
                    samples.append((time.monotonic() - t0, len(seen), rss / 1024))
                await asyncio.sleep(1.0)

        sampler = asyncio.create_task(sample())
        try:
            # warm-up: the worker's first requests load lazy parts; RSS after them is the start
            for i in range(plan.warmup):
                key, body = hostile_request(i, "warm")
                await producer.send(topics.requests, json.dumps(body).encode(), key=key)
            await producer.flush()
            await replies_reach(plan.warmup, 120)
            start_mib = (tree_rss_kb(pid) or 0) / 1024
            base = len(seen)
            t_run = time.monotonic()
            with progress(plan.requests, "hostile requests answered") as bar:
                sent = 0
                while sent < plan.requests:
                    if sent - (len(seen) - base) >= plan.backlog:
                        await replies_reach(base + sent - plan.backlog // 2, 1.0)
                        bar.n = len(seen) - base
                        bar.refresh()
                        continue
                    for i in range(sent, min(plan.requests, sent + 500)):
                        key, body = hostile_request(i, "run")
                        await producer.send(topics.requests, json.dumps(body).encode(), key=key)
                    sent = min(plan.requests, sent + 500)
                await producer.flush()
                while len(seen) - base < plan.requests and time.monotonic() - t_run < plan.timeout_s:
                    await replies_reach(base + plan.requests, 1.0)
                    bar.n = len(seen) - base
                    bar.refresh()
            elapsed = time.monotonic() - t_run
            await asyncio.sleep(2.0)  # late repeats, one more sample
        finally:
            sampler.cancel()
            reader.cancel()
        status = await asyncio.to_thread(d.workers[0].status)
    finally:
        await producer.stop()
        await consumer.stop()
    return {
        "start_mib": round(start_mib, 1),
        "answered": len(seen) - base,
        "repeats": repeats,
        "codes": dict(codes),
        "error_examples": examples,
        "elapsed_s": round(elapsed, 1),
        "samples": [(round(t, 1), n - base if n >= base else 0, round(m, 1)) for t, n, m in samples],
        "status": status,
    }


def _rss_at(samples: list[tuple[float, int, float]], answered: int) -> float | None:
    """The RSS of the first sample taken once ``answered`` replies were in."""
    for _, n, mib in samples:
        if n >= answered:
            return mib
    return None


def run(job: BenchRun) -> int:
    plan = QUICK if job.quick else FULL
    with BenchEnv(job.scenario, broker=job.broker) as env:
        d = env.deployment("worker", **WORKER)
        startup_s = env.wait_ready([d])
        w = d.workers[0]
        assert w.proc is not None
        out = asyncio.run(_drive(env, d, plan, w.proc.pid))
        s = d.settings()
    samples = out.pop("samples")
    n = plan.requests
    half, end = _rss_at(samples, n // 2), _rss_at(samples, n)
    peak = max((m for _, _, m in samples), default=None)
    late_peak = max((m for _, a, m in samples if a >= n // 2), default=None)
    growth = round((late_peak - half) / half, 4) if half and late_peak else None
    bound = round(stated_bound_mib(out["start_mib"], s), 1)
    result = {
        "plan": plan.__dict__,
        "worker_startup_s": round(startup_s, 1),
        "mix": "40 % random model names, 30 % new user ids, 20 % new system messages, 10 % new tenants",
        "settings": {
            "cache_max_entries": s.cache_max_entries,
            "partitions": s.partitions,
            "table_write_buffer_mb": s.table_write_buffer_mb,
            "table_block_cache_mb": s.table_block_cache_mb,
        },
        **out,
        "rss_mib": {"start": out["start_mib"], "half": half, "end": end, "peak": peak, "stated_bound": bound},
        "second_half_growth": growth,
        "targets": [
            target("requests answered", out["answered"], ">=", n),
            target("RSS growth over the second half", growth, "<=", 0.10),
            target("peak RSS, MiB (stated bound)", peak, "<=", bound),
        ],
        "timeline": samples,
    }

    def plot(pp: Path) -> None:
        with figure(pp, f"{job.title}: {n:,} requests", figsize=(8, 4)) as (_, ax):
            ax.plot([a for _, a, _ in samples], [m for _, _, m in samples], label="worker RSS")
            ax.axhline(bound, color="#e53e3e", linestyle="--", label=f"stated bound {bound:.0f} MiB")
            ax.set_xlabel("hostile requests answered")
            ax.set_ylabel("RSS, MiB")
            ax.set_ylim(bottom=0)
            ax.legend(loc="lower right")

    return report(job, result, plot)
