"""One risk worker through three phases, with its garbage-collection pauses: an A/B of two checkouts.

``python -m pipeline.devtools.risk_phases [--pre N] [--capacity N] [--low N] [--rate R] [--simulate N]
[--workers N] [--escalate] [--json P]``
starts a broker and one ``surge worker --role risk`` (or ``--workers`` of them) and sends ``surge bench risk``'s simulated stream:

1. ``--pre`` events as a backlog, waited for: the entity state a worker holds after a while;
2. ``--capacity`` events as fast as possible: the events/s it drains;
3. ``--low`` events at ``--rate``/s: produce-to-decision p50/p90/p99 when it keeps up.

``--escalate`` also starts a request-path worker (the echo model, whose answers name no decision, so
every escalated event keeps its local decision after the full round trip) and turns escalation on
(docs/architecture.md, "Risk: escalation"): phase 3 then reports the escalated events' latency apart.

It prints one JSON line (``RESULT {...}``) with those numbers and the worker's full (generation 2)
collections, counted and timed by ``surge_gc_pause_seconds``, during phase 3 and in all. To compare two
versions of the code, run it in each checkout (``git worktree add``), alternately, from that checkout's
folder (its ``pipeline`` is the one imported, by the worker too); docs/results/log.md, "What limits
the risk worker", gives such a run (docs/architecture.md, "Risk: features"). To compare two values of a setting,
run it with each in the environment (``SURGE_RISK_BATCHES_IN_FLIGHT=8``): the worker inherits it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from pipeline.devtools.bench import risk as rb
from pipeline.devtools.bench.common import BENCH_DIR, BenchEnv
from pipeline.devtools.broker import EmbeddedKafka
from pipeline.devtools.deployment import Samples
from pipeline.metrics import scrape
from pipeline.risk.records import RiskDecision


def _gc2(samples: Samples) -> tuple[float, float]:
    """(count, seconds) of the worker's generation-2 collections so far."""
    key = (("generation", "2"),)
    return (
        samples.get(("surge_gc_pause_seconds_count", key), 0.0),
        samples.get(("surge_gc_pause_seconds_sum", key), 0.0),
    )


def _ms(decision: RiskDecision) -> float:
    """A decision's produce-to-decision time, ms (decisions with timings only)."""
    assert decision.timings is not None
    return float(decision.timings.produce_to_decision_ms)


def _quantile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q))]


