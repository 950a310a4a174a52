"""Token buckets per user and per tenant (docs/architecture.md, "The path of a request", intake).

A bucket's whole state is a :class:`BucketState` of two floats, stored as a small JSON dict in a
mapping that the intake agent provides (a RocksDB-backed Faust table keyed by user_id, so the bucket
lives on the partition that owns the user). Time is epoch milliseconds, passed in by the caller, so
the logic is deterministic and testable.

Guarantee of :func:`take`: over any interval of length ``T`` seconds, a bucket admits at most
``rate_per_s * T + burst`` units of cost.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, MutableMapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from pipeline.exceptions import InvalidRequestError, RateLimitedError, SettingsError
from pipeline.terms import TIERS  # defined there; still importable from here

# Float rounding tolerances. Waiting exactly ``retry_after_ms`` must be enough even when
# ``rate * elapsed`` lands a hair below the cost: retry_after is rounded up from (needed - 1e-6 ms),
# and a bucket admits when it is short by at most what 1e-6 ms of refill gives (plus 1e-9). An admitted
# request may leave the bucket that far below zero, so no tolerance accumulates over many requests.
_MS_TOLERANCE = 1e-6


def _token_tolerance(rate_per_s: float) -> float:
    return 1e-9 * (1.0 + rate_per_s)


@dataclass(slots=True)
class BucketState:
    """Tokens left in a bucket at ``updated_ms`` (epoch ms). JSON-serialisable via :meth:`to_dict`."""

    tokens: float
    updated_ms: float

    def to_dict(self) -> dict[str, float]:
        """The value written to the state table."""
        return {"tokens": self.tokens, "updated_ms": self.updated_ms}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> BucketState:
        """Read a value written by :meth:`to_dict`; raises ``ValueError`` on a malformed one."""
        try:
            tokens = float(data["tokens"])
            updated_ms = float(data["updated_ms"])
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(f"malformed bucket state {data!r}: {exc}") from exc
        if not (math.isfinite(tokens) and math.isfinite(updated_ms)):
            raise ValueError(f"malformed bucket state {data!r}: non-finite number")
        return cls(tokens=tokens, updated_ms=updated_ms)


@dataclass(frozen=True, slots=True)
class TierLimits:
    """A sustained rate (units per second) and a burst (bucket capacity, in units)."""

    rate_per_s: float
    burst: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.rate_per_s) and self.rate_per_s > 0):
            raise SettingsError(f"rate_per_s must be a positive number, got {self.rate_per_s!r}")
        if not (math.isfinite(self.burst) and self.burst >= 1):
            raise SettingsError(
                f"burst must be at least 1 (one request), got {self.burst!r} "
                f"with rate_per_s {self.rate_per_s:g}"
            )


#: Defaults of :class:`RateLimitConfig`, defined here once; the ``user_rate_per_s_<tier>``,
#: ``user_burst_<tier>``, ``tenant_rate_per_s`` and ``tenant_burst`` fields of ``Settings`` take
#: their defaults from these.
DEFAULT_USER_LIMITS: Mapping[str, TierLimits] = MappingProxyType(
    {
        "free": TierLimits(rate_per_s=2.0, burst=10.0),
        "standard": TierLimits(rate_per_s=20.0, burst=50.0),
        "premium": TierLimits(rate_per_s=100.0, burst=200.0),
    }
)
DEFAULT_TENANT_LIMITS = TierLimits(rate_per_s=2000.0, burst=4000.0)


def _default_user_limits() -> dict[str, TierLimits]:
    return dict(DEFAULT_USER_LIMITS)


@dataclass(frozen=True)
class RateLimitConfig:
    """Limits per user tier and per tenant; validated when built.

    ``tenant_overrides`` gives a tenant its own limits; every other tenant gets ``tenant``.
    """

    users: Mapping[str, TierLimits] = field(default_factory=_default_user_limits)
    tenant: TierLimits = DEFAULT_TENANT_LIMITS
    tenant_overrides: Mapping[str, TierLimits] = field(default_factory=dict)

    def __post_init__(self) -> None:
        missing = [tier for tier in TIERS if tier not in self.users]
        if missing:
            raise SettingsError(
                f"RateLimitConfig.users lacks limits for tiers {missing}; requests may use {TIERS}"
            )
        for name, limits in [*self.users.items(), *self.tenant_overrides.items()]:
            if not isinstance(limits, TierLimits):
                raise SettingsError(f"limits for {name!r} must be TierLimits, got {type(limits).__name__}")
        for tier, limits in self.users.items():
            tenant = self.tenant
            if limits.rate_per_s > tenant.rate_per_s:
                raise SettingsError(
                    f"user tier {tier!r} rate_per_s {limits.rate_per_s:g} exceeds the tenant rate_per_s "
                    f"{tenant.rate_per_s:g}: one user could exhaust the tenant alone"
                )

    def user_limits(self, tier: str) -> TierLimits:
        """Limits of a user tier; called by :class:`RateLimiter` for each request."""
        try:
            return self.users[tier]
        except KeyError:
            raise InvalidRequestError(
                f"unknown tier {tier!r}; known tiers: {', '.join(sorted(self.users))}"
            ) from None

    def tenant_limits(self, tenant: str) -> TierLimits:
        """Limits of a tenant (its override, else the default tenant limits)."""
        return self.tenant_overrides.get(tenant, self.tenant)


@dataclass(frozen=True, slots=True)
class TakeResult:
    """Outcome of :func:`take`: ``state`` is the bucket after the attempt (refilled; debited if allowed).

    ``retry_after_ms`` is 0 when allowed, else the whole milliseconds until ``cost`` tokens are there.
    """

    allowed: bool
    state: BucketState
    retry_after_ms: int


def take(state: BucketState | None, now_ms: float, limits: TierLimits, cost: float = 1.0) -> TakeResult:
    """Refill the bucket to ``now_ms`` and try to take ``cost`` tokens. Pure; returns the new state.

    A missing state is a full bucket. Time going backwards (clock skew between workers) refills
    nothing and keeps the later timestamp. ``cost`` must be in ``(0, burst]``, since a larger cost
    could never be admitted.
    """
    if not (cost > 0 and cost <= limits.burst):
        raise InvalidRequestError(
            f"request cost {cost:g} must be above 0 and at most the burst {limits.burst:g}"
        )
    if state is None:
        tokens, updated_ms = limits.burst, now_ms
    else:
        elapsed_ms = max(0.0, now_ms - state.updated_ms)
        tokens = min(limits.burst, state.tokens + limits.rate_per_s * elapsed_ms / 1000.0)
        updated_ms = max(now_ms, state.updated_ms)
    if tokens + _token_tolerance(limits.rate_per_s) >= cost:
        return TakeResult(True, BucketState(tokens - cost, updated_ms), 0)
    needed_ms = (cost - tokens) / limits.rate_per_s * 1000.0
    retry_after_ms = max(1, math.ceil(needed_ms - _MS_TOLERANCE))
    return TakeResult(False, BucketState(tokens, updated_ms), retry_after_ms)


def charge_time_ms(created_ms: float, record_ms: float, now_ms: float, slack_ms: float) -> float:
    """When a request is charged to its buckets: its own time (``created_at``), so a backlog that
    waited in Kafka through a stall or a restart is not taken for a burst, but never earlier than its
    record's timestamp less ``slack_ms`` (the request topic carries the broker's append time, which no
    client sets) and never later than ``now_ms``. A client's ``created_at`` alone once decided it: each
    request dated one refill later than the last, all of them years in the past, found the bucket
    full again, without limit (docs/architecture.md, "Security")."""
    return min(max(created_ms, record_ms - slack_ms), now_ms)


class RateLimiter:
    """Checks the user's bucket, then the tenant's, against a state mapping.

    ``state`` is any ``MutableMapping[str, dict]`` (a Faust table in the intake agent; a dict in
    tests). Keys are ``user:<len(tenant)>:<tenant>:<user_id>`` and ``tenant:<tenant>``
    (``tenant:<tenant>#<shard>`` with
    ``tenant_shards > 1``). A refused request writes nothing; an admitted one writes both buckets.

    Tenant buckets and partitions: the table is partitioned by user_id, so one tenant's users are
    spread over all partitions and no single partition sees the tenant's whole traffic. With
    ``tenant_shards = N`` (the partition count) the caller passes the record's partition as
    ``shard``; each shard gets a bucket with ``1/N`` of the tenant's rate and burst, so the sum over
    shards keeps the tenant limit without any coordination (at the cost of being stricter when a
    tenant's traffic is skewed to a few partitions). With the default of 1, one bucket per worker
    process; the limit then holds per worker.
    """

    def __init__(
        self, config: RateLimitConfig, state: MutableMapping[str, Any], tenant_shards: int = 1
    ) -> None:
        if tenant_shards < 1:
            raise SettingsError(f"tenant_shards must be at least 1, got {tenant_shards}")
        self.config = config
        self.state = state
        self.tenant_shards = tenant_shards

    @staticmethod
    def user_key(user_id: str, tenant: str) -> str:
        """A user's bucket: one per tenant and user id (the tenant length-prefixed, so no two pairs
        collide). Keyed by the user id alone, user ``bob`` of two tenants shared a bucket, and a
        client of one tenant could drain another's (docs/architecture.md, "Tenant isolation")."""
        return f"user:{len(tenant)}:{tenant}:{user_id}"

    def tenant_key(self, tenant: str, shard: int = 0) -> str:
        if self.tenant_shards == 1:
            return f"tenant:{tenant}"
        return f"tenant:{tenant}#{shard % self.tenant_shards}"

    def _tenant_shard_limits(self, tenant: str) -> TierLimits:
        limits = self.config.tenant_limits(tenant)
        if self.tenant_shards == 1:
            return limits
        n = self.tenant_shards
        return TierLimits(rate_per_s=limits.rate_per_s / n, burst=max(1.0, limits.burst / n))

    def full_after_ms(self, key: str) -> float:
        """How long a bucket under ``key`` takes to refill from empty: after that long without a
        request it is full whatever its tier, and a full bucket is the same as no bucket."""
        if key.startswith("tenant:"):
            tenant = key[len("tenant:") :].rsplit("#", 1)[0] if self.tenant_shards > 1 else key[7:]
            limits = self._tenant_shard_limits(tenant)
            return limits.burst / limits.rate_per_s * 1000.0
        return max(lim.burst / lim.rate_per_s for lim in self.config.users.values()) * 1000.0

    def forgettable(self, key: str, raw: Mapping[str, Any] | None, now_ms: float) -> bool:
        """Whether the stored bucket ``raw`` under ``key`` may be deleted at ``now_ms``: it has been
        idle long enough to be full again (deleting it changes no decision), or it is malformed.
        Entries are otherwise never removed, so without this a stream of new user ids grows the
        table without bound (the intake agent sweeps with it, docs/architecture.md "Security")."""
        if raw is None:
            return True
        try:
            state = BucketState.from_dict(raw)
        except ValueError:
            return True
        return now_ms - state.updated_ms >= self.full_after_ms(key)

    def _load(self, key: str) -> BucketState | None:
        raw = self.state.get(key)
        return None if raw is None else BucketState.from_dict(raw)

    def check(
        self, user_id: str, tier: str, tenant: str, now_ms: float, cost: float = 1.0, shard: int = 0
    ) -> None:
        """Admit one request or raise :class:`RateLimitedError`. Called by intake for each valid request.

        The user's bucket is checked first; when the tenant's bucket then refuses, the user's token is
        not consumed (nothing is written), so a user is not charged for a request that was refused.
        ``RateLimitedError`` carries the scope (``user``/``tenant``), the key, the configured rate and
        burst, and ``retry_after_ms``.
        """
        user_limits = self.config.user_limits(tier)
        ukey = self.user_key(user_id, tenant)
        user = take(self._load(ukey), now_ms, user_limits, cost)
        if not user.allowed:
            raise RateLimitedError(
                "user", user_id, user_limits.rate_per_s, user_limits.burst, user.retry_after_ms
            )
        tkey = self.tenant_key(tenant, shard)
        tenant_result = take(self._load(tkey), now_ms, self._tenant_shard_limits(tenant), cost)
        if not tenant_result.allowed:
            configured = self.config.tenant_limits(tenant)
            raise RateLimitedError(
                "tenant", tenant, configured.rate_per_s, configured.burst, tenant_result.retry_after_ms
            )
        self.state[ukey] = user.state.to_dict()
        self.state[tkey] = tenant_result.state.to_dict()


@dataclass
class SweepSchedule:
    """When and where the intake agent looks for forgettable buckets, per partition.

    Every ``every`` records of a partition, :meth:`due` says yes and the agent examines the next
    ``keys`` entries of that partition's store from :meth:`cursor`, then reports with :meth:`moved`;
    a short scan means the end was reached, and the next starts from the first key again. So the
    table is swept at ``keys / every`` entries per request: new user ids cannot outgrow it.
    """

    every: int = 32
    keys: int = 96
    _count: dict[int, int] = field(default_factory=dict)
    _cursor: dict[int, bytes | None] = field(default_factory=dict)

    def due(self, partition: int) -> bool:
        """Called for each record of ``partition``: whether to sweep now."""
        n = self._count.get(partition, 0) + 1
        self._count[partition] = n
        return n % self.every == 0

    def cursor(self, partition: int) -> bytes | None:
        """The store key the next scan starts after (None: from the first)."""
        return self._cursor.get(partition)

    def moved(self, partition: int, last: bytes | None, scanned: int) -> None:
        """A scan of ``scanned`` entries ended at ``last``."""
        self._cursor[partition] = last if scanned >= self.keys else None
