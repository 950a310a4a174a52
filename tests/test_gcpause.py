"""The garbage-collection pause timer (pipeline/gcpause.py) and its metric."""

from __future__ import annotations

import gc

from prometheus_client import CollectorRegistry

from pipeline.gcpause import GcPauseTimer
from pipeline.metrics import create_metrics, gc_pause_timer


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_each_collection_is_timed_from_start_to_stop_by_generation() -> None:
    clock = FakeClock()
    seen: list[tuple[int, float]] = []
    timer = GcPauseTimer(lambda g, s: seen.append((g, s)), clock)
    timer("start", {"generation": 2})
    clock.now += 0.3
    timer("stop", {"generation": 2, "collected": 5, "uncollectable": 0})
    timer("start", {"generation": 0})
    clock.now += 0.0002
    timer("stop", {"generation": 0, "collected": 0, "uncollectable": 0})
    assert [g for g, _ in seen] == [2, 0]
    assert abs(seen[0][1] - 0.3) < 1e-9 and abs(seen[1][1] - 0.0002) < 1e-9


def test_a_stop_without_its_start_is_not_counted() -> None:
    """Installed in the middle of a collection (or after a missed start): nothing made up."""
    seen: list[tuple[int, float]] = []
    timer = GcPauseTimer(lambda g, s: seen.append((g, s)), FakeClock())
    timer("stop", {"generation": 1})
    assert seen == []


def test_real_collections_land_in_the_histogram_of_their_generation() -> None:
    metrics = create_metrics(CollectorRegistry())
    timer = gc_pause_timer(metrics).install()
    try:
        gc.collect(0)
        gc.collect(2)
    finally:
        timer.remove()
    assert timer not in gc.callbacks

    def count(generation: str) -> float:
        value = metrics.registry.get_sample_value("surge_gc_pause_seconds_count", {"generation": generation})
        return 0.0 if value is None else value

    assert count("0") >= 1 and count("2") >= 1
    total = metrics.registry.get_sample_value("surge_gc_pause_seconds_sum", {"generation": "2"})
    assert total is not None and total > 0
