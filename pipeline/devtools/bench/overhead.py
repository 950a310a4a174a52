"""``surge bench overhead``: the pipeline's cost, with an echo model that costs nothing.

Arms, on the same broker, driven by the same client:

* ``surge``: a worker (intake → work topic → inference → reply), echo model, caches and merging off;
* ``plain``: :mod:`pipeline.devtools.bench.plain_loop`, an aiokafka consume → echo → produce → commit loop.

Throughput: closed loop at high concurrency, rounds interleaved (surge, plain, surge, plain, ...).
Added latency: p50 at concurrency 1 (no queueing), surge minus plain. Target: surge throughput at
least 50% of the plain loop's.
"""

from __future__ import annotations

import asyncio
import sys
from dataclasses import dataclass
from typing import Any

from pipeline.client import SurgeClient
from pipeline.devtools.bench.common import (
    BenchDeployment,
    BenchEnv,
    BenchRun,
    HelperProcess,
    latency_summary,
    long_deadlines,
    ratio,
    target,
)
from pipeline.devtools.bench.load import LoadResult, closed_loop
from pipeline.devtools.bench.report import finish


@dataclass(frozen=True)
class Plan:
    rounds: int
    per_round: int
    concurrency: int
    probe: int
    timeout_s: float


FULL = Plan(rounds=3, per_round=3000, concurrency=256, probe=200, timeout_s=60)
QUICK = Plan(rounds=1, per_round=300, concurrency=64, probe=30, timeout_s=30)


def requests(arm: str, tag: str, n: int) -> list[dict[str, Any]]:
    """``n`` distinct small requests from 32 users."""
    return [
        {
            "request_id": f"{arm}-{tag}-{i}",
            "user_id": f"user-{i % 32}",
            "prompt": f"echo this short line {tag} {i}",
        }
        for i in range(n)
    ]


async def _measure(arms: dict[str, tuple[BenchDeployment, SurgeClient]], plan: Plan) -> dict[str, Any]:
    for name, (_, c) in arms.items():  # warm-up: connections, JIT-free paths, consumer positions
        await closed_loop(c, requests(name, "warm", 50), concurrency=16, timeout_s=30)
    throughput: dict[str, LoadResult] = {n: LoadResult() for n in arms}
    probes: dict[str, LoadResult] = {n: LoadResult() for n in arms}
    for r in range(plan.rounds):
        for name, (_, c) in arms.items():
            res = await closed_loop(
                c,
                requests(name, f"t{r}", plan.per_round),
                concurrency=plan.concurrency,
                timeout_s=plan.timeout_s,
                desc=f"overhead {name} round {r + 1}/{plan.rounds}",
            )
            throughput[name].merge(res)
        for name, (_, c) in arms.items():
            n = max(1, plan.probe // plan.rounds)
            res = await closed_loop(
                c,
                requests(name, f"p{r}", n),
                concurrency=1,
                timeout_s=30,
                desc=f"overhead {name} latency probe",
            )
            probes[name].merge(res)
    out: dict[str, Any] = {}
    for name in arms:
        t, p = throughput[name], probes[name]
        t.require_replies(name)
        out[name] = {
            **t.counts(),
            "throughput_rps": round(t.throughput, 1),
            "elapsed_s": round(t.elapsed_s, 2),
            "latency_loaded": latency_summary(t.ok_latencies()),
            "latency_idle": latency_summary(p.ok_latencies()),
        }
    return out


def run(job: BenchRun) -> int:
    plan = QUICK if job.quick else FULL
    with BenchEnv(job.scenario, broker=job.broker) as env:
        surge = env.deployment(
            "surge", model="echo", dedup_enabled=False, cache_enabled=False, **long_deadlines(60_000)
        )
        plain = env.deployment("plain", model="echo")
        startup_s = env.wait_ready([surge])

        async def main() -> dict[str, Any]:
            sc = await surge.client()
            pc = await plain.client()  # creates the plain arm's topics before its loop subscribes
            argv = [sys.executable, "-m", "pipeline.devtools.bench.plain_loop", "--bootstrap", env.bootstrap]
            argv += ["--topic", plain.topics.requests, "--group", plain.env["SURGE_APP_ID"]]
            argv += ["--reply-to", plain.topics.replies]
            helper = HelperProcess(argv, env.run_dir / "plain-loop.log").start(env)
            await asyncio.to_thread(helper.wait_ready, "plain loop ready", 60)
            try:
                return await _measure({"surge": (surge, sc), "plain": (plain, pc)}, plan)
            finally:
                await surge.close()
                await plain.close()

        arms = asyncio.run(main())
    tput = ratio(arms["surge"]["throughput_rps"], arms["plain"]["throughput_rps"])
    s_p50, p_p50 = arms["surge"]["latency_idle"]["p50_ms"], arms["plain"]["latency_idle"]["p50_ms"]
    added = round(s_p50 - p_p50, 1) if s_p50 is not None and p_p50 is not None else None
    result = {
        "plan": plan.__dict__,
        "worker_startup_s": round(startup_s, 1),
        "arms": arms,
        "throughput_ratio_surge_vs_plain": tput,
        "added_p50_latency_ms": added,
        "targets": [target("throughput surge/plain", tput, ">=", 0.5)],
        "notes": "surge makes three broker hops per request (requests → work.<class> → replies) where the "
        "plain loop makes one; idle latency includes surge's batch window (max_wait_ms).",
    }
    return finish(
        job,
        result,
        [
            ("requests/s", {a: v["throughput_rps"] for a, v in arms.items()}),
            ("p50 latency at concurrency 1, ms", {a: v["latency_idle"]["p50_ms"] for a, v in arms.items()}),
        ],
    )
