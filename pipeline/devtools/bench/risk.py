"""``surge bench risk``: the risk path on the embedded broker (docs/architecture.md, "Risk: operation").

One deployment, one ``surge worker --role risk``, the simulator's stream (5 % of events out of order
within the grace period, 0.1 % late), in phases:

1. **steady**: 1,000 events/s for 60 s (open loop: events are sent on schedule, whatever the backlog);
2. **burst**: 3x that for 30 s;
3. **capacity**: a backlog produced as fast as the client can, drained by the one worker: its
   sustained events/s;
4. **within capacity**: 30 % of that rate for 30 s: the latency when the worker keeps up (small
   batches cost more per event than a drained backlog's big ones);
5. **crash**: the same rate for 20 s, the worker SIGKILLed 8 s in; a new worker takes over its local
   store (tables changed since the last flush come from the changelogs) and carries on.

Latency is produce to decision, from the decision records (``decided_ms - produced_ms``, both taken
on this machine). Afterwards every decision (repeats after the crash included) is checked against
the brute-force recomputation from the events each stage read (:mod:`pipeline.devtools.bench.risk_check`),
every event must have a decision, and repeats must be identical. Model quality: recall at a 1 %
false-positive rate on the simulated days after the packaged model's training period (the same world,
new days), the model against the default rules alone. ``--quick`` runs every phase small.
"""

from __future__ import annotations

import asyncio
import dataclasses
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from pipeline.client import partitions_of
from pipeline.devtools.bench.background import Background, plain_consumer
from pipeline.devtools.bench.common import (
    BENCH_DIR,
    BenchEnv,
    BenchError,
    BenchRun,
    latency_summary,
    metric_delta,
    ratio,
    scrape,
    target,
)
from pipeline.devtools.bench.report import finish
from pipeline.devtools.bench.risk_check import check_decisions, read_arrivals
from pipeline.risk import jsonio
from pipeline.risk.records import RiskDecision
from pipeline.risk.simulate import SimConfig, as_event, disorder, simulate
from pipeline.riskops import RISK_READY

if TYPE_CHECKING:
    from aiokafka import AIOKafkaProducer


@dataclasses.dataclass(frozen=True)
class Plan:
    rate: float
    steady_s: float
    burst_factor: float
    burst_s: float
    capacity_events: int
    #: the within-capacity and crash phases run at this share of the measured capacity
    within_share: float
    within_s: float
    crash_s: float
    kill_at_s: float
    #: events simulated for those two phases: enough for this rate
    max_within_rate: float
    eval_customers: int
    eval_days: float
    warm_days: float


FULL = Plan(
    rate=1000,
    steady_s=60,
    burst_factor=3,
    burst_s=30,
    capacity_events=20_000,
    within_share=0.3,
    within_s=30,
    crash_s=20,
    kill_at_s=8,
    max_within_rate=1500,
    eval_customers=2000,
    eval_days=7,
    warm_days=3,
)
#: the same phases, each small
QUICK = dataclasses.replace(
    FULL,
    rate=150,
    steady_s=4,
    burst_s=2,
    capacity_events=1_500,
    within_s=4,
    crash_s=5,
    kill_at_s=2,
    max_within_rate=400,
    eval_customers=400,
    eval_days=3,
    warm_days=2,
)
GRACE_MS = 5_000


