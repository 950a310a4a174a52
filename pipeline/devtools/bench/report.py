"""What a benchmark run leaves behind: its JSON result, its PNG plot and the summary on stderr.

Every scenario ends in :func:`report` (with a plot of its own) or :func:`finish` (with bar charts),
so every result has the same frame: ``scenario`` and ``quick`` first, then the scenario's own keys
(its ``targets`` among them, see :func:`pipeline.devtools.bench.common.target`), then ``environment``
and ``plot``. docs/architecture.md, "Performance: how it is measured", says what the scenarios measure.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pipeline.devtools.bench.common import BenchRun

if TYPE_CHECKING:
    from matplotlib.figure import Figure

RESULTS_DIR = Path("bench-results")

#: one bar chart of :func:`bar_plot`: its y-axis label and a value per bar (None draws as 0)
Panel = tuple[str, dict[str, float | None]]


def environment() -> dict[str, Any]:
    """What the numbers were measured on."""
    return {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "command": "surge " + " ".join(sys.argv[1:])
        if sys.argv[0].endswith(("cli.py", "surge"))
        else " ".join(sys.argv),
    }


def default_paths(
    scenario: str, json_path: str | Path | None, plot_path: str | Path | None
) -> tuple[Path, Path]:
    """JSON and PNG paths: given, or ``bench-results/<scenario>.json``/``.png`` (PNG beside the JSON)."""
    jp = Path(json_path) if json_path else RESULTS_DIR / f"{scenario}.json"
    pp = Path(plot_path) if plot_path else jp.with_suffix(".png")
    return jp, pp


def write_json(path: Path, result: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")


@contextmanager
def figure(path: Path, title: str, *, dpi: int = 100, **subplots: Any) -> Iterator[tuple[Figure, Any]]:
    """A matplotlib figure (Agg, no display) with ``plt.subplots(**subplots)``; the ``with`` block
    draws on its axes, and at its end the figure gets ``title`` and is written to ``path`` as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(**subplots)
    try:
        yield fig, axes
        fig.suptitle(title)
        fig.tight_layout()
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=dpi)
    finally:
        plt.close(fig)


def bar_plot(path: Path, title: str, panels: Sequence[Panel]) -> None:
    """One bar chart per panel, side by side."""
    colors = ["#2b6cb0", "#dd6b20", "#38a169", "#805ad5", "#e53e3e", "#718096"]
    size = (4.2 * len(panels), 3.8)
    with figure(path, title, dpi=110, nrows=1, ncols=len(panels), figsize=size, squeeze=False) as (_, axes):
        for ax, (label, values) in zip(axes[0], panels, strict=True):
            names = list(values)
            ys = [values[n] or 0.0 for n in names]
            ax.bar(names, ys, color=colors[: len(names)])
            ax.set_ylabel(label)
            ax.tick_params(axis="x", labelrotation=20, labelsize=8)
            for i, y in enumerate(ys):
                ax.annotate(f"{y:.3g}", (i, y), ha="center", va="bottom", fontsize=8)


def report(job: BenchRun, result: dict[str, Any], plot: Callable[[Path], None]) -> int:
    """Write the JSON, draw the plot (``plot(png_path)``), print where they are and every target;
    the exit status, 0 whether or not the targets were met (the JSON says which were missed)."""
    jp, pp = default_paths(job.scenario, job.json_path, job.plot_path)
    result = {
        "scenario": job.scenario,
        "quick": job.quick,
        **result,
        "environment": environment(),
        "plot": str(pp),
    }
    write_json(jp, result)
    plot(pp)
    print(f"\n{job.scenario}: JSON {jp}, plot {pp}", file=sys.stderr)
    for t in result.get("targets", []):
        state = "met" if t["met"] else f"MISSED by {t['missed_by']}"
        print(f"  target {t['name']}: {t['value']} (goal {t['goal']}) {state}", file=sys.stderr)
    return 0


def finish(job: BenchRun, result: dict[str, Any], panels: Sequence[Panel]) -> int:
    """:func:`report` with :func:`bar_plot` of ``panels`` as the plot."""
    return report(job, result, lambda pp: bar_plot(pp, job.title, panels))
