"""Degradation under overload (docs/architecture.md, "Degradation").

:class:`DegradationController` turns two pressure signals, the inference queue depth per worker and
the deadline-miss rate (from :class:`MissRateWindow`), into a level 0-3 with hysteresis: it steps up
at once (several levels if the pressure warrants), and steps down one level at a time, only after the
pressure has stayed below the lower "down" thresholds for ``cooldown_ms``.

:func:`plan` says what a level changes for one request:

| level | effect |
|---|---|
| 1 | logprobs are not computed |
| 2 | max_tokens is capped (``DEFAULT_MAX_TOKENS_CAP`` by default) |
| 3 | ``batch``/``offline`` requests and ``interactive`` ones from the ``free`` tier get the template |

``realtime`` requests are never degraded past level 2. Time is epoch ms passed in by the caller.
"""

from __future__ import annotations

import itertools
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass

from pipeline.exceptions import InvalidRequestError, SettingsError
from pipeline.terms import PRIORITIES, TIERS, Priority, Tier

MAX_LEVEL = 3

#: Defaults of :class:`DegradeConfig`, defined here once; the ``degrade_*`` fields of ``Settings``
#: take their defaults from these. Queue depths are items waiting per worker.
DEFAULT_UP_QUEUE_DEPTH: tuple[float, float, float] = (64.0, 128.0, 256.0)
DEFAULT_DOWN_QUEUE_DEPTH: tuple[float, float, float] = (32.0, 96.0, 192.0)
DEFAULT_UP_MISS_RATE: tuple[float, float, float] = (0.02, 0.10, 0.25)
DEFAULT_DOWN_MISS_RATE: tuple[float, float, float] = (0.01, 0.05, 0.15)
DEFAULT_COOLDOWN_MS = 5_000.0
DEFAULT_MAX_TOKENS_CAP = 256


@dataclass(frozen=True)
class DegradeConfig:
    """Thresholds of the controller; validated when built.

    ``up_*[i]`` is the pressure at or above which the level is at least ``i + 1`` (either signal
    suffices). ``down_*[i]`` is the pressure below which level ``i + 1`` may step down to ``i`` (both
    signals must be below); each must be lower than the matching up threshold, which is the
    hysteresis band. ``cooldown_ms`` is how long the pressure must stay below before each step down.
    ``max_level`` (0-3) caps the level, e.g. 2 to never serve templates.
    """

    up_queue_depth: tuple[float, float, float] = DEFAULT_UP_QUEUE_DEPTH
    down_queue_depth: tuple[float, float, float] = DEFAULT_DOWN_QUEUE_DEPTH
    up_miss_rate: tuple[float, float, float] = DEFAULT_UP_MISS_RATE
    down_miss_rate: tuple[float, float, float] = DEFAULT_DOWN_MISS_RATE
    cooldown_ms: float = DEFAULT_COOLDOWN_MS
    max_level: int = MAX_LEVEL
    max_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP

    def __post_init__(self) -> None:
        pairs = {
            "queue_depth": (self.up_queue_depth, self.down_queue_depth),
            "miss_rate": (self.up_miss_rate, self.down_miss_rate),
        }
        for name, (up, down) in pairs.items():
            for label, values in (("up", up), ("down", down)):
                if len(values) != MAX_LEVEL:
                    raise SettingsError(f"{label}_{name} needs {MAX_LEVEL} thresholds, got {values!r}")
                if any(not math.isfinite(v) or v < 0 for v in values):
                    raise SettingsError(f"{label}_{name} thresholds must be finite and >= 0, got {values!r}")
                if any(b <= a for a, b in itertools.pairwise(values)):
                    raise SettingsError(
                        f"{label}_{name} thresholds must increase with the level, got {values!r}"
                    )
            for level, (u, d) in enumerate(zip(up, down, strict=True), start=1):
                if d >= u:
                    raise SettingsError(
                        f"down_{name} {d:g} must be below up_{name} {u:g} for level {level} (hysteresis)"
                    )
        if not (math.isfinite(self.cooldown_ms) and self.cooldown_ms >= 0):
            raise SettingsError(f"cooldown_ms must be >= 0, got {self.cooldown_ms!r}")
        if not 0 <= self.max_level <= MAX_LEVEL:
            raise SettingsError(f"max_level must be between 0 and {MAX_LEVEL}, got {self.max_level}")
        if self.max_tokens_cap < 1:
            raise SettingsError(f"max_tokens_cap must be at least 1, got {self.max_tokens_cap}")