def run_phases(
    pre: int,
    capacity: int,
    low: int,
    rate: float,
    broker: EmbeddedKafka | None = None,
    simulate: int | None = None,
    workers: int = 1,
    escalate: bool = False,
) -> dict[str, Any]:
    """The three phases on a fresh deployment (and a broker of its own unless ``broker`` is given).
    ``simulate``: events the stream is simulated for (its customers and days grow with it), the
    phases taking the first ones; default just enough."""
    from pipeline.riskops import RISK_READY

    total = max(simulate or 0, pre + capacity + low)
    print(f"simulating {total} events ...", file=sys.stderr)
    events = rb.stream(total)
    phases = events[:pre], events[pre : pre + capacity], events[pre + capacity : pre + capacity + low]
    with BenchEnv("risk-phases", broker=broker, bench_dir=BENCH_DIR / "risk-phases") as env:
        extra: dict[str, object] = {}
        if escalate:
            import secrets

            extra = {"risk_escalation_enabled": True, "risk_escalation_key": secrets.token_hex(16)}
        d = env.deployment("risk", role="risk", risk_grace_ms=rb.GRACE_MS, **extra)
        settings = d.settings()

        async def main() -> dict[str, Any]:
            from aiokafka import AIOKafkaProducer

            from agents.risk import ensure_risk_topics

            await ensure_risk_topics(settings)
            if escalate:  # the request path the escalations go to
                d.worker(
                    role="all", model="echo", worker_id="requests", data_dir=str(d.tmp / "data-requests")
                )
            started = [
                d.worker(role="risk", wait=False, worker_id=f"w{i}", data_dir=str(d.tmp / f"data-w{i}"))
                for i in range(workers)
            ]
            for one in started:
                await asyncio.to_thread(one.wait_ready, RISK_READY, 240)
            w = started[0]
            collector = rb.Collector(env.bootstrap, d.topics.risk_decisions)
            await collector.start()
            producer = AIOKafkaProducer(bootstrap_servers=env.bootstrap, acks="all", linger_ms=2)
            await producer.start()
            topic = d.topics.risk_events
            try:
                seconds = []
                for name, evs, at in zip(("pre", "capacity", "low"), phases, (None, None, rate), strict=True):
                    if name == "low":
                        gc_before = _gc2(scrape(w.metrics()))
                        if workers > 1:  # every worker's share of the partitions settled
                            await asyncio.sleep(1)
                    print(f"risk phases: {name}, {len(evs)} events", file=sys.stderr)
                    t = time.monotonic()
                    await rb.send_events(producer, topic, evs, at)
                    await rb.wait_for(collector, {e["event_id"] for e in evs}, rb.patience(len(evs)), name)
                    seconds.append(time.monotonic() - t)
                gc_after = _gc2(scrape(w.metrics()))
                ids = {e["event_id"] for e in phases[2]}
                low_decisions = [
                    x for x in collector.decisions() if x.timings is not None and x.event_id in ids
                ]
                lat = [_ms(x) for x in low_decisions]
                escalated = [x for x in low_decisions if x.escalation is not None]
                esc_lat = [_ms(x) for x in escalated]
                rest_lat = [_ms(x) for x in low_decisions if x.escalation is None]
                outcomes = Counter(x.escalation.outcome for x in escalated if x.escalation is not None)
            finally:
                await producer.stop()
                await collector.stop()
            return {
                "workers": workers,
                "simulated": total,
                "pre": pre,
                "capacity_events": capacity,
                "capacity_events_per_s": round(capacity / seconds[1], 1) if capacity else None,
                "low_events": low,
                "low_decided": len(lat),
                "low_rate": rate,
                "low_seconds": round(seconds[2], 1),
                **{f"low_p{int(q * 100)}_ms": _quantile(lat, q) for q in (0.5, 0.9, 0.99)},
                **(
                    {
                        "low_escalated": len(escalated),
                        "low_escalation_outcomes": dict(outcomes),
                        **{
                            f"low_escalated_p{int(q * 100)}_ms": _quantile(esc_lat, q)
                            for q in (0.5, 0.9, 0.99)
                        },
                        **{f"low_local_p{int(q * 100)}_ms": _quantile(rest_lat, q) for q in (0.5, 0.9, 0.99)},
                    }
                    if escalate
                    else {}
                ),
                "gc2_count_low": gc_after[0] - gc_before[0],
                "gc2_seconds_low": round(gc_after[1] - gc_before[1], 3),
                "gc2_count_total": gc_after[0],
                "gc2_seconds_total": round(gc_after[1], 3),
            }

        return asyncio.run(main())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m pipeline.devtools.risk_phases", description=__doc__)
    p.add_argument("--pre", type=int, default=120_000, help="events sent first as a backlog (state)")
    p.add_argument("--capacity", type=int, default=20_000, help="events sent as fast as possible")
    p.add_argument("--low", type=int, default=10_000, help="events sent at --rate")
    p.add_argument("--rate", type=float, default=334.0, help="events/s of the last phase")
    p.add_argument(
        "--simulate",
        type=int,
        default=245_000,
        help="events the stream is simulated for (245,000: the world of surge bench risk)",
    )
    p.add_argument("--workers", type=int, default=1, help="risk workers, each with its own store")
    p.add_argument(
        "--escalate", action="store_true", help="escalation on, with a request-path worker (echo model)"
    )
    p.add_argument("--json", type=Path, default=None, help="also write the result here")
    a = p.parse_args(argv)
    result = run_phases(
        a.pre, a.capacity, a.low, a.rate, simulate=a.simulate, workers=a.workers, escalate=a.escalate
    )
    line = json.dumps(result)
    print(f"RESULT {line}", flush=True)
    if a.json is not None:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