def stream(n: int, seed: int = 101) -> list[dict[str, Any]]:
    """``n`` simulated events in send order, 5 % out of order within the grace period, 0.1 % late."""
    customers = max(200, min(6000, n // 30))
    days = max(1.0, n / (customers * 5.0))
    events = [
        as_event(e) for e in simulate(SimConfig(customers=customers, days=days, seed=seed, fraud_scale=2))
    ]
    if len(events) < n:
        raise BenchError(f"the simulation gave {len(events)} events, {n} needed")
    return disorder(events[:n], share=0.05, late_share=0.001, grace_ms=GRACE_MS, seed=seed)


class Collector(Background):
    """Reads every decision (raw) with its arrival time; parsed after the run."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        super().__init__()
        self.topic = topic
        self.consumer = plain_consumer(bootstrap, auto_offset_reset="earliest", fetch_max_wait_ms=20)
        self.raw: list[tuple[bytes, float]] = []

    async def start(self) -> None:
        from aiokafka import TopicPartition

        await self.consumer.start()
        tps = [TopicPartition(self.topic, p) for p in await partitions_of(self.consumer, self.topic, 100)]
        self.consumer.assign(tps)
        await self.consumer.seek_to_beginning(*tps)
        await super().start()

    async def _loop(self) -> None:
        while True:
            batch = await self.consumer.getmany(timeout_ms=100)
            now = time.monotonic()
            for records in batch.values():
                self.raw.extend((r.value, now) for r in records)

    async def stop(self) -> None:
        await super().stop()
        await self.consumer.stop()

    def decisions(self) -> list[RiskDecision]:
        return [RiskDecision.model_validate_json(v) for v, _ in self.raw]


async def send_events(
    producer: AIOKafkaProducer,
    topic: str,
    events: list[dict[str, Any]],
    rate: float | None,
    at: dict[int, Callable[[], Awaitable[None]]] | None = None,
) -> float:
    """Send ``events`` at ``rate`` per second (None: as fast as possible); seconds taken. ``at``: callbacks
    to run after sending the event of that index (the crash). The events are encoded before the clock
    starts: the load generator shares the machine's cores with the worker it measures."""
    records = [(e["account"].encode(), jsonio.dumps(e)) for e in events]
    start = time.monotonic()
    for i, (key, value) in enumerate(records):
        if rate is not None:
            delay = start + i / rate - time.monotonic()
            if delay > 0.002:
                await asyncio.sleep(delay)
        await producer.send(topic, value=value, key=key)
        if at and i in at:
            await producer.flush()
            await at[i]()
    await producer.flush()
    return time.monotonic() - start


async def wait_for(collector: Collector, ids: set[str], timeout_s: float, what: str) -> float:
    """Wait until every id in ``ids`` has a decision; seconds waited."""
    t0 = time.monotonic()
    have: set[str] = set()
    seen = 0
    while time.monotonic() - t0 < timeout_s:
        new = collector.raw[seen:]
        seen += len(new)
        # orjson: about a sixth of the standard library's time per decision, on the worker's cores
        have |= {jsonio.loads(v)["event_id"] for v, _ in new}
        if ids <= have:
            return time.monotonic() - t0
        await asyncio.sleep(0.2)
    raise BenchError(
        f"{what}: {len(ids - have)} of {len(ids)} events without a decision after {timeout_s:.0f} s"
    )


def patience(n: int) -> float:
    """How long to wait for ``n`` decisions before calling the run failed: a slow worker on a busy
    machine still finishes (its backlog shows as latency), a stuck one does not."""
    return 300 + n / 25


def _phase(
    decisions: dict[str, RiskDecision], ids: list[str], seconds: float, wall_s: float
) -> dict[str, Any]:
    timings = [decisions[i].timings for i in ids if i in decisions]
    lat = [t.produce_to_decision_ms for t in timings if t is not None]
    return {
        "events": len(ids),
        "offered_rate": round(len(ids) / seconds, 1) if seconds else None,
        "decided_per_s": round(len(ids) / wall_s, 1) if wall_s else None,
        "latency": latency_summary(lat),
    }


def evaluate_model(plan: Plan) -> dict[str, Any]:
    """Recall at 1 % false positives of the packaged model and of the default rules on the period after
    its training period, in the world it was trained on (``surge risk evaluate`` draws more periods)."""
    from models.risk import RiskModel, evaluate_later_periods

    model = RiskModel.load()
    seed = int((model.meta.get("sim_config") or {}).get("seed", 7))
    res = evaluate_later_periods(
        model,
        [seed],
        customers=plan.eval_customers,
        days=plan.eval_days,
        warm_days=plan.warm_days,
        progress=False,
    )
    report: dict[str, Any] = res["periods"][0]
    report["model_version"] = res["model_version"]
    return report


def run(job: BenchRun) -> int:
    plan = QUICK if job.quick else FULL
    n_steady = int(plan.rate * plan.steady_s)
    n_burst = int(plan.rate * plan.burst_factor * plan.burst_s)
    n_later = int(plan.max_within_rate * (plan.within_s + plan.crash_s))
    total = n_steady + n_burst + plan.capacity_events + n_later
    print(f"simulating {total} events ...", file=sys.stderr)
    events = stream(total)
    steady = events[:n_steady]
    burst = events[n_steady : n_steady + n_burst]
    capacity = events[n_steady + n_burst : n_steady + n_burst + plan.capacity_events]
    later = events[n_steady + n_burst + plan.capacity_events :]
    # a broker of its own (.surge-bench/risk/kafka): other scenarios restart theirs, and this one runs long
    with BenchEnv(job.scenario, broker=job.broker, bench_dir=BENCH_DIR / "risk") as env:
        d = env.deployment("risk", role="risk", risk_grace_ms=GRACE_MS)
        settings = d.settings()

        async def main() -> dict[str, Any]:
            from aiokafka import AIOKafkaProducer

            from agents.risk import ensure_risk_topics, feature_config

            await ensure_risk_topics(settings)
            w = d.worker(role="risk", wait=False)
            t0 = time.monotonic()
            await asyncio.to_thread(w.wait_ready, RISK_READY, 240)
            startup_s = time.monotonic() - t0
            collector = Collector(env.bootstrap, d.topics.risk_decisions)
            await collector.start()
            producer = AIOKafkaProducer(bootstrap_servers=env.bootstrap, acks="all", linger_ms=2)
            await producer.start()
            topic = d.topics.risk_events
            out: dict[str, Any] = {"worker_startup_s": round(startup_s, 1)}
            try:
                warm = stream(300, seed=7)
                for e in warm:
                    e["event_id"] = "warm-" + e["event_id"]
                await send_events(producer, topic, warm, 300)
                await wait_for(collector, {e["event_id"] for e in warm}, 120, "warm-up")
                phases: dict[str, tuple[list[str], float, float]] = {}

                async def run_phase(
                    name: str,
                    evs: list[dict[str, Any]],
                    rate: float | None,
                    what: str | None = None,
                    at: dict[int, Callable[[], Awaitable[None]]] | None = None,
                ) -> None:
                    """Send ``evs``, wait for all their decisions (``what`` names the phase if they do
                    not come); ``phases[name]``: the ids, seconds sending, seconds until all decided."""
                    t = time.monotonic()
                    sent_s = await send_events(producer, topic, evs, rate, at=at)
                    await wait_for(collector, {e["event_id"] for e in evs}, patience(len(evs)), what or name)
                    phases[name] = ([e["event_id"] for e in evs], sent_s, time.monotonic() - t)

                for name, evs, rate in (
                    ("steady", steady, plan.rate),
                    ("burst", burst, plan.rate * plan.burst_factor),
                ):
                    print(f"risk bench: {name}, {len(evs)} events at {rate:g}/s", file=sys.stderr)
                    await run_phase(name, evs, rate)
                print(f"risk bench: capacity, {len(capacity)} events as fast as possible", file=sys.stderr)
                m0 = scrape(w.metrics())
                await run_phase("capacity", capacity, None)
                m1 = scrape(w.metrics())

                rate = max(
                    1.0, min(plan.max_within_rate, plan.within_share * len(capacity) / phases["capacity"][2])
                )
                within = later[: int(rate * plan.within_s)]
                crash = later[len(within) : len(within) + int(rate * plan.crash_s)]
                print(f"risk bench: within capacity, {len(within)} events at {rate:.0f}/s", file=sys.stderr)
                await run_phase("within_capacity", within, rate, what="within")

                print(
                    f"risk bench: crash, {len(crash)} events at {rate:.0f}/s, "
                    f"SIGKILL after {plan.kill_at_s:g} s",
                    file=sys.stderr,
                )
                kill_index = int(rate * plan.kill_at_s)
                restart: dict[str, float] = {}

                async def kill_and_restart() -> None:
                    w.kill()  # the local store stays: a plain crash (tests/test_risk_integration.py deletes it)
                    restart["killed"] = time.monotonic()
                    w2 = d.worker(role="risk", wait=False)
                    await asyncio.to_thread(w2.wait_ready, RISK_READY, 240)
                    restart["ready"] = time.monotonic()

                await run_phase("crash", crash, rate, at={kill_index: kill_and_restart})
                await asyncio.sleep(3)  # repeats of decisions made just before the kill
                m2 = scrape(d.workers[-1].metrics())
                print("risk bench: reading the topics for the brute-force check ...", file=sys.stderr)
                arrivals = await read_arrivals(settings)
            finally:
                await producer.stop()
                await collector.stop()
            all_decisions = collector.decisions()
            first: dict[str, RiskDecision] = {}
            for dec in all_decisions:
                first.setdefault(dec.event_id, dec)
            sent_ids = [e["event_id"] for e in (*steady, *burst, *capacity, *within, *crash, *warm)]
            print(f"risk bench: checking {len(all_decisions)} decisions ...", file=sys.stderr)
            out["check"] = check_decisions(arrivals, all_decisions, feature_config(settings), sent_ids)
            for name, (ids, sent_s, wall_s) in phases.items():
                out[name] = _phase(first, ids, sent_s, wall_s)
            out["capacity"]["events_per_s_per_worker"] = out["capacity"]["decided_per_s"]
            out["crash"]["restart_s"] = round(restart["ready"] - restart["killed"], 1) if restart else None
            hits = metric_delta(m0, m1, "surge_risk_feature_cache_total", result="hit")
            reads = metric_delta(m0, m1, "surge_risk_feature_cache_total")
            out["feature_cache_hit_share"] = round(hits / reads, 4) if reads > 0 else None
            out["late_events_after_restart"] = m2.get(("surge_risk_late_events_total", ()))
            outcomes: dict[str, int] = {}
            for dec in first.values():
                outcomes[dec.decision] = outcomes.get(dec.decision, 0) + 1
            out["decisions_by_outcome"] = outcomes
            return out

        arms = asyncio.run(main())
    print("risk bench: model against the rules on a later simulated period ...", file=sys.stderr)
    quality = evaluate_model(plan)
    chk = arms["check"]
    p99_steady = arms["steady"]["latency"]["p99_ms"]
    p99_burst = arms["burst"]["latency"]["p99_ms"]
    cap = arms["capacity"]["events_per_s_per_worker"]
    recall_ratio = ratio(quality["model"]["recall"], quality["rules"]["recall"])
    result = {
        "plan": dataclasses.asdict(plan),
        **arms,
        "model_quality": quality,
        "targets": [
            target(f"p99 produce-to-decision at {plan.rate:g}/s", p99_steady, "<=", 100.0, "ms"),
            target(
                f"p99 produce-to-decision at {plan.rate * plan.burst_factor:g}/s",
                p99_burst,
                "<=",
                200.0,
                "ms",
            ),
            target("sustained events/s per worker", cap, ">=", 2000.0),
            target(
                "decisions whose features differ from the brute force", chk["mismatched_decisions"], "<=", 0
            ),
            target("events without a decision", chk["missing"], "<=", 0),
            target("repeated decisions that differ", chk["repeats_differing"], "<=", 0),
            target("model recall / rules recall at 1% FPR", recall_ratio, ">=", 2.0),
        ],
        "notes": "latency is decided_ms - produced_ms of each event's first decision. Every phase runs open "
        "loop: above the worker's capacity the backlog grows and shows as latency. The within-capacity "
        "and crash phases run at 30 % of the capacity measured before them.",
    }
    within = arms["within_capacity"]["latency"]
    return finish(
        job,
        result,
        [
            (
                "p99 produce-to-decision, ms",
                {"steady": p99_steady, "burst": p99_burst, "crash": arms["crash"]["latency"]["p99_ms"]},
            ),
            ("within capacity, ms", {"p50": within["p50_ms"], "p99": within["p99_ms"]}),
            (
                "events/s",
                {
                    "offered steady": arms["steady"]["offered_rate"],
                    "offered burst": arms["burst"]["offered_rate"],
                    "worker capacity": cap,
                },
            ),
            ("recall at 1% FPR", {"model": quality["model"]["recall"], "rules": quality["rules"]["recall"]}),
            (
                "decisions",
                {
                    "checked": chk["decisions_checked"],
                    "feature mismatches": chk["mismatched_decisions"],
                    "missing": chk["missing"],
                    "repeats": chk["repeated_decisions"],
                },
            ),
        ],
    )
