"""Token buckets: the admission bound, refill, retry_after, and user vs tenant scope."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.exceptions import InvalidRequestError, RateLimitedError, SettingsError
from pipeline.ratelimit import BucketState, RateLimitConfig, RateLimiter, TierLimits, charge_time_ms, take

rates = st.floats(min_value=0.1, max_value=1000.0, allow_nan=False)
bursts = st.floats(min_value=1.0, max_value=200.0, allow_nan=False)


@settings(max_examples=200, deadline=None)
@given(
    rate=rates,
    burst=bursts,
    horizon_ms=st.floats(min_value=0.0, max_value=60_000.0),
    fractions=st.lists(st.floats(min_value=0.0, max_value=1.0), max_size=300),
    cost=st.sampled_from([1.0, 1.0, 0.5, 2.5]),
)
def test_admitted_in_any_window_never_exceeds_rate_times_t_plus_burst(
    rate: float, burst: float, horizon_ms: float, fractions: list[float], cost: float
) -> None:
    cost = min(cost, burst)
    limits = TierLimits(rate_per_s=rate, burst=burst)
    times = np.sort(np.array(fractions, dtype=float) * horizon_ms)
    state: BucketState | None = None
    admitted = np.zeros(len(times))
    for i, t in enumerate(times):
        result = take(state, float(t), limits, cost)
        state = result.state
        admitted[i] = cost if result.allowed else 0.0
        assert result.allowed == (result.retry_after_ms == 0)
    # every window [times[i], times[j]], not only the whole run: the burst cap must hold after idle time
    cumulative = np.concatenate([[0.0], np.cumsum(admitted)])
    in_window = cumulative[None, 1:] - cumulative[:-1, None]  # [i, j]: admitted from i to j inclusive
    bound = rate * (times[None, :] - times[:, None]) / 1000.0 + burst + 1e-6
    upper = np.triu(np.ones((len(times), len(times)), dtype=bool))
    assert np.all(in_window[upper] <= bound[upper])


def test_full_bucket_admits_burst_then_refuses() -> None:
    limits = TierLimits(rate_per_s=2.0, burst=5.0)
    state = None
    for _ in range(5):
        result = take(state, 1_000.0, limits)
        assert result.allowed
        state = result.state
    refused = take(state, 1_000.0, limits)
    assert not refused.allowed
    assert refused.retry_after_ms == 500  # 1 token at 2/s


def test_refill_is_rate_times_elapsed_capped_at_burst() -> None:
    limits = TierLimits(rate_per_s=10.0, burst=20.0)
    empty = BucketState(tokens=0.0, updated_ms=0.0)
    half_second = take(empty, 500.0, limits)
    assert half_second.allowed
    assert half_second.state.tokens == pytest.approx(4.0)  # 5 refilled, 1 taken
    hour_later = take(empty, 3_600_000.0, limits)
    assert hour_later.state.tokens == pytest.approx(19.0)  # capped at 20, 1 taken


def test_clock_going_backwards_refills_nothing() -> None:
    limits = TierLimits(rate_per_s=10.0, burst=20.0)
    state = BucketState(tokens=0.5, updated_ms=10_000.0)
    result = take(state, 9_000.0, limits)
    assert not result.allowed
    assert result.state == BucketState(tokens=0.5, updated_ms=10_000.0)
    assert result.retry_after_ms == 50


@settings(max_examples=300, deadline=None)
@given(
    rate=rates,
    burst=bursts,
    tokens_frac=st.floats(min_value=0.0, max_value=0.999),
    cost_frac=st.floats(min_value=0.01, max_value=1.0),
)
def test_retry_after_is_exactly_enough(
    rate: float, burst: float, tokens_frac: float, cost_frac: float
) -> None:
    limits = TierLimits(rate_per_s=rate, burst=burst)
    cost = max(cost_frac * burst, 1e-3)
    state = BucketState(tokens=tokens_frac * cost, updated_ms=1_000.0)
    refused = take(state, 1_000.0, limits, cost)
    if refused.allowed:  # only when the bucket is within float tolerance of the cost
        return
    wait = refused.retry_after_ms
    assert take(state, 1_000.0 + wait, limits, cost).allowed
    if wait > 1:
        assert not take(state, 1_000.0 + wait - 1.001, limits, cost).allowed


def test_cost_above_burst_is_refused_as_invalid() -> None:
    with pytest.raises(InvalidRequestError, match="burst 5"):
        take(None, 0.0, TierLimits(rate_per_s=1.0, burst=5.0), cost=6.0)


def test_state_round_trips_through_json() -> None:
    state = BucketState(tokens=3.25, updated_ms=1_700_000_000_123.5)
    assert BucketState.from_dict(json.loads(json.dumps(state.to_dict()))) == state
    with pytest.raises(ValueError, match="malformed"):
        BucketState.from_dict({"tokens": "many"})


def test_config_validation_names_the_values() -> None:
    with pytest.raises(SettingsError, match="rate_per_s"):
        TierLimits(rate_per_s=0.0, burst=5.0)
    with pytest.raises(SettingsError, match="burst"):
        TierLimits(rate_per_s=1.0, burst=0.5)
    with pytest.raises(SettingsError, match="premium"):
        RateLimitConfig(users={"free": TierLimits(1, 2), "standard": TierLimits(2, 4)})
    with pytest.raises(SettingsError, match=r"rate_per_s 100 exceeds the tenant rate_per_s 20"):
        RateLimitConfig(tenant=TierLimits(rate_per_s=20.0, burst=40.0))
    with pytest.raises(InvalidRequestError, match="known tiers"):
        RateLimitConfig().user_limits("gold")


def _limiter(
    tenant: TierLimits,
) -> tuple[RateLimiter, dict[str, dict]]:
    config = RateLimitConfig(
        users={
            "free": TierLimits(2.0, 5.0),
            "standard": TierLimits(10.0, 20.0),
            "premium": TierLimits(50.0, 100.0),
        },
        tenant=TierLimits(500.0, 1000.0),
        tenant_overrides={"small": tenant},
    )
    table: dict[str, dict] = {}
    return RateLimiter(config, table), table


def test_user_bucket_refuses_with_user_scope_and_numbers() -> None:
    limiter, table = _limiter(tenant=TierLimits(100.0, 100.0))
    for _ in range(5):
        limiter.check("alice", "free", "small", now_ms=0.0)
    with pytest.raises(RateLimitedError) as info:
        limiter.check("alice", "free", "small", now_ms=0.0)
    err = info.value
    assert (err.scope, err.key, err.rate_per_s, err.burst, err.retry_after_ms) == (
        "user",
        "alice",
        2.0,
        5.0,
        500,
    )
    assert err.code == "rate_limited"
    # another user of the same tenant is unaffected; the tenant bucket counted 6 admitted requests
    limiter.check("bob", "free", "small", now_ms=0.0)
    assert table["tenant:small"]["tokens"] == pytest.approx(94.0)
    assert set(table) == {"user:5:small:alice", "user:5:small:bob", "tenant:small"}


def test_one_user_id_in_two_tenants_has_two_buckets() -> None:
    """User ``bob`` of tenant acme and user ``bob`` of tenant beta (or the risk escalation's account
    ``acme/bob`` and the gateway's ``acme/bob``) once shared the bucket ``user:bob``: a client of one
    tenant could drain the other's."""
    limiter, table = _limiter(tenant=TierLimits(100.0, 100.0))
    for _ in range(5):
        limiter.check("bob", "free", "acme", now_ms=0.0)
    with pytest.raises(RateLimitedError):
        limiter.check("bob", "free", "acme", now_ms=0.0)
    limiter.check("bob", "free", "beta", now_ms=0.0)  # another tenant's bob: a full bucket
    assert {"user:4:acme:bob", "user:4:beta:bob"} <= set(table)
    assert RateLimiter.user_key("a:b", "c") != RateLimiter.user_key("b", "a:c")


def test_a_client_s_dates_cannot_refill_its_bucket() -> None:
    """Free tier: 2/s, burst 5. A client dating each request one refill (2.5 s) after the last, all
    years in the past, found the bucket full every time when its created_at decided the charge: 50
    requests in one instant, all admitted. Charged no earlier than the record's broker time less the
    slack, the sixth is refused; a backlog's own times within that still count (no burst)."""
    now = 1_700_000_000_000.0
    limiter, _ = _limiter(tenant=TierLimits(1_000.0, 1_000.0))
    admitted = 0
    for i in range(50):
        created = 1_000_000.0 + i * 2_500  # 1970, each a full refill after the one before
        try:
            limiter.check("mallory", "free", "small", charge_time_ms(created, now, now, 1_000))
            admitted += 1
        except RateLimitedError:
            pass
    assert admitted == 5
    # its own time, between its record's time less the slack and now: kept
    assert charge_time_ms(now - 400, now - 300, now, 1_000) == now - 400
    assert charge_time_ms(now - 5_000, now - 300, now, 1_000) == now - 1_300
    assert charge_time_ms(now + 900, now + 900, now, 1_000) == now  # never after now
    # a backlog: records appended a minute ago, read now, charged at their own times
    assert charge_time_ms(now - 60_000, now - 60_000, now, 1_000) == now - 60_000


def test_tenant_refusal_does_not_charge_the_user() -> None:
    limiter, table = _limiter(tenant=TierLimits(1.0, 3.0))
    for user in ("u1", "u2", "u3"):
        limiter.check(user, "free", "small", now_ms=0.0)
    with pytest.raises(RateLimitedError) as info:
        limiter.check("u4", "free", "small", now_ms=0.0)
    assert (info.value.scope, info.value.key, info.value.retry_after_ms) == ("tenant", "small", 1000)
    assert "user:5:small:u4" not in table  # nothing written for a refused request
    before = dict(table["user:5:small:u1"])
    with pytest.raises(RateLimitedError):
        limiter.check("u1", "free", "small", now_ms=100.0)
    assert table["user:5:small:u1"] == before
    limiter.check("u4", "free", "small", now_ms=1_000.0)  # the tenant refilled one token
    assert table["user:5:small:u4"]["tokens"] == pytest.approx(4.0)


def test_tenants_do_not_share_buckets() -> None:
    limiter, _ = _limiter(tenant=TierLimits(1.0, 1.0))
    limiter.check("u1", "standard", "small", now_ms=0.0)
    with pytest.raises(RateLimitedError):
        limiter.check("u2", "standard", "small", now_ms=0.0)
    limiter.check("u2", "standard", "acme", now_ms=0.0)


def test_sharded_tenant_buckets_sum_to_the_tenant_limit() -> None:
    config = RateLimitConfig(tenant=TierLimits(rate_per_s=160.0, burst=160.0))
    table: dict[str, dict] = {}
    limiter = RateLimiter(config, table, tenant_shards=8)
    admitted = 0
    for i in range(400):  # 400 distinct users at one instant, spread over 8 partitions
        try:
            limiter.check(f"u{i}", "premium", "acme", now_ms=0.0, shard=i % 8)
            admitted += 1
        except RateLimitedError as err:
            assert (
                err.scope == "tenant" and err.rate_per_s == 160.0
            )  # the configured, not the per-shard, limit
    assert admitted == 160
    assert {k for k in table if k.startswith("tenant:")} == {f"tenant:acme#{s}" for s in range(8)}


# ---- forgetting idle buckets (a stream of new user ids must not grow the table forever) ----------
@settings(max_examples=200, deadline=None)
@given(
    tier=st.sampled_from(["free", "standard", "premium"]),
    gaps_ms=st.lists(st.floats(min_value=0.0, max_value=8_000.0), min_size=1, max_size=40),
    later_ms=st.floats(min_value=0.0, max_value=20_000.0),
)
def test_forgetting_a_forgettable_bucket_changes_no_decision(
    tier: str, gaps_ms: list[float], later_ms: float
) -> None:
    """Whenever forgettable() says a bucket may go, a limiter that dropped it and one that kept it
    decide every later request alike."""
    kept: dict = {}
    forgot: dict = {}
    a, b = RateLimiter(RateLimitConfig(), kept), RateLimiter(RateLimitConfig(), forgot)
    now = 1_000_000.0
    for gap in gaps_ms:
        now += gap
        for lim, store in ((a, kept), (b, forgot)):
            for key in list(store):
                if lim is b and b.forgettable(key, store[key], now):
                    del store[key]
        outcomes = []
        for lim in (a, b):
            try:
                lim.check("u1", tier, "t1", now)
                outcomes.append(True)
            except RateLimitedError:
                outcomes.append(False)
        assert outcomes[0] == outcomes[1]
    now += later_ms
    ukey = RateLimiter.user_key("u1", "t1")
    if b.forgettable(ukey, kept.get(ukey), now):
        # dropped now: the next decision must be what the full bucket gives
        assert take(BucketState.from_dict(kept[ukey]), now, RateLimitConfig().users[tier]).allowed


def test_forgettable_needs_the_slowest_tier_to_be_full_again() -> None:
    lim = RateLimiter(RateLimitConfig(), {})
    lim.check("u1", "premium", "t1", 0.0)
    ukey = RateLimiter.user_key("u1", "t1")
    raw = lim.state[ukey]
    slowest_ms = max(t.burst / t.rate_per_s for t in RateLimitConfig().users.values()) * 1000
    assert not lim.forgettable(ukey, raw, slowest_ms - 1)
    assert lim.forgettable(ukey, raw, slowest_ms)
    assert lim.forgettable(ukey, {"tokens": "x"}, 0.0), "a malformed entry goes"
    shards = RateLimiter(RateLimitConfig(), {}, tenant_shards=8)
    shards.check("u1", "free", "acme", 0.0, shard=3)
    t = RateLimitConfig().tenant
    assert not shards.forgettable(
        "tenant:acme#3", shards.state["tenant:acme#3"], t.burst / t.rate_per_s * 1000 - 1
    )
    assert shards.forgettable("tenant:acme#3", shards.state["tenant:acme#3"], t.burst / t.rate_per_s * 1000)


def test_the_sweep_schedule_walks_each_partition_and_wraps() -> None:
    from pipeline.ratelimit import SweepSchedule

    sched = SweepSchedule(every=3, keys=2)
    assert [sched.due(0) for _ in range(6)] == [False, False, True, False, False, True]
    assert sched.cursor(0) is None and not sched.due(1)
    sched.moved(0, b"k2", 2)
    assert sched.cursor(0) == b"k2" and sched.cursor(1) is None
    sched.moved(0, b"k3", 1)  # a short scan reached the end: start again from the first key
    assert sched.cursor(0) is None
