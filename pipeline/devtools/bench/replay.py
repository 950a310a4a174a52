"""``surge bench replay``: record demo traffic on a live deployment, replay it, and measure what issue 13
asks (docs/architecture.md, "Replay").

1. A live deployment with the demo's settings (FAQ answerer, caches, merging, rate limits, degradation)
   answers ``surge demo``'s workload at the demo's rate for a while: the recorded history.
2. Real-time probes (a few per second) measure the live p99 without a replay.
3. Replay A of the recorded range, unchanged model and settings, while the same probes run: the speed
   factor (range length over replay time), how many live answers it reproduces (differences by cause),
   and the live p99 while it runs. Live committed offsets and the ends of live topics and changelogs
   are compared before and after.
4. Replay B of the same range: byte-identical outcomes against replay A (determinism).

Targets: speed ≥ 10x real time, ≥ 99.9 % of live answers reproduced, live real-time p99 ≤ 200 ms during
the replay, identical outcomes between two replays, live state unchanged.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from aiokafka import TopicPartition
from aiokafka.admin import AIOKafkaAdminClient

from pipeline.client import SurgeClient
from pipeline.devtools.bench.background import Background, plain_consumer
from pipeline.devtools.bench.common import BENCH_DIR, BenchEnv, BenchRun, latency_summary, progress, target
from pipeline.devtools.bench.report import finish
from pipeline.devtools.demo import workload
from pipeline.devtools.samples import QUESTIONS
from pipeline.records import InferenceReply, now_ms
from pipeline.replay import compare
from pipeline.replay.runner import ReplayOptions, ReplayResult, run_replay


@dataclass(frozen=True)
class Plan:
    model: str
    record_s: float
    rate_per_s: float
    probe_per_s: float
    baseline_s: float


FULL = Plan(model="faq", record_s=180, rate_per_s=20, probe_per_s=4, baseline_s=30)
QUICK = Plan(model="echo", record_s=6, rate_per_s=20, probe_per_s=4, baseline_s=4)


class Probes(Background):
    """Real-time requests to the live deployment at a steady rate; their latencies by phase."""

    def __init__(self, client: SurgeClient, per_s: float) -> None:
        super().__init__()
        self.client, self.per_s = client, per_s
        self.latency: dict[str, list[float]] = {}
        self.errors: dict[str, int] = {}
        self.phase = "baseline"
        self._pending: set[asyncio.Task[None]] = set()

    async def stop(self) -> None:
        """Stop sending, then wait (10 s at most) for the probes still out."""
        await super().stop()
        if self._pending:
            await asyncio.wait(self._pending, timeout=10)

    async def _one(self, i: int, phase: str) -> None:
        req = {
            "request_id": f"probe-{uuid.uuid4().hex[:8]}-{i}",
            "user_id": f"probe-{i % 8}",
            "priority": "realtime",
            "tier": "premium",
            "prompt": QUESTIONS[i % len(QUESTIONS)],
        }
        t0 = time.perf_counter()
        try:
            reply: InferenceReply = await self.client.request(req, timeout_s=10)
        except TimeoutError:
            self.errors[phase] = self.errors.get(phase, 0) + 1
            return
        self.latency.setdefault(phase, []).append((time.perf_counter() - t0) * 1000)
        if reply.status != "ok":
            self.errors[phase] = self.errors.get(phase, 0) + 1

    async def _loop(self) -> None:
        i = 0
        start = time.perf_counter()
        while True:
            delay = start + i / self.per_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            t = asyncio.create_task(self._one(i, self.phase))
            self._pending.add(t)
            t.add_done_callback(self._pending.discard)
            i += 1


async def _live_state(bootstrap: str, app_id: str, prefix: str) -> dict[str, Any]:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        await admin.start()
        committed = await admin.list_consumer_group_offsets(app_id)
        topics = sorted(t for t in await admin.list_topics() if t.startswith((prefix, f"{app_id}-")))
    finally:
        await admin.close()
    consumer = plain_consumer(bootstrap)
    try:
        await consumer.start()
        await consumer.topics()
        ends = {}
        for t in topics:
            if (
                t.endswith("replies")
                or t.endswith("-changelog")
                or t.startswith(f"{prefix}work.")
                or t.endswith("requests")
            ):
                parts = consumer.partitions_for_topic(t) or set()
                got = await consumer.end_offsets([TopicPartition(t, p) for p in parts]) if parts else {}
                ends[t] = sum(got.values())
    finally:
        await consumer.stop()
    return {
        "committed": {f"{tp.topic}/{tp.partition}": m.offset for tp, m in committed.items()},
        "ends": ends,
    }


def run(job: BenchRun) -> int:
    plan = QUICK if job.quick else FULL
    # a broker folder of its own: another benchmark may be running on the shared one
    with BenchEnv(job.scenario, broker=job.broker, bench_dir=BENCH_DIR / "replay") as env:
        live = env.deployment(
            "live", model=plan.model, rate_limit_enabled=True, degrade_enabled=True, replay_nice=10
        )
        startup_s = env.wait_ready([live])
        out_dir = env.run_dir / "replays"

        async def main() -> dict[str, Any]:
            s = live.settings()
            client = await live.client()
            # 1. record
            n = int(plan.record_s * plan.rate_per_s)
            reqs = workload(n, seed=13)
            rng = random.Random(13)
            rng.shuffle(reqs)
            bar = progress(n, "recording")
            from_ms = now_ms() - 1
            t0 = time.perf_counter()
            futs = []
            for i, req in enumerate(reqs):
                delay = t0 + i / plan.rate_per_s - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                fut = await client.submit(req)
                fut.add_done_callback(lambda _: bar.update(1))
                futs.append(fut)
            await client.producer.flush()
            to_ms = now_ms() + 1
            await asyncio.wait(futs, timeout=60)
            bar.close()
            recorded = [f.result() for f in futs if f.done() and not f.cancelled()]
            # 2. live p99 without a replay
            probes = Probes(client, plan.probe_per_s)
            await probes.start()
            await asyncio.sleep(plan.baseline_s)

            async def replay(replay_id: str, quiet: bool) -> ReplayResult:
                """The recorded range replayed once, into a folder of its own."""
                options = ReplayOptions(
                    topic="requests",
                    from_ms=from_ms,
                    to_ms=to_ms,
                    out_dir=out_dir / replay_id,
                    replay_id=replay_id,
                    quiet=quiet,
                )
                return await run_replay(options, s)

            # 3. replay A, with the probes running
            probes.phase = "during_replay"
            a = await replay("a", quiet=False)
            probes.phase = "after"
            await probes.stop()
            await asyncio.sleep(2)  # the live worker commits what it finished
            before = await _live_state(live.bootstrap, s.app_id, s.topic_prefix)
            # 4. replay B, with no live traffic: live state before and after must be equal
            b = await replay("b", quiet=True)
            after = await _live_state(live.bootstrap, s.app_id, s.topic_prefix)
            same = sum(
                1
                for k, r in a.replies.items()
                if k in b.replies
                and compare.outcome(r) == compare.outcome(b.replies[k])
                and r.get("model_version") == b.replies[k].get("model_version")
            )
            await live.close()
            return {
                "recorded": {"sent": n, "answered": len(recorded), "from_ms": from_ms, "to_ms": to_ms},
                "replay_a": compare.public(a.report),
                "replay_b": {
                    k: v
                    for k, v in compare.public(b.report).items()
                    if k in ("counts", "agreement", "replay")
                },
                "determinism": {"joined": len(set(a.replies) & set(b.replies)), "identical_outcomes": same},
                "live_p99": {p: latency_summary(v) for p, v in probes.latency.items()},
                "probe_errors": probes.errors,
                "live_state_unchanged_by_replay_b": before == after,
                "live_state": before,
                "report_png": str(a.plot_path),
            }

        res = asyncio.run(main())
    a = res["replay_a"]
    speed = a["replay"]["speed_factor"]
    agree = a["agreement"]["rate"]
    det = res["determinism"]
    p99_during = (res["live_p99"].get("during_replay") or {}).get("p99_ms")
    p99_base = (res["live_p99"].get("baseline") or {}).get("p99_ms")
    identical = det["identical_outcomes"] / max(1, det["joined"])
    result = {
        "plan": plan.__dict__,
        "live_worker_startup_s": round(startup_s, 1),
        **res,
        "targets": [
            target("replay speed, x real time", speed, ">=", 10),
            target("live answers reproduced", agree, ">=", 0.999),
            target(
                "live answers a replay can reproduce (not merged, similar, templated, late), reproduced",
                a["agreement"]["comparable_rate"],
                ">=",
                0.999,
            ),
            target("identical outcomes, replay A vs B", identical, ">=", 1.0),
            target("live real-time p99 during the replay, ms", p99_during, "<=", 200),
            target(
                "live state unchanged by a replay",
                1.0 if res["live_state_unchanged_by_replay_b"] else 0.0,
                ">=",
                1,
            ),
        ],
    }
    jp = Path(job.json_path) if job.json_path else None
    if jp is not None:
        jp.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(res["report_png"], jp.with_name(jp.stem + "-report.png"))
    return finish(
        job,
        result,
        [
            ("x real time", {"replay A": speed, "replay B": res["replay_b"]["replay"]["speed_factor"]}),
            ("share", {"reproduced": agree, "identical A/B": identical}),
            ("live real-time p99, ms", {"no replay": p99_base, "during replay": p99_during}),
        ],
    )
