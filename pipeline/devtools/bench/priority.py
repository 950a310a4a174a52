"""``surge bench priority``: per-class latency and deadline misses at 1.5x overload, EDF against FIFO.

The model is the echo model with a fixed cost (``echo_delay_ms`` per batch plus ``echo_per_item_ms``
per item), so its capacity is known and steady. First the pipeline's capacity is measured (a closed
loop of batch-class requests through the ``edf`` arm); then both arms are offered 1.5x that rate,
open loop, 10% realtime, 30% interactive, 60% batch, with the default class deadlines
(200/500/5000 ms), in interleaved segments:

* ``edf``: ``queue_policy=edf`` (strict priority between classes, earliest deadline first within);
* ``fifo``: ``queue_policy=fifo`` (one queue in arrival order).

Degradation is off in both (it would answer batch work from templates and hide the overload), and
so are caches and merging (every prompt is distinct anyway). A miss is a ``deadline_exceeded`` reply
or an answer that arrived after the deadline. Targets: realtime p99 within 200 ms with at most 0.3%
misses under EDF; FIFO misses at least 10% of realtime deadlines.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass
from typing import Any

from pipeline.client import SurgeClient
from pipeline.devtools.bench.common import (
    BenchDeployment,
    BenchEnv,
    BenchError,
    BenchRun,
    latency_summary,
    target,
)
from pipeline.devtools.bench.load import LoadResult, closed_loop, open_loop
from pipeline.devtools.bench.report import finish

MIX = (("realtime", 0.10), ("interactive", 0.30), ("batch", 0.60))
ECHO = {"echo_delay_ms": 20.0, "echo_per_item_ms": 5.0, "max_batch_size": 8, "base_batch_size": 8}
OVERLOAD = 1.5


@dataclass(frozen=True)
class Plan:
    capacity_requests: int
    segments: int
    segment_s: float
    drain_s: float


FULL = Plan(capacity_requests=800, segments=2, segment_s=25.0, drain_s=25.0)
QUICK = Plan(capacity_requests=160, segments=1, segment_s=5.0, drain_s=12.0)


def mixed_requests(arm: str, tag: str, n: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    classes = [p for p, _ in MIX]
    weights = [w for _, w in MIX]
    return [
        {
            "request_id": f"{arm}-{tag}-{i}",
            "user_id": f"user-{i % 64}",
            "prompt": f"{arm} {tag} item {i}",
            "priority": rng.choices(classes, weights)[0],
            "max_tokens": 16,
        }
        for i in range(n)
    ]


async def measure_capacity(c: SurgeClient, n: int) -> float:
    """Replies/s of a saturated pipeline (batch class, long enough queue to keep batches full)."""
    reqs = [
        {
            "request_id": f"cap-{i}",
            "user_id": f"user-{i % 64}",
            "prompt": f"capacity probe {i}",
            "priority": "batch",
        }
        for i in range(n)
    ]
    await closed_loop(c, reqs[:40], concurrency=40, timeout_s=30)  # warm-up
    res = await closed_loop(c, reqs[40:], concurrency=48, timeout_s=60, desc="priority capacity")
    if not res.replies:
        raise BenchError("capacity probe got no replies")
    return res.throughput


def per_class(requests: list[dict[str, Any]], res: LoadResult, deadlines: dict[str, int]) -> dict[str, Any]:
    prio = {r["request_id"]: r["priority"] for r in requests}
    out: dict[str, Any] = {}
    for cls, _ in MIX:
        sent = [rid for rid, p in prio.items() if p == cls]
        replies = [res.replies[rid] for rid in sent if rid in res.replies]
        ok_lat = [res.latency_ms[r.request_id] for r in replies if r.status == "ok"]
        expired = sum(
            1 for r in replies if r.status != "ok" and r.error and r.error.code == "deadline_exceeded"
        )
        late = sum(1 for x in ok_lat if x > deadlines[cls])
        other_err = sum(
            1 for r in replies if r.status != "ok" and not (r.error and r.error.code == "deadline_exceeded")
        )
        lost = len(sent) - len(replies)
        misses = expired + late + lost
        out[cls] = {
            "sent": len(sent),
            "answered_ok": len(ok_lat),
            "deadline_ms": deadlines[cls],
            "deadline_exceeded": expired,
            "late_ok": late,
            "other_errors": other_err,
            "lost": lost,
            "misses": misses,
            "miss_rate": round(misses / len(sent), 4) if sent else None,
            "latency_ok": latency_summary(ok_lat),
        }
    return out


def run(job: BenchRun) -> int:
    plan = QUICK if job.quick else FULL
    common = {"model": "echo", **ECHO, "dedup_enabled": False, "cache_enabled": False}
    with BenchEnv(job.scenario, broker=job.broker) as env:
        edf = env.deployment("edf", queue_policy="edf", **common)
        fifo = env.deployment("fifo", queue_policy="fifo", **common)
        startup_s = env.wait_ready([edf, fifo])
        s = edf.settings()
        deadlines = {p: int(s.deadline_ms(p) or 0) for p, _ in MIX}

        async def main() -> tuple[float, dict[str, Any]]:
            try:
                clients: dict[str, tuple[BenchDeployment, SurgeClient]] = {
                    "edf": (edf, await edf.client()),
                    "fifo": (fifo, await fifo.client()),
                }
                capacity = await measure_capacity(clients["edf"][1], plan.capacity_requests)
                rate = OVERLOAD * capacity
                n = int(rate * plan.segment_s)
                sent: dict[str, list[dict[str, Any]]] = {a: [] for a in clients}
                results = {a: LoadResult() for a in clients}
                for k in range(plan.segments):
                    for name, (_, c) in clients.items():
                        reqs = mixed_requests(name, f"s{k}", n, seed=k)  # same class sequence in both arms
                        res = await open_loop(
                            c,
                            reqs,
                            rate_per_s=rate,
                            timeout_s=plan.segment_s + 1,
                            drain_s=plan.drain_s,
                            desc=f"priority {name} segment {k + 1}/{plan.segments} @ {rate:.0f}/s",
                        )
                        sent[name].extend(reqs[: res.sent])
                        results[name].merge(res)
                arms = {
                    name: {
                        "offered_rps": round(rate, 1),
                        "sent": results[name].sent,
                        "answered": len(results[name].replies),
                        "classes": per_class(sent[name], results[name], deadlines),
                    }
                    for name in clients
                }
                return capacity, arms
            finally:
                await edf.close()
                await fifo.close()

        capacity, arms = asyncio.run(main())
    rt_edf, rt_fifo = arms["edf"]["classes"]["realtime"], arms["fifo"]["classes"]["realtime"]
    one_full_batch_ms = ECHO["echo_delay_ms"] + ECHO["echo_per_item_ms"] * ECHO["max_batch_size"]
    result = {
        "plan": plan.__dict__,
        "model": {"echo": ECHO, "one_full_batch_ms": one_full_batch_ms},
        "capacity_rps": round(capacity, 1),
        "overload": OVERLOAD,
        "mix": dict(MIX),
        "worker_startup_s": round(startup_s, 1),
        "arms": arms,
        "targets": [
            target("edf realtime p99 ms", rt_edf["latency_ok"]["p99_ms"], "<=", float(deadlines["realtime"])),
            target("edf realtime miss rate", rt_edf["miss_rate"], "<=", 0.003),
            target("fifo realtime miss rate", rt_fifo["miss_rate"], ">=", 0.10),
        ],
        "notes": "latency is the client's send-to-reply time; misses count deadline_exceeded replies, "
        "answers after the deadline and lost requests. Degradation off in both arms.",
    }
    classes = [p for p, _ in MIX]
    p99s = [
        (f"p99 latency ms ({a})", {c: v["classes"][c]["latency_ok"]["p99_ms"] for c in classes})
        for a, v in arms.items()
    ]
    misses = [
        (f"miss rate ({a})", {c: v["classes"][c]["miss_rate"] for c in classes}) for a, v in arms.items()
    ]
    return finish(job, result, p99s + misses)
