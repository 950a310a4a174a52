"""``surge bench gateway``: the HTTP gateway at 500 concurrent connections against a thread-per-request server.

Arms, both serving ``POST /v1/chat/completions`` on 127.0.0.1 with the FAQ answerer:

* ``surge``: ``surge gateway`` (aiohttp → Kafka → a surge worker, micro-batched) in its own process;
* ``sync``: :mod:`pipeline.devtools.bench.sync_server`, a ``ThreadingHTTPServer`` calling the model
  synchronously once per request (the conventional design).

The load generator is an aiohttp client with a connector limit of 500 and 500 concurrent senders,
bounded by a request count and a time limit, rounds interleaved. Prompts are distinct (numbers
differ, so nothing is merged or cached). Target: at least 3x the requests/s with a lower p99.
"""

from __future__ import annotations

import asyncio
import sys
import time
import urllib.request
from dataclasses import dataclass
from typing import Any

from pipeline.devtools.bench.common import (
    BANKING_WORDS,
    BASE_ENV,
    BenchDeployment,
    BenchEnv,
    BenchError,
    BenchRun,
    HelperProcess,
    latency_summary,
    long_deadlines,
    progress,
    ratio,
    target,
)
from pipeline.devtools.bench.report import finish
from pipeline.devtools.broker import free_port


@dataclass(frozen=True)
class Plan:
    connections: int
    rounds: int
    per_round: int
    round_s: float


FULL = Plan(connections=500, rounds=2, per_round=4000, round_s=30.0)
QUICK = Plan(connections=100, rounds=1, per_round=120, round_s=6.0)


@dataclass
class HttpResult:
    latency_ms: list[float]
    statuses: dict[int, int]
    elapsed_s: float
    error_samples: list[str]

    @property
    def ok(self) -> int:
        return self.statuses.get(200, 0)


def body(arm: str, i: int) -> dict[str, Any]:
    t = BANKING_WORDS
    text = (
        f"Question {i} from {arm}: how do I check the {t[i % 12]} {t[(i // 12) % 12]} "
        f"on order {i * 7919 % 1000003}?"
    )
    return {
        "model": "faq",
        "messages": [{"role": "user", "content": text}],
        "max_tokens": 64,
        "user": f"u{i % 500}",
    }


async def http_load(url: str, arm: str, tag: str, plan: Plan, bar: Any) -> HttpResult:
    """``plan.per_round`` POSTs from ``plan.connections`` concurrent senders, stopped at ``plan.round_s``."""
    import aiohttp

    lat: list[float] = []
    statuses: dict[int, int] = {}
    errors: list[str] = []
    counter = iter(range(plan.per_round))
    t_start = time.perf_counter()
    stop_at = t_start + plan.round_s
    timeout = aiohttp.ClientTimeout(total=plan.round_s + 30)
    connector = aiohttp.TCPConnector(limit=plan.connections, limit_per_host=plan.connections)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def sender() -> None:
            for i in counter:
                if time.perf_counter() > stop_at:
                    return
                t0 = time.perf_counter()
                try:
                    async with session.post(url, json=body(f"{arm}{tag}", i)) as resp:
                        data = await resp.read()
                        status = resp.status
                    if status != 200 and len(errors) < 3:
                        errors.append(f"{status}: {data[:300].decode(errors='replace')}")
                except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                    status = 0  # connection error or timeout
                    if len(errors) < 3:
                        errors.append(f"0: {exc!r}"[:300])
                statuses[status] = statuses.get(status, 0) + 1
                if status == 200:
                    lat.append((time.perf_counter() - t0) * 1000)
                bar.update(1)

        await asyncio.gather(*(sender() for _ in range(plan.connections)))
    return HttpResult(lat, statuses, time.perf_counter() - t_start, errors)


