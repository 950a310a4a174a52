"""Summary statistics, one definition each: of measured latencies (the demos, the benchmarks, the
replay report) and recall at a false-positive rate (the risk model's report, the replay's comparison).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import numpy.typing as npt


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


def recall_at_fpr(scores: npt.ArrayLike, labels: npt.ArrayLike, fpr: float = 0.01) -> dict[str, float]:
    """Recall at the lowest threshold whose false-positive rate is at most ``fpr`` (ties count as
    flagged): ``{"recall", "fpr", "threshold"}``; recall 0 when no threshold is that strict."""
    s = np.asarray(scores, dtype=np.float64)
    y = np.asarray(labels, dtype=bool)
    pos, neg = int(y.sum()), int((~y).sum())
    if pos == 0 or neg == 0:
        raise ValueError(f"need both classes, got {pos} positives and {neg} negatives")
    best = {"recall": 0.0, "fpr": 0.0, "threshold": float("inf")}
    for thr in np.unique(s)[::-1]:
        flagged = s >= thr
        f = float((flagged & ~y).sum() / neg)
        if f > fpr:
            break
        best = {"recall": float((flagged & y).sum() / pos), "fpr": f, "threshold": float(thr)}
    return best
