"""Unit tests of pipeline.inference_config: which setting feeds which field of the inference
worker's SchedulerConfig and DegradeConfig."""

from __future__ import annotations

import os

import pytest

from pipeline.degrade import DegradeConfig
from pipeline.inference_config import degrade_config, scheduler_config
from pipeline.scheduler import DeadlinePolicy
from pipeline.settings import Settings
from pipeline.terms import Priority


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts from the defaults, whatever SURGE_* the shell exported."""
    for name in list(os.environ):
        if name.upper().startswith("SURGE_"):
            monkeypatch.delenv(name)


def test_the_scheduler_config_follows_the_settings() -> None:
    settings = Settings.load(
        deadline_realtime_ms=150,
        deadline_interactive_ms=400,
        deadline_batch_ms=4000,
        deadline_offline_ms=0,
        queue_limit_per_class=77,
        deadline_policy_batch="delay",
        max_batch_size=16,
        base_batch_size=4,
        max_wait_ms=7.5,
        max_wait_realtime_ms=2.5,
    )
    cfg = scheduler_config(settings, model_max_batch_size=1024)
    assert cfg.deadline_ms == {
        Priority.REALTIME: 150,
        Priority.INTERACTIVE: 400,
        Priority.BATCH: 4000,
        Priority.OFFLINE: None,  # 0 in the settings: no deadline
    }
    assert cfg.queue_limit == {priority: 77 for priority in Priority}
    assert cfg.deadline_policy[Priority.BATCH] is DeadlinePolicy.DELAY
    assert cfg.deadline_policy[Priority.REALTIME] is DeadlinePolicy.REJECT
    assert (cfg.max_batch_size, cfg.base_batch_size, cfg.max_wait_ms) == (16, 4, 7.5)
    assert cfg.realtime_max_wait_ms == 2.5
    assert scheduler_config(Settings.load(), 32).realtime_max_wait_ms == 0.0, "by default: at once"


def test_a_batch_is_never_larger_than_the_model_takes() -> None:
    settings = Settings.load(max_batch_size=32, base_batch_size=8)
    small_model = scheduler_config(settings, 4)
    assert (small_model.max_batch_size, small_model.base_batch_size) == (4, 4)
    assert scheduler_config(settings, 12).base_batch_size == 8


def test_without_deadlines_no_class_has_one() -> None:
    cfg = scheduler_config(Settings.load(deadlines_enabled=False), 32)
    assert set(cfg.deadline_ms.values()) == {None}


def test_the_degrade_config_follows_the_settings() -> None:
    settings = Settings.load(
        degrade_up_queue_depth=(10.0, 20.0, 30.0),
        degrade_down_queue_depth=(5.0, 15.0, 25.0),
        degrade_up_miss_rate=(0.1, 0.2, 0.3),
        degrade_down_miss_rate=(0.05, 0.15, 0.25),
        degrade_cooldown_ms=1234.0,
        degrade_max_tokens_cap=99,
    )
    assert degrade_config(settings) == DegradeConfig(
        up_queue_depth=(10.0, 20.0, 30.0),
        down_queue_depth=(5.0, 15.0, 25.0),
        up_miss_rate=(0.1, 0.2, 0.3),
        down_miss_rate=(0.05, 0.15, 0.25),
        cooldown_ms=1234.0,
        max_tokens_cap=99,
    )


def test_default_settings_give_the_default_configs() -> None:
    assert degrade_config(Settings.load()) == DegradeConfig()
