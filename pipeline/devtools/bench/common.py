"""Shared machinery of the benchmarks: the run asked for, the broker, isolated deployments, metrics.

Called by every scenario module. :class:`BenchRun` is what ``surge bench`` asks of a scenario (its
results are written by :mod:`pipeline.devtools.bench.report`). :class:`BenchEnv` starts the embedded
Kafka broker once per run (data dir ``.surge-bench/kafka``), hands out :class:`BenchDeployment`
objects (one topic prefix, app id and worker per arm, so arms share the broker but nothing else) and
stops every process it started when the ``with`` block ends, also on errors and Ctrl-C. Deployments,
processes and percentiles are the ones the tests and the demo use too
(``pipeline.devtools.deployment``, ``pipeline.devtools.procs``, ``pipeline.stats``); they are
importable from here as well.
"""

from __future__ import annotations

import asyncio
import shutil
import sys
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.devtools.broker import EmbeddedKafka
from pipeline.devtools.broker_warmup import BrokerWarmUp, warm_broker
from pipeline.devtools.deployment import Deployment, deployment_env
from pipeline.devtools.procs import ManagedProcess
from pipeline.exceptions import SurgeError
from pipeline.metrics import scrape as scrape
from pipeline.stats import latency_summary as latency_summary
from pipeline.stats import percentile as percentile

BENCH_DIR = Path(".surge-bench")
#: seconds of produce and fetch a broker a benchmark starts gets before the run (its JVM compiles
#: its request paths meanwhile): 5 s left the first second of load as fast as the rest
BROKER_WARM_S = 5.0

