"""Degradation: hysteresis of the controller, what each level changes, the miss-rate window."""

from __future__ import annotations

import itertools

import pytest

from pipeline.degrade import DegradationController, DegradeConfig, MissRateWindow, plan, pressure_depth
from pipeline.exceptions import InvalidRequestError, SettingsError

CONFIG = DegradeConfig(
    up_queue_depth=(10.0, 20.0, 40.0),
    down_queue_depth=(5.0, 12.0, 25.0),
    up_miss_rate=(0.05, 0.10, 0.30),
    down_miss_rate=(0.02, 0.05, 0.15),
    cooldown_ms=10_000.0,
)


def test_steps_up_at_once_possibly_several_levels() -> None:
    ctl = DegradationController(CONFIG)
    assert ctl.observe(queue_depth_per_worker=3.0, miss_rate=0.0, now_ms=0.0) == 0
    assert ctl.observe(10.0, 0.0, 1.0) == 1
    assert ctl.observe(50.0, 0.0, 2.0) == 3
    ctl = DegradationController(CONFIG)
    assert ctl.observe(0.0, 0.12, 0.0) == 2  # the miss rate alone suffices
    assert ctl.level == 2


def test_steps_down_one_level_per_cooldown() -> None:
    ctl = DegradationController(CONFIG)
    ctl.observe(100.0, 0.5, 0.0)
    first_at: dict[int, int] = {}
    for t in range(1_000, 60_001, 1_000):
        first_at.setdefault(ctl.observe(0.0, 0.0, float(t)), t)
    # low from t=1s, cooldown 10s: one level per cooldown
    assert first_at == {3: 1_000, 2: 11_000, 1: 21_000, 0: 31_000}
    # a single late observation steps down only one level
    ctl = DegradationController(CONFIG)
    ctl.observe(100.0, 0.0, 0.0)
    ctl.observe(0.0, 0.0, 1.0)
    assert ctl.observe(0.0, 0.0, 1_000_000.0) == 2


def test_no_flapping_around_a_threshold() -> None:
    ctl = DegradationController(CONFIG)
    levels = []
    for i in range(600):  # 10 minutes of a depth oscillating around the level-1 up threshold
        depth = 10.5 if i % 2 == 0 else 9.5
        levels.append(ctl.observe(depth, 0.0, i * 1_000.0))
    assert levels[0] == 1 and set(levels) == {1}  # 9.5 is above the down threshold of 5: it stays


def test_pressure_rising_mid_cooldown_restarts_it() -> None:
    ctl = DegradationController(CONFIG)
    ctl.observe(15.0, 0.0, 0.0)  # level 1
    assert ctl.observe(1.0, 0.0, 1_000.0) == 1  # low since 1s
    assert ctl.observe(7.0, 0.0, 9_000.0) == 1  # inside the band: cooldown resets
    assert ctl.observe(1.0, 0.0, 12_000.0) == 1  # low since 12s
    assert ctl.observe(1.0, 0.0, 21_999.0) == 1
    assert ctl.observe(1.0, 0.0, 22_000.0) == 0


def test_down_needs_both_signals_low() -> None:
    ctl = DegradationController(CONFIG)
    ctl.observe(15.0, 0.0, 0.0)
    for t in range(0, 100_001, 1_000):
        level = ctl.observe(1.0, 0.03, float(t))  # depth low, miss rate in the band
    assert level == 1


def test_max_level_caps_the_controller() -> None:
    ctl = DegradationController(DegradeConfig(max_level=2))
    assert ctl.observe(1_000.0, 1.0, 0.0) == 2


def test_config_validation() -> None:
    with pytest.raises(SettingsError, match="down_queue_depth 10 must be below up_queue_depth 8"):
        DegradeConfig(up_queue_depth=(8.0, 16.0, 32.0), down_queue_depth=(10.0, 12.0, 20.0))
    with pytest.raises(SettingsError, match="increase"):
        DegradeConfig(up_miss_rate=(0.2, 0.1, 0.3))
    with pytest.raises(SettingsError, match="max_level"):
        DegradeConfig(max_level=4)


@pytest.mark.parametrize(
    ("level", "priority", "tier", "expected"),
    [
        (0, "batch", "free", (0, 1024, True, False)),
        (1, "interactive", "standard", (1, 1024, False, False)),
        (2, "interactive", "standard", (2, 256, False, False)),
        (3, "interactive", "standard", (2, 256, False, False)),
        (3, "interactive", "premium", (2, 256, False, False)),
        (3, "interactive", "free", (3, 256, False, True)),
        (3, "batch", "premium", (3, 256, False, True)),
        (3, "offline", "standard", (3, 256, False, True)),
        (2, "realtime", "free", (2, 256, False, False)),
        (3, "realtime", "free", (2, 256, False, False)),
    ],
)
def test_plan_per_level_priority_and_tier(
    level: int, priority: str, tier: str, expected: tuple[int, int, bool, bool]
) -> None:
    p = plan(level, priority, tier, max_tokens=1024, logprobs=True)
    assert (p.level_applied, p.max_tokens, p.logprobs, p.use_template) == expected


