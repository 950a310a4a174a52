"""The risk chain's serialisation cost, the standard library's JSON against orjson, in one process.

``python -m pipeline.devtools.risk_serialisation [--events N] [--rounds R]``: the benchmark's simulated
stream runs through the four stages in process (no broker, no Faust), as a worker's stages run it:
states cached as in a worker (``--no-cache``: every state read from its bytes), every changed state
written as JSON, every repartition record packed and unpacked, every decision written. Both arms in
one run, alternated, the median of ``--rounds`` each: the time in serialisation per event and the
whole chain's. End to end the difference is within the run-to-run noise of a shared two-core machine;
here it is not (docs/architecture.md, "Risk: the chain").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

from pipeline.risk import jsonio
from pipeline.risk.features import FeatureConfig, cents
from pipeline.risk.records import ENTITY_KINDS
from pipeline.risk.stages import Stage, StateCache, decision_record, new_item, pack, unpack
from pipeline.settings import Settings

Codec = tuple[Callable[[Any], bytes], Callable[[bytes], Any]]


def _stdlib_dumps(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), default=list).encode()


ARMS: dict[str, Codec] = {"json": (_stdlib_dumps, json.loads), "orjson": (jsonio.dumps, jsonio.loads)}


def chain(
    events: list[dict[str, Any]], cfg: FeatureConfig, cache_entries: int, batch: int = 200
) -> tuple[float, float]:
    """Seconds for the whole chain and seconds of it in serialisation, with jsonio's current codec."""
    store: dict[str, dict[str, bytes]] = {k: {} for k in ENTITY_KINDS}

    def loader(kind: str) -> Callable[[str, Any], bytes | None]:
        def load(key: str, _ctx: Any) -> bytes | None:
            return store[kind].get(key)

        return load

    stages = {k: Stage(k, cfg, 4, StateCache(cache_entries), loader(k)) for k in ENTITY_KINDS}
    ser = 0.0
    t0 = time.perf_counter()
    for i in range(0, len(events), batch):
        inputs: dict[str, list[tuple[dict[str, Any], Any]]] = {
            "account": [(new_item(dict(e), "v1", 0, 0), None) for e in events[i : i + batch]]
        }
        for kind in ENTITY_KINDS:
            res = stages[kind].run(inputs.get(kind, []))
            t = time.perf_counter()
            for key, (st, _) in res.dirty.items():
                store[kind][key] = st.dumps()
            for (nxt, p), items in res.forward.items():
                inputs.setdefault(nxt, []).extend((it, None) for it in unpack(pack(items), ("bench", p, 0)))
            for item, _ in res.decide:
                jsonio.dumps(
                    decision_record(
                        item,
                        decision="approve",
                        score=0.1,
                        reasons=[],
                        rule_version="v",
                        model_version="m",
                        decided_ms=1,
                    )
                )
            ser += time.perf_counter() - t
    return time.perf_counter() - t0, ser


def main(argv: list[str] | None = None) -> int:
    from pipeline.devtools.bench.risk import stream  # the benchmark's stream: 5 % out of order

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--events", type=int, default=20_000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-cache", action="store_true", help="read every state from its bytes")
    args = ap.parse_args(argv)
    s = Settings()
    cfg = FeatureConfig(
        grace_ms=s.risk_grace_ms,
        horizon_ms=s.risk_horizon_ms,
        small_amount_cents=cents(s.risk_small_amount),
        dedup_ids=s.risk_dedup_ids,
        seen_max=s.risk_seen_max,
    )
    events = stream(args.events)
    cache = 0 if args.no_cache else s.risk_feature_cache_entries
    runs: dict[str, list[tuple[float, float]]] = {a: [] for a in ARMS}
    saved = jsonio.dumps, jsonio.loads
    try:
        for r in range(args.rounds):
            for arm, (dumps, loads) in ARMS.items():
                jsonio.dumps, jsonio.loads = dumps, loads  # type: ignore[assignment]
                runs[arm].append(chain(events, cfg, cache))
                print(
                    f"round {r + 1}/{args.rounds} {arm}: {runs[arm][-1][0]:.2f} s",
                    file=sys.stderr,
                    flush=True,
                )
    finally:
        jsonio.dumps, jsonio.loads = saved
    for arm, rs in runs.items():
        total, ser = statistics.median(x[0] for x in rs), statistics.median(x[1] for x in rs)
        print(
            f"{arm}: serialisation {1e6 * ser / len(events):.1f} us/event, "
            f"whole chain {1e6 * total / len(events):.1f} us/event ({len(events)} events, median of {len(rs)})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