#: settings every arm shares unless a scenario overrides them: nothing but the measured feature varies
BASE_ENV: dict[str, str] = {
    "SURGE_PARTITIONS": "4",
    "SURGE_COMMIT_INTERVAL_MS": "200",
    "SURGE_RATE_LIMIT_ENABLED": "false",
    "SURGE_DEGRADE_ENABLED": "false",
    # one torch thread per worker: on a 2-core box the default thread pool fights the event loop
    "SURGE_MODEL_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def long_deadlines(ms: int) -> dict[str, int]:
    """Deadlines no arm reaches: for scenarios that measure throughput, not deadlines."""
    return {f"deadline_{p}_ms": ms for p in ("realtime", "interactive", "batch")}


#: words the benchmarks build distinct synthetic questions from
BANKING_WORDS = (
    "card",
    "fee",
    "transfer",
    "balance",
    "pin",
    "refund",
    "account",
    "limit",
    "cash",
    "app",
    "rate",
    "travel",
)


class BenchError(SurgeError):
    """A benchmark could not run (missing data, a worker that did not start, lost replies)."""


@dataclass(frozen=True)
class BenchRun:
    """One scenario run as ``surge bench`` (or a test) asks for it: ``quick`` for the small plan, where
    the JSON and the PNG go (None: ``bench-results/<scenario>.json`` and the PNG beside it), and an
    already running broker to use (tests; None: the scenario starts its own)."""

    scenario: str
    quick: bool = False
    json_path: str | Path | None = None
    plot_path: str | Path | None = None
    broker: EmbeddedKafka | None = None
    #: surge and failover: the model-alone limit L in questions/s to use instead of measuring it, so
    #: that two runs (two settings, two commits) offer the same load; None: measured in the run
    limit_qps: float | None = None

    @property
    def title(self) -> str:
        """How the scenario's plot title begins: ``surge bench SCENARIO``, `` (quick)`` for a quick run."""
        return f"surge bench {self.scenario}" + (" (quick)" if self.quick else "")


# ---- statistics -----------------------------------------------------------------------------------
def ratio(a: float | None, b: float | None) -> float | None:
    """a / b rounded to 3 places, ``None`` where undefined."""
    if a is None or b is None or b == 0:
        return None
    return round(a / b, 3)


def target(name: str, value: float | None, op: str, goal: float, unit: str = "") -> dict[str, Any]:
    """One target check: ``value op goal`` with ``op`` in ``>=``/``<=``; says by how much it is missed."""
    if value is None:
        return {"name": name, "value": None, "goal": f"{op} {goal}{unit}", "met": False, "missed_by": None}
    met = value >= goal if op == ">=" else value <= goal
    missed_by = 0.0 if met else round(abs(goal - value), 4)
    return {
        "name": name,
        "value": round(value, 4),
        "goal": f"{op} {goal}{unit}",
        "met": met,
        "missed_by": missed_by,
    }


# ---- metrics (scrape: pipeline.metrics) -----------------------------------------------------------
def metric_sum(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str, **labels: str
) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels``."""
    total = 0.0
    for (n, lab), v in samples.items():
        if n == name and all(dict(lab).get(k) == val for k, val in labels.items()):
            total += v
    return total


def metric_delta(
    before: dict[tuple[str, tuple[tuple[str, str], ...]], float],
    after: dict[tuple[str, tuple[tuple[str, str], ...]], float],
    name: str,
    **labels: str,
) -> float:
    return metric_sum(after, name, **labels) - metric_sum(before, name, **labels)


# ---- deployments ----------------------------------------------------------------------------------
#: one arm's surge deployment: its own topics, app id, worker and client on the shared broker
BenchDeployment = Deployment


def start_warm(kafka: EmbeddedKafka, seconds: float = BROKER_WARM_S) -> BrokerWarmUp:
    """Warm a broker a benchmark has just started (:mod:`pipeline.devtools.broker_warmup`), so the
    run measures the pipeline, not the JVM's first seconds; says what it did on stderr."""
    warm = asyncio.run(warm_broker(kafka.bootstrap, seconds))
    print(warm.line(), file=sys.stderr, flush=True)
    return warm


class BenchEnv:
    """The broker and everything started for one benchmark run; a context manager that cleans up."""

    def __init__(
        self,
        scenario: str,
        *,
        bench_dir: Path = BENCH_DIR,
        heap_mb: int = 768,
        broker: EmbeddedKafka | None = None,
    ) -> None:
        """``broker``: an already running broker to use (tests); it is then left running at the end."""
        self.scenario = scenario
        self.bench_dir = bench_dir.absolute()
        stamp = f"{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
        self.run_dir = self.bench_dir / "runs" / f"{scenario}-{stamp}"
        self.own_broker = broker is None
        self.kafka = broker or EmbeddedKafka(self.bench_dir / "kafka", partitions=4, heap_mb=heap_mb)
        self.deployments: list[BenchDeployment] = []
        #: what warming the broker this run started did (None: a broker given to it, left as it is)
        self.broker_warm_up: BrokerWarmUp | None = None
        self.extra_stops: list[Callable[[], None]] = []

    def __enter__(self) -> BenchEnv:
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if not self.own_broker:
            return self
        try:
            self.kafka.start()
            self.broker_warm_up = start_warm(self.kafka)
        except BaseException:
            self.kafka.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Stop workers, helper processes and the broker (idempotent)."""
        for d in self.deployments:
            d.clients.clear()  # clients belong to the scenario's event loop, which closes them
            d.stop_workers(timeout_s=15)
        for stop in reversed(self.extra_stops):
            try:
                stop()
            except Exception:
                pass
        self.extra_stops.clear()
        if self.own_broker:
            self.kafka.stop()
        shutil.rmtree(self.run_dir / "data", ignore_errors=True)

    @property
    def bootstrap(self) -> str:
        return self.kafka.bootstrap

    def deployment(self, name: str, **env: object) -> BenchDeployment:
        """A new isolated deployment for arm ``name``; ``env`` keys are Settings field names."""
        tag = uuid.uuid4().hex[:8]
        full = deployment_env(
            self.bootstrap,
            prefix=f"b{tag}.",
            app_id=f"bench-{self.scenario}-{name}-{tag}",
            data_dir=self.run_dir / "data" / f"{name}-{tag}",
            defaults=BASE_ENV,
            **env,
        )
        d = BenchDeployment(name, full, self.bootstrap, self.run_dir)
        d.settings()  # fail fast on an invalid combination
        self.deployments.append(d)
        return d

    def wait_ready(self, deployments: Iterable[BenchDeployment], timeout_s: float = 240.0) -> float:
        """Start a worker for each deployment (in parallel) and wait until all are ready; seconds taken."""
        t0 = time.monotonic()
        deps = list(deployments)
        for d in deps:
            if not d.workers:
                d.start_worker()
        for d in deps:
            left = max(5.0, timeout_s - (time.monotonic() - t0))
            try:
                d.workers[0].wait_ready(timeout_s=left)
            except SurgeError as exc:
                raise BenchError(f"arm {d.name!r}: {exc}") from exc
        return time.monotonic() - t0


class HelperProcess(ManagedProcess):
    """A baseline process the benchmark starts (plain loop, sync server, gateway): a
    :class:`ManagedProcess` whose stop is registered with the :class:`BenchEnv`, and whose failure to
    start is a :class:`BenchError`."""

    def __init__(self, argv: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        super().__init__(argv, log_path, env, name=" ".join(argv[2:4]))

    def start(self, env: BenchEnv | None = None) -> HelperProcess:
        """Start it and register its stop with ``env`` (so it is stopped on any exit)."""
        super().start()
        if env is not None:
            env.extra_stops.append(self.stop)
        return self

    def wait_ready(self, marker: str | None = None, timeout_s: float = 120.0) -> None:
        try:
            super().wait_ready(marker, timeout_s)
        except SurgeError as exc:
            raise BenchError(str(exc)) from exc

    def stop(self, timeout_s: float = 10.0) -> None:
        super().stop(timeout_s)


def progress(total: int, desc: str) -> Any:
    """A tqdm bar on stderr."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit="req", file=sys.stderr, leave=False, dynamic_ncols=True)
