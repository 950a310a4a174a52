"""The PNG of a replay or shadow report (docs/architecture.md, "Replay"): agreement and differences by
cause, ``served_from`` shifts (or decision flips), the distribution of answer edit distances (or
score deltas) and latency old against new."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


def plot_report(report: Mapping[str, Any], path: str | Path, title: str = "") -> Path | None:
    """Write the report's four panels to ``path``; returns it, or None without matplotlib (an extra,
    ``surge[plot]``, so that worker images stay lean: the JSON report has every number)."""
    try:
        import matplotlib
    except ModuleNotFoundError:
        log.warning("no plot of the report: matplotlib is not installed (pip install 'surge[plot]')")
        return None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    series = report.get("_series", {})
    risk = report["kind"] != "requests"
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    c, a = report["counts"], report["agreement"]

    ax = axes[0][0]
    same = a["same_decision"] if risk else a["same_outcome"]
    causes = dict(report.get("differences_by_cause", {}))
    labels = ["same", *causes.keys()]
    values = [same, *causes.values()]
    if risk:
        labels = ["same decision", "flips"]
        values = [same, a["flips"]]
    bars = ax.barh(labels[::-1], values[::-1], color=["#4c72b0"] * (len(values) - 1) + ["#55a868"])
    ax.bar_label(bars, padding=2, fontsize=8)
    ax.set_xscale("symlog")
    ax.set_title(f"outcomes of {c['joined']} joined ({_pct(a['rate'])} same)")

    ax = axes[0][1]
    shifts = report["decision_flips"] if risk else report["served_from_shift"]
    if shifts:
        bars = ax.barh(list(shifts.keys())[::-1], list(shifts.values())[::-1], color="#8172b2")
        ax.bar_label(bars, padding=2, fontsize=8)
    ax.set_xscale("symlog")
    ax.set_title("decision live -> replay" if risk else "served_from live -> replay")

    ax = axes[1][0]
    values = series.get("score_delta" if risk else "edit_distance", [])
    if values:
        ax.hist(values, bins=40, color="#c44e52")
        ax.set_yscale("symlog")
    ax.set_xlabel("replay score - live score" if risk else "normalised edit distance of answers")
    ax.set_ylabel("pairs")
    ax.set_title("score deltas" if risk else "answer differences")

    ax = axes[1][1]
    live_lat = series.get("live_latency_ms", [])
    new_lat = series.get("replay_latency_ms", [])
    data = [x for x in (live_lat, new_lat) if x]
    names = [n for n, x in (("live", live_lat), ("replay", new_lat)) if x]
    if data:
        ax.boxplot(data, tick_labels=names, showfliers=False)
        ax.set_yscale("log")
    ax.set_ylabel("ms")
    ax.set_title("latency (live: created to reply; replay: copy to reply)")

    fig.suptitle(title or f"surge {report['kind']} replay")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f} %"
