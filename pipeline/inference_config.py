"""The inference worker's pure configs, translated from :class:`~pipeline.settings.Settings` in one
place each: the queue's :class:`~pipeline.scheduler.SchedulerConfig` and the degradation
controller's :class:`~pipeline.degrade.DegradeConfig` (docs/architecture.md, "Settings").

Each config keeps its own defaults and validation in its module; this module only says which
setting feeds which field.
"""

from __future__ import annotations

from pipeline.degrade import DegradeConfig
from pipeline.scheduler import DeadlinePolicy, SchedulerConfig
from pipeline.settings import Settings
from pipeline.terms import PRIORITIES, Priority


def scheduler_config(settings: Settings, model_max_batch_size: int) -> SchedulerConfig:
    """The inference queue's config. A batch is never larger than the model takes
    (``model_max_batch_size``), whatever ``max_batch_size`` and ``base_batch_size`` say."""
    return SchedulerConfig(
        deadline_ms={Priority(priority): settings.deadline_ms(priority) for priority in PRIORITIES},
        queue_limit={Priority(priority): settings.queue_limit_per_class for priority in PRIORITIES},
        deadline_policy={Priority.BATCH: DeadlinePolicy(settings.deadline_policy_batch)},
        max_batch_size=min(settings.max_batch_size, model_max_batch_size),
        base_batch_size=min(settings.base_batch_size, settings.max_batch_size, model_max_batch_size),
        max_wait_ms=settings.max_wait_ms,
        realtime_max_wait_ms=settings.max_wait_realtime_ms,
    )


def degrade_config(settings: Settings) -> DegradeConfig:
    """The degradation controller's thresholds, cooldown and ``max_tokens`` cap."""
    return DegradeConfig(
        up_queue_depth=settings.degrade_up_queue_depth,
        down_queue_depth=settings.degrade_down_queue_depth,
        up_miss_rate=settings.degrade_up_miss_rate,
        down_miss_rate=settings.degrade_down_miss_rate,
        cooldown_ms=settings.degrade_cooldown_ms,
        max_tokens_cap=settings.degrade_max_tokens_cap,
    )
