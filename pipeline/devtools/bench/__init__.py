"""``surge bench SCENARIO``: the real pipeline on the embedded Kafka against its baselines and its limit.

Scenarios (docs/architecture.md, "Performance: how it is measured"), one module each: ``batching``,
``merging``, ``priority``, ``overhead``, ``gateway``, ``surge``, ``failover``, ``risk``, ``replay``,
``hostile``. Each module's ``run`` takes a :class:`~pipeline.devtools.bench.common.BenchRun`, runs all
of its arms in one process run on one broker, interleaved where the arms allow it, and writes a JSON
result (ratios, latency percentiles, targets with how much they are missed by) and a PNG plot, by
default under ``bench-results/`` (:mod:`pipeline.devtools.bench.report`).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from pipeline.devtools.broker import EmbeddedKafka

SCENARIOS: tuple[str, ...] = (
    "batching",
    "merging",
    "priority",
    "overhead",
    "gateway",
    "surge",
    "failover",
    "risk",
    "replay",
    "hostile",
)


#: the scenarios that offer load as a multiple of the model-alone limit L (``--limit-qps`` fixes L)
LIMIT_SCENARIOS = ("surge", "failover")


def run_bench(
    scenario: str,
    *,
    quick: bool = False,
    json_path: str | Path | None = None,
    plot_path: str | Path | None = None,
    broker: EmbeddedKafka | None = None,
    limit_qps: float | None = None,
    **options: Any,
) -> int:
    """Run one scenario; called by ``surge bench``. Returns the exit status (0 when it ran to the end,
    whether or not its targets were met: the JSON says which were missed and by how much).

    ``broker``: an already running broker to use (tests). ``options`` go to the scenario's ``run``
    besides the :class:`~pipeline.devtools.bench.common.BenchRun` (e.g. ``banking77_csv=`` for ``merging``).
    """
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown benchmark scenario {scenario!r}; one of {', '.join(SCENARIOS)}")
    from pipeline.devtools.bench.common import BenchError, BenchRun

    if limit_qps is not None:  # a user's flag: a typed error the CLI prints in one line
        if scenario not in LIMIT_SCENARIOS:
            raise BenchError(f"--limit-qps applies to {' and '.join(LIMIT_SCENARIOS)}, not {scenario}")
        if not limit_qps > 0:
            raise BenchError(f"--limit-qps must be a positive number of questions/s, got {limit_qps}")
    module = importlib.import_module(f"pipeline.devtools.bench.{scenario}")
    job = BenchRun(
        scenario, quick=quick, json_path=json_path, plot_path=plot_path, broker=broker, limit_qps=limit_qps
    )
    return int(module.run(job, **options))