class DegradationController:
    """The level in force. One per inference worker, fed the current signals by the inference agent.

    :meth:`observe` is called with the current signals; the caller publishes the returned level on
    the ``surge_degradation_level`` gauge and passes it to :func:`plan` for each request it serves.
    """

    def __init__(self, config: DegradeConfig | None = None) -> None:
        self.config = config or DegradeConfig()
        self._level = 0
        # when the pressure first went below the down thresholds of the current level; None while it is not
        self._low_since_ms: float | None = None
        self._last_ms: float | None = None

    @property
    def level(self) -> int:
        """The level decided by the last :meth:`observe` (0 before any)."""
        return self._level

    def _up_target(self, depth: float, miss_rate: float) -> int:
        cfg = self.config
        target = 0
        for i in range(MAX_LEVEL):
            if depth >= cfg.up_queue_depth[i] or miss_rate >= cfg.up_miss_rate[i]:
                target = i + 1
        return min(target, cfg.max_level)

    def _is_low(self, depth: float, miss_rate: float) -> bool:
        i = self._level - 1
        return depth < self.config.down_queue_depth[i] and miss_rate < self.config.down_miss_rate[i]

    def observe(self, queue_depth_per_worker: float, miss_rate: float, now_ms: float) -> int:
        """Update the level from the signals at ``now_ms`` and return it.

        Steps up immediately to the highest level whose up threshold either signal reaches. Steps
        down one level when the pressure has been below the current level's down thresholds
        (both signals) on every observation for at least ``cooldown_ms``; the next step down needs a
        fresh cooldown. A time earlier than the last one is treated as the last one.
        """
        if self._last_ms is not None and now_ms < self._last_ms:
            now_ms = self._last_ms
        self._last_ms = now_ms
        target = self._up_target(queue_depth_per_worker, miss_rate)
        if target > self._level:
            self._level = target
            self._low_since_ms = None
        elif self._level > 0 and self._is_low(queue_depth_per_worker, miss_rate):
            if self._low_since_ms is None:
                self._low_since_ms = now_ms
            elif now_ms - self._low_since_ms >= self.config.cooldown_ms:
                self._level -= 1
                self._low_since_ms = now_ms if self._level > 0 else None
        else:
            self._low_since_ms = None
        return self._level

    def plan(self, priority: str, tier: str, max_tokens: int, logprobs: bool) -> DegradePlan:
        """:func:`plan` at the current level with this controller's ``max_tokens_cap``."""
        return plan(
            self._level, priority, tier, max_tokens, logprobs, max_tokens_cap=self.config.max_tokens_cap
        )


@dataclass(frozen=True, slots=True)
class DegradePlan:
    """How to serve one request. ``level_applied`` goes on the reply as ``degradation_level``."""

    level_applied: int
    max_tokens: int
    logprobs: bool
    use_template: bool


