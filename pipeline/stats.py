"""Summary statistics of measured latencies, one definition for the demo and the benchmarks."""

from __future__ import annotations

import math
from collections.abc import Sequence


def percentile(values: Sequence[float], q: float) -> float | None:
    """The ``q``-th percentile (0-100) by linear interpolation between the two nearest ranks (numpy's
    default); ``None`` for no values."""
    if not values:
        return None
    xs = sorted(values)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def latency_summary(ms: Sequence[float]) -> dict[str, float | int | None]:
    """count, mean, p50, p90, p99, p999 and max of latencies in milliseconds (rounded to 0.1 ms)."""

    def r(x: float | None) -> float | None:
        return None if x is None else round(x, 1)

    return {
        "count": len(ms),
        "mean_ms": r(sum(ms) / len(ms)) if ms else None,
        "p50_ms": r(percentile(ms, 50)),
        "p90_ms": r(percentile(ms, 90)),
        "p99_ms": r(percentile(ms, 99)),
        "p999_ms": r(percentile(ms, 99.9)),
        "max_ms": r(max(ms)) if ms else None,
    }