def test_plan_realtime_never_past_level_two() -> None:
    for tier in ("free", "standard", "premium"):
        p = plan(3, "realtime", tier, max_tokens=4096, logprobs=False)
        assert not p.use_template and p.level_applied == 2


def test_plan_cap_keeps_smaller_requests_and_is_configurable() -> None:
    assert plan(2, "interactive", "standard", max_tokens=100, logprobs=False).max_tokens == 100
    assert plan(2, "batch", "standard", max_tokens=1000, logprobs=False, max_tokens_cap=64).max_tokens == 64
    ctl = DegradationController(DegradeConfig(max_tokens_cap=128))
    ctl.observe(1_000.0, 0.0, 0.0)
    assert ctl.plan("realtime", "premium", 1000, True).max_tokens == 128


def test_plan_rejects_unknown_values() -> None:
    with pytest.raises(InvalidRequestError, match="priority"):
        plan(1, "urgent", "free", 10, False)
    with pytest.raises(InvalidRequestError, match="level"):
        plan(4, "batch", "free", 10, False)


def test_miss_rate_window_slides() -> None:
    window = MissRateWindow(window_ms=10_000.0, buckets=10, min_samples=1)
    for i in range(100):  # 10 s of requests, every 4th missed
        window.record(missed=i % 4 == 0, now_ms=i * 100.0)
    assert window.counts(9_999.0) == (100, 25)
    assert window.miss_rate(9_999.0) == pytest.approx(0.25)
    for i in range(50):  # 5 s with no misses
        window.record(missed=False, now_ms=10_000.0 + i * 100.0)
    total, misses = window.counts(14_999.0)
    assert total == 100 and misses == 12  # the first 5 s slid out (misses at 5.2 s .. 9.6 s remain)
    assert window.miss_rate(30_000.0) == 0.0  # everything slid out


def test_miss_rate_window_needs_min_samples() -> None:
    window = MissRateWindow(window_ms=1_000.0, min_samples=5)
    for i in range(4):
        window.record(missed=True, now_ms=float(i))
    assert window.miss_rate(10.0) == 0.0
    window.record(missed=False, now_ms=10.0)
    assert window.miss_rate(10.0) == pytest.approx(0.8)


def test_controller_fed_by_window_recovers_after_a_burst_of_misses() -> None:
    window = MissRateWindow(window_ms=5_000.0, buckets=5, min_samples=10)
    ctl = DegradationController(CONFIG)
    levels = []
    for second in range(60):
        for _ in range(50):
            window.record(missed=second < 5, now_ms=second * 1_000.0)  # misses only in the first 5 s
        levels.append(ctl.observe(0.0, window.miss_rate(second * 1_000.0 + 999.0), second * 1_000.0 + 999.0))
    assert max(levels) == 3
    assert levels[-1] == 0
    assert all(b >= a - 1 for a, b in itertools.pairwise(levels))  # one step down at a time


DEADLINES = {"realtime": 200, "interactive": 500, "batch": 5_000, "offline": None}


def test_pressure_depth_leaves_out_work_without_a_deadline() -> None:
    depths = {"realtime": 1, "interactive": 2, "batch": 3, "offline": 500}
    assert pressure_depth(depths, DEADLINES) == 6
    # an operator who gives offline a deadline makes its backlog count
    assert pressure_depth(depths, {**DEADLINES, "offline": 60_000}) == 506
    # with deadlines off nothing has one: every item counts
    assert pressure_depth(depths, dict.fromkeys(DEADLINES)) == 506


def test_an_offline_backlog_alone_does_not_raise_the_level_but_the_same_batch_backlog_does() -> None:
    quiet, pressed = DegradationController(CONFIG), DegradationController(CONFIG)
    backlog = 50  # above every up threshold of CONFIG
    for t in range(0, 30_000, 250):
        quiet.observe(pressure_depth({"realtime": 0, "batch": 2, "offline": backlog}, DEADLINES), 0.0, t)
        pressed.observe(pressure_depth({"realtime": 0, "batch": backlog, "offline": 2}, DEADLINES), 0.0, t)
    assert quiet.level == 0
    assert pressed.level == 3