def plan(
    level: int,
    priority: str,
    tier: str,
    max_tokens: int,
    logprobs: bool,
    *,
    max_tokens_cap: int = DEFAULT_MAX_TOKENS_CAP,
) -> DegradePlan:
    """What ``level`` changes for one request; called by the inference agent when it admits a request
    and again when the request's batch is popped (the level may have risen while it waited).

    ``level_applied`` is the level whose effects this request gets: a ``realtime`` request never
    more than 2, and a request that level 3 does not send to the template (``realtime``, and
    ``interactive`` from ``standard``/``premium``) also 2, since only levels 1 and 2 change it.
    """
    if not 0 <= level <= MAX_LEVEL:
        raise InvalidRequestError(f"degradation level must be between 0 and {MAX_LEVEL}, got {level}")
    if priority not in PRIORITIES:
        raise InvalidRequestError(f"unknown priority {priority!r}; known: {', '.join(PRIORITIES)}")
    if tier not in TIERS:
        raise InvalidRequestError(f"unknown tier {tier!r}; known: {', '.join(TIERS)}")
    templated = priority in (Priority.BATCH, Priority.OFFLINE) or (
        priority == Priority.INTERACTIVE and tier == Tier.FREE
    )
    applied = level if level < 3 or templated else 2
    return DegradePlan(
        level_applied=applied,
        max_tokens=min(max_tokens, max_tokens_cap) if applied >= 2 else max_tokens,
        logprobs=logprobs and applied < 1,
        use_template=applied >= 3,
    )


def pressure_depth(depths: Mapping[str, int], deadlines_ms: Mapping[str, int | None]) -> int:
    """The queue depth the controller reads: the items of classes that have a deadline.

    Work without a deadline (``offline`` by default) may wait as long as it takes; strict priority
    serves it last, so after a failover or a surge it is what fills the queue while every deadline is
    met, and counting it kept the level up long after the pressure was gone. With no deadline on any
    class (deadlines off) every item counts. Called by the inference agent on each controller tick;
    the ``requests_in_queue_per_worker`` gauge (what the HPA scales on) still counts every item.
    """
    if not any(deadlines_ms.get(cls) for cls in depths):
        return sum(depths.values())
    return sum(n for cls, n in depths.items() if deadlines_ms.get(cls))


class MissRateWindow:
    """Deadline hits and misses over the last ``window_ms``, in ``buckets`` time slices.

    The inference agent calls :meth:`record` once per request that leaves the queue (missed: its
    deadline passed before inference began), and reads :meth:`miss_rate` to feed the controller.
    Counts are kept per slice, so memory stays constant at any rate; the window slides by one slice
    (``window_ms / buckets``) at a time. Below ``min_samples`` requests in the window the rate is
    0.0, so that one miss among a handful of requests does not throw the controller to level 3.
    """

    def __init__(self, window_ms: float = 10_000.0, buckets: int = 20, min_samples: int = 20) -> None:
        if not (math.isfinite(window_ms) and window_ms > 0):
            raise SettingsError(f"window_ms must be positive, got {window_ms!r}")
        if buckets < 1:
            raise SettingsError(f"buckets must be at least 1, got {buckets}")
        if min_samples < 1:
            raise SettingsError(f"min_samples must be at least 1, got {min_samples}")
        self.window_ms = window_ms
        self.buckets = buckets
        self.min_samples = min_samples
        self._slice_ms = window_ms / buckets
        # (slice index, requests, misses), oldest first
        self._slices: deque[list[int]] = deque()

    def _evict(self, now_ms: float) -> int:
        current = math.floor(now_ms / self._slice_ms)
        while self._slices and self._slices[0][0] <= current - self.buckets:
            self._slices.popleft()
        return current

    def record(self, missed: bool, now_ms: float) -> None:
        """Count one request served at ``now_ms``; ``missed`` when it missed its deadline."""
        current = self._evict(now_ms)
        if self._slices and self._slices[-1][0] >= current:
            slot = self._slices[-1]  # same slice (or a clock step backwards: count it in the newest)
        else:
            slot = [current, 0, 0]
            self._slices.append(slot)
        slot[1] += 1
        slot[2] += int(missed)

    def counts(self, now_ms: float) -> tuple[int, int]:
        """(requests, misses) in the window ending at ``now_ms``."""
        self._evict(now_ms)
        return sum(s[1] for s in self._slices), sum(s[2] for s in self._slices)

    def miss_rate(self, now_ms: float) -> float:
        """Misses / requests in the window, or 0.0 below ``min_samples`` requests."""
        total, misses = self.counts(now_ms)
        return misses / total if total >= self.min_samples else 0.0