def _wait_http_ready(url: str, timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise BenchError(f"{url} not ready after {timeout_s:.0f} s")


def run(job: BenchRun) -> int:
    try:
        import pipeline.gateway  # noqa: F401
    except ImportError as exc:
        raise BenchError(
            f"the gateway module cannot be imported ({exc}); the gateway benchmark needs it"
        ) from exc
    plan = QUICK if job.quick else FULL
    with BenchEnv(job.scenario, broker=job.broker) as env:
        d = env.deployment(
            # distinct prompts: nothing to merge or cache, so both are off and only batching is compared
            "surge",
            model="faq",
            dedup_enabled=False,
            cache_enabled=False,
            gateway_timeout_ms=120_000,
            queue_limit_per_class=4096,
            max_batch_size=128,  # the FAQ answerer's own batch cap: 500 connections fill it
            **long_deadlines(60_000),
        )
        gw_port, sync_port = free_port(), free_port()
        sync_argv = ["-m", "pipeline.devtools.bench.sync_server", "--port", str(sync_port), "--model", "faq"]
        sync = HelperProcess(
            [sys.executable, *sync_argv], env.run_dir / "sync-server.log", env=dict(BASE_ENV)
        ).start(env)
        startup_s = env.wait_ready([d])
        asyncio.run(_ensure_topics(d))
        gw_argv = [sys.executable, "-m", "pipeline.cli", "gateway", "--port", str(gw_port)]
        gw = HelperProcess(gw_argv, env.run_dir / "gateway.log", env=d.env).start(env)
        gw.wait_ready("surge gateway ready", 120)
        sync.wait_ready("sync server ready", 120)
        urls = {
            "surge": f"http://127.0.0.1:{gw_port}/v1/chat/completions",
            "sync": f"http://127.0.0.1:{sync_port}/v1/chat/completions",
        }
        _wait_http_ready(f"http://127.0.0.1:{gw_port}/readyz")
        _wait_http_ready(f"http://127.0.0.1:{sync_port}/readyz")

        async def main() -> dict[str, dict[str, Any]]:
            warm = Plan(connections=10, rounds=1, per_round=20, round_s=30)
            for name, url in urls.items():
                with progress(warm.per_round, f"gateway {name} warm-up") as bar:
                    await http_load(url, name, "warm", warm, bar)
            acc: dict[str, list[HttpResult]] = {n: [] for n in urls}
            for r in range(plan.rounds):
                for name, url in urls.items():
                    with progress(plan.per_round, f"gateway {name} round {r + 1}/{plan.rounds}") as bar:
                        acc[name].append(await http_load(url, name, f"r{r}", plan, bar))
            out: dict[str, dict[str, Any]] = {}
            for name, parts in acc.items():
                lat = [x for p in parts for x in p.latency_ms]
                statuses: dict[int, int] = {}
                for p in parts:
                    for s, n in p.statuses.items():
                        statuses[s] = statuses.get(s, 0) + n
                elapsed = sum(p.elapsed_s for p in parts)
                out[name] = {
                    "requests": sum(statuses.values()),
                    "ok": statuses.get(200, 0),
                    "statuses": {str(k): v for k, v in sorted(statuses.items())},
                    "elapsed_s": round(elapsed, 2),
                    "requests_per_s": round(statuses.get(200, 0) / elapsed, 1),
                    "latency_ok": latency_summary(lat),
                    "error_samples": [e for p in parts for e in p.error_samples][:3],
                }
            return out

        arms = asyncio.run(main())
    rps = ratio(arms["surge"]["requests_per_s"], arms["sync"]["requests_per_s"])
    p99s, p99y = arms["surge"]["latency_ok"]["p99_ms"], arms["sync"]["latency_ok"]["p99_ms"]
    result = {
        "plan": plan.__dict__,
        "worker_startup_s": round(startup_s, 1),
        "arms": arms,
        "rps_ratio_surge_vs_sync": rps,
        "p99_ratio_surge_vs_sync": ratio(p99s, p99y),
        "targets": [
            target("requests/s surge/sync", rps, ">=", 3.0),
            target("p99 surge/sync (lower is better)", ratio(p99s, p99y), "<=", 1.0),
        ],
        "notes": "both arms use the FAQ answerer with one torch thread; requests/s counts HTTP 200 replies "
        "over the time the senders ran; status 0 = connection error or client timeout. Merging and caching "
        "are off in the surge arm: every prompt is distinct, so neither could serve anything, and the "
        "comparison is micro-batching behind an async gateway against one model call per thread.",
    }
    return finish(
        job,
        result,
        [
            ("requests/s", {a: v["requests_per_s"] for a, v in arms.items()}),
            ("p99 latency, ms", {a: v["latency_ok"]["p99_ms"] for a, v in arms.items()}),
            ("p99.9 latency, ms", {a: v["latency_ok"]["p999_ms"] for a, v in arms.items()}),
        ],
    )


async def _ensure_topics(d: BenchDeployment) -> None:
    from pipeline.admin import ensure_topics

    await ensure_topics(d.settings())
