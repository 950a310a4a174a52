"""The scheduler's order, admission, window and deadline handling, and the batch-time estimator.

All on a fake clock: no event loop, no broker, no sleeps.
"""

from __future__ import annotations

import math
from collections import defaultdict

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.batch_estimator import BatchTimeEstimator
from pipeline.exceptions import OverloadedError, SettingsError
from pipeline.scheduler import (
    DeadlinePolicy,
    EdfPolicy,
    FifoPolicy,
    Priority,
    QueuedItem,
    Scheduler,
    SchedulerConfig,
    Tier,
    absolute_deadline_ms,
    client_dated,
    make_queue_policy,
    request_created_ms,
)

T0 = 1_700_000_000_000.0


class FakeClock:
    def __init__(self, now: float = T0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def item(
    item_id: str,
    *,
    user: str | None = None,
    priority: Priority = Priority.INTERACTIVE,
    tier: Tier = Tier.STANDARD,
    deadline_in: float | None = 10_000.0,
    at: float = T0,
) -> QueuedItem:
    return QueuedItem(
        item_id=item_id,
        user_id=user or f"u-{item_id}",
        priority=priority,
        tier=tier,
        created_at_ms=at,
        deadline_at_ms=None if deadline_in is None else at + deadline_in,
        enqueued_at_ms=at,
    )


def make(policy: str | EdfPolicy = "edf", clock: FakeClock | None = None, **cfg: object) -> Scheduler:
    return Scheduler(SchedulerConfig(**cfg), policy=policy, clock=clock or FakeClock())  # type: ignore[arg-type]


def ids(items: list[QueuedItem]) -> list[str]:
    return [i.item_id for i in items]


# -- configuration ------------------------------------------------------------------------------


def test_config_rejects_base_above_max_naming_both_values() -> None:
    with pytest.raises(SettingsError) as err:
        SchedulerConfig(base_batch_size=40, max_batch_size=32)
    assert "base_batch_size=40" in str(err.value) and "max_batch_size=32" in str(err.value)


def test_config_rejects_delay_on_lowest_class_and_bad_numbers() -> None:
    with pytest.raises(SettingsError, match="offline"):
        SchedulerConfig(deadline_policy={Priority.OFFLINE: DeadlinePolicy.DELAY})
    with pytest.raises(SettingsError, match="queue_limit"):
        SchedulerConfig(queue_limit={Priority.BATCH: 0})
    with pytest.raises(SettingsError, match="deadline_ms"):
        SchedulerConfig(deadline_ms={Priority.REALTIME: 0})


def test_config_accepts_string_keys_and_keeps_defaults_for_missing_classes() -> None:
    cfg = SchedulerConfig(deadline_ms={"realtime": 100}, deadline_policy={"batch": "delay"})  # type: ignore[dict-item]
    assert cfg.deadline_ms[Priority.REALTIME] == 100
    assert cfg.deadline_ms[Priority.INTERACTIVE] == 500
    assert cfg.deadline_ms[Priority.OFFLINE] is None
    assert cfg.deadline_policy[Priority.BATCH] is DeadlinePolicy.DELAY
    assert cfg.deadline_policy[Priority.REALTIME] is DeadlinePolicy.REJECT


def test_unknown_queue_policy_names_the_choices() -> None:
    with pytest.raises(SettingsError, match="edf"):
        make_queue_policy("lifo")
    assert isinstance(make_queue_policy(), EdfPolicy)
    assert isinstance(make_queue_policy("FIFO"), FifoPolicy)


def test_priority_order_and_demotion_target() -> None:
    assert list(Priority) == [Priority.REALTIME, Priority.INTERACTIVE, Priority.BATCH, Priority.OFFLINE]
    assert Priority.REALTIME.is_higher_than(Priority.INTERACTIVE)
    assert not Priority.OFFLINE.is_higher_than(Priority.BATCH)
    assert Priority.BATCH.next_lower is Priority.OFFLINE and Priority.OFFLINE.next_lower is None


def test_make_item_request_deadline_shortens_but_never_lengthens_class_deadline() -> None:
    sched = make(clock=FakeClock(T0 + 30))
    short = sched.make_item(item_id="a", user_id="u", priority="realtime", created_at_ms=T0, deadline_ms=50)
    long = sched.make_item(item_id="b", user_id="u", priority="realtime", created_at_ms=T0, deadline_ms=9999)
    none = sched.make_item(item_id="c", user_id="u", priority="offline", created_at_ms=T0)
    assert short.deadline_at_ms == T0 + 50
    assert long.deadline_at_ms == T0 + 200
    assert none.deadline_at_ms is None
    assert short.enqueued_at_ms == T0 + 30 and short.tier is Tier.STANDARD


# -- order ------------------------------------------------------------------------------------------


def test_earliest_deadline_first_within_a_class() -> None:
    sched = make()
    for name, dl in [("late", 900), ("early", 100), ("mid", 400), ("none", None)]:
        sched.offer(item(name, deadline_in=dl))
    assert ids(sched.pop_batch(T0).items) == ["early", "mid", "late", "none"]


def test_premium_goes_ahead_of_earlier_deadlines_in_its_class_only() -> None:
    sched = make(policy=EdfPolicy(realtime_alone=False))
    sched.offer(item("std-early", deadline_in=50))
    sched.offer(item("free-early", tier=Tier.FREE, deadline_in=60))
    sched.offer(item("prem-late", tier=Tier.PREMIUM, deadline_in=900))
    sched.offer(item("rt-free", priority=Priority.REALTIME, tier=Tier.FREE, deadline_in=150))
    assert ids(sched.pop_batch(T0).items) == ["rt-free", "prem-late", "std-early", "free-early"]


def test_strict_priority_across_classes_regardless_of_deadlines() -> None:
    sched = make(policy=EdfPolicy(realtime_alone=False))
    sched.offer(item("off", priority=Priority.OFFLINE, deadline_in=None))
    sched.offer(item("batch", priority=Priority.BATCH, deadline_in=1))
    sched.offer(item("inter", priority=Priority.INTERACTIVE, deadline_in=300))
    sched.offer(item("rt", priority=Priority.REALTIME, deadline_in=199))
    assert ids(sched.pop_batch(T0).items) == ["rt", "inter", "batch", "off"]


def test_a_batch_with_realtime_items_holds_nothing_else() -> None:
    sched = make()
    sched.offer(item("inter", priority=Priority.INTERACTIVE, deadline_in=300))
    sched.offer(item("rt", priority=Priority.REALTIME, deadline_in=199))
    sched.offer(item("batch", priority=Priority.BATCH, deadline_in=1000))
    assert ids(sched.pop_batch(T0).items) == ["rt"]
    assert ids(sched.pop_batch(T0).items) == ["inter", "batch"]


def test_batch_is_cut_to_the_limit_and_the_rest_stays_in_order() -> None:
    sched = make(base_batch_size=1, max_batch_size=2)
    for n in range(5):
        sched.offer(item(f"i{n}", deadline_in=100 + n))
    assert sched.batch_limit() == 2
    first = sched.pop_batch(T0)
    assert ids(first.items) == ["i0", "i1"] and first.limit == 2
    assert ids(sched.pop_batch(T0).items) == ["i2", "i3"]
    assert ids(sched.pop_batch(T0).items) == ["i4"]
    assert sched.depth() == 0 and sched.pop_batch(T0).items == []


def test_one_users_later_item_with_earlier_deadline_waits_for_the_earlier_item() -> None:
    sched = make()
    sched.offer(item("a1", user="alice", deadline_in=900))
    sched.offer(item("b1", user="bob", deadline_in=500))
    sched.offer(item("a2", user="alice", deadline_in=100))
    assert ids(sched.pop_batch(T0).items) == ["b1", "a1", "a2"]


def test_users_next_item_competes_with_its_own_deadline_once_the_previous_left() -> None:
    sched = make(base_batch_size=1, max_batch_size=1)
    sched.offer(item("a1", user="alice", deadline_in=100))
    sched.offer(item("a2", user="alice", deadline_in=200))
    sched.offer(item("b1", user="bob", deadline_in=300))
    assert ids(sched.pop_batch(T0).items) == ["a1"]
    assert ids(sched.pop_batch(T0).items) == ["a2"]
    assert ids(sched.pop_batch(T0).items) == ["b1"]


# -- admission --------------------------------------------------------------------------------------


def test_overflow_raises_overloaded_with_depth_and_limit() -> None:
    sched = make(queue_limit={Priority.BATCH: 2})
    sched.offer(item("b1", priority=Priority.BATCH))
    sched.offer(item("b2", priority=Priority.BATCH))
    with pytest.raises(OverloadedError) as err:
        sched.offer(item("b3", priority=Priority.BATCH))
    assert (err.value.priority, err.value.depth, err.value.limit) == ("batch", 2, 2)
    assert err.value.code == "overloaded"
    sched.offer(item("i1", priority=Priority.INTERACTIVE))  # other classes have their own limit
    assert sched.depth(Priority.BATCH) == 2 and sched.depth() == 3


def test_can_admit_is_gated_by_higher_classes_and_by_the_class_limit() -> None:
    sched = make(queue_limit={Priority.INTERACTIVE: 1})
    assert all(sched.can_admit(p) for p in Priority)
    sched.offer(item("i1", priority=Priority.INTERACTIVE))
    assert sched.can_admit(Priority.REALTIME)
    assert not sched.can_admit(Priority.INTERACTIVE)  # full
    assert not sched.can_admit(Priority.BATCH)  # a higher class waits
    assert not sched.can_admit(Priority.OFFLINE)
    sched.pop_batch(T0)
    assert all(sched.can_admit(p) for p in Priority)


def test_fifo_policy_ignores_class_and_deadline_and_does_not_gate_reads() -> None:
    sched = make("fifo", queue_limit={Priority.OFFLINE: 1})
    sched.offer(item("off", priority=Priority.OFFLINE, deadline_in=None))
    sched.offer(item("batch", priority=Priority.BATCH, deadline_in=900))
    sched.offer(item("rt", priority=Priority.REALTIME, tier=Tier.PREMIUM, deadline_in=100))
    assert sched.can_admit(Priority.BATCH)  # no strict priority in the baseline
    assert not sched.can_admit(Priority.OFFLINE)  # but the class limit still holds
    assert sched.depth(Priority.REALTIME) == 1 and sched.depth() == 3
    assert ids(sched.pop_batch(T0).items) == ["off", "batch", "rt"]


def test_fifo_policy_still_rejects_expired_items() -> None:
    sched = make("fifo")
    sched.offer(item("old", deadline_in=10))
    sched.offer(item("fresh", deadline_in=1000))
    popped = sched.pop_batch(T0 + 50)
    assert ids(popped.expired) == ["old"] and ids(popped.items) == ["fresh"]


# -- the window -------------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [0, 1, 2, 3, 10, 20, 100, 1000])
def test_batch_limit_follows_the_log_formula(depth: int) -> None:
    sched = make(base_batch_size=8, max_batch_size=32, queue_limit={p: 2000 for p in Priority})
    for n in range(depth):
        sched.offer(item(f"i{n}", priority=list(Priority)[n % 4]))
    expected = max(1, min(32, math.ceil(8 * math.log(depth + 1))))
    assert sched.batch_limit() == expected
    if depth in (0, 1, 10, 1000):
        assert sched.batch_limit() == {0: 1, 1: 6, 10: 20, 1000: 32}[depth]


def test_flush_when_the_batch_limit_is_reached_before_max_wait() -> None:
    clock = FakeClock()
    sched = make(clock=clock, base_batch_size=1, max_batch_size=4, max_wait_ms=1000)
    assert sched.flush_at_ms() is None and not sched.ready(T0)
    for n in range(3):  # depth 3: limit ceil(ln 4) = 2 <= 3
        sched.offer(item(f"i{n}"))
    assert sched.batch_limit() == 2
    assert sched.ready(T0)


def test_flush_after_max_wait_counted_from_the_oldest_item() -> None:
    clock = FakeClock()
    sched = make(clock=clock, max_wait_ms=10)
    sched.offer(item("a", at=T0, deadline_in=None))
    sched.offer(item("b", at=T0 + 4, deadline_in=None))
    assert sched.flush_at_ms() == T0 + 10
    assert not sched.ready(T0 + 9.9)
    clock.now = T0 + 9.9
    assert not sched.ready()
    assert sched.ready(T0 + 10)
    assert ids(sched.pop_batch(T0 + 10).items) == ["a", "b"]


def test_flush_early_for_a_deadline_using_the_learnt_batch_time() -> None:
    est = BatchTimeEstimator(prior_weight=0.01)
    sched = Scheduler(SchedulerConfig(max_wait_ms=500, safety_margin_ms=5), estimator=est, clock=FakeClock())
    for _ in range(30):  # a model that takes 40 ms + 2 ms per item
        sched.record_batch(1, 0.042)
        sched.record_batch(10, 0.060)
    sched.offer(item("a", deadline_in=200))
    sched.offer(item("b", deadline_in=120))
    assert est.estimate_ms(2) == pytest.approx(44.0, abs=0.5)
    expected = T0 + 120 - est.estimate_ms(2) - 5
    assert sched.flush_at_ms() == pytest.approx(expected)
    assert not sched.ready(expected - 1)
    assert sched.ready(expected)
    # a slower model moves the flush earlier
    for _ in range(60):
        sched.record_batch(2, 0.100)
    assert sched.flush_at_ms() < expected - 40


def test_flush_ignores_deadlines_of_items_the_next_batch_will_not_take() -> None:
    sched = make(base_batch_size=1, max_batch_size=1, max_wait_ms=50)
    sched.offer(item("rt", priority=Priority.REALTIME, deadline_in=1000))
    sched.offer(item("inter", priority=Priority.INTERACTIVE, deadline_in=30))
    # depth 2 -> limit 1 -> the next batch is the realtime item alone
    assert sched.flush_at_ms() == T0 + 50


def test_a_batch_that_takes_a_real_time_item_has_its_own_window() -> None:
    sched = make(max_wait_ms=10, realtime_max_wait_ms=0)
    sched.offer(item("batch", priority=Priority.BATCH, at=T0, deadline_in=None))
    assert sched.flush_at_ms() == T0 + 10, "no real-time item: the general window"
    sched.offer(item("rt", priority=Priority.REALTIME, at=T0 + 3, deadline_in=None))
    assert sched.flush_at_ms() == T0 + 3, "the real-time item runs as soon as the model is free"
    assert sched.ready(T0 + 3) and not sched.ready(T0 + 2.9)
    assert ids(sched.pop_batch(T0 + 3).items)[0] == "rt"
    later = make(max_wait_ms=10, realtime_max_wait_ms=4)
    later.offer(item("rt", priority=Priority.REALTIME, at=T0, deadline_in=None))
    assert later.flush_at_ms() == T0 + 4
    assert make(max_wait_ms=10).config.realtime_max_wait_ms is None, "unset: the general window"
    with pytest.raises(SettingsError, match="realtime_max_wait_ms must be >= 0"):
        make(realtime_max_wait_ms=-1)


# -- deadlines --------------------------------------------------------------------------------------


def test_reject_policy_hands_back_expired_items_and_serves_the_rest() -> None:
    sched = make(policy=EdfPolicy(realtime_alone=False))
    sched.offer(item("gone", priority=Priority.REALTIME, deadline_in=100))
    sched.offer(item("edge", priority=Priority.REALTIME, deadline_in=150))
    sched.offer(item("ok", priority=Priority.INTERACTIVE, deadline_in=500))
    popped = sched.pop_batch(T0 + 150)
    assert ids(popped.expired) == ["gone"]
    assert ids(popped.items) == ["edge", "ok"]  # a deadline equal to now has not passed
    assert popped.demoted == [] and sched.depth() == 0


def test_delay_policy_moves_expired_items_one_class_down_with_a_fresh_deadline() -> None:
    sched = make(
        base_batch_size=1,
        max_batch_size=1,
        deadline_policy={Priority.REALTIME: DeadlinePolicy.DELAY},
        deadline_ms={Priority.INTERACTIVE: 500},
    )
    sched.offer(item("i-early", user="bob", priority=Priority.INTERACTIVE, deadline_in=1000))
    sched.offer(item("late-rt", user="ann", priority=Priority.REALTIME, deadline_in=100))
    popped = sched.pop_batch(T0 + 120)
    assert popped.expired == []
    assert ids(popped.demoted) == ["late-rt"]
    moved = popped.demoted[0]
    assert moved.priority is Priority.INTERACTIVE
    assert moved.deadline_at_ms == T0 + 120 + 500
    assert moved.created_at_ms == T0
    # in its new class it competes by its new deadline (T0 + 620 < T0 + 1000), so it goes first
    assert ids(popped.items) == ["late-rt"] and popped.items[0].priority is Priority.INTERACTIVE
    assert ids(sched.pop_batch(T0 + 130).items) == ["i-early"]


def test_delay_into_a_full_class_rejects_instead() -> None:
    sched = make(
        deadline_policy={Priority.BATCH: DeadlinePolicy.DELAY},
        queue_limit={Priority.OFFLINE: 1},
    )
    sched.offer(item("off", priority=Priority.OFFLINE, deadline_in=None))
    sched.offer(item("b", priority=Priority.BATCH, deadline_in=10))
    popped = sched.pop_batch(T0 + 20)
    assert ids(popped.expired) == ["b"] and popped.demoted == []
    assert popped.expired[0].priority is Priority.BATCH


def test_delay_into_a_class_without_deadline_clears_the_deadline() -> None:
    sched = make(deadline_policy={Priority.BATCH: DeadlinePolicy.DELAY})
    sched.offer(item("b", priority=Priority.BATCH, deadline_in=10))
    popped = sched.pop_batch(T0 + 20)
    assert popped.demoted[0].priority is Priority.OFFLINE
    assert popped.demoted[0].deadline_at_ms is None
    assert ids(popped.items) == ["b"]


def test_expired_items_make_the_window_ready_so_they_are_answered_promptly() -> None:
    sched = make(max_wait_ms=1000)
    sched.offer(item("x", deadline_in=20))
    assert not sched.ready(T0)
    assert sched.ready(T0 + 21)
    assert ids(sched.pop_batch(T0 + 21).expired) == ["x"]


# -- properties -------------------------------------------------------------------------------------

_op = st.one_of(
    st.tuples(
        st.just("offer"),
        st.integers(0, 3),  # user
        st.sampled_from(list(Priority)),
        st.sampled_from(list(Tier)),
        st.one_of(st.none(), st.integers(1, 400)),  # deadline from now, ms
    ),
    st.tuples(st.just("advance"), st.integers(0, 120)),
    st.tuples(
        st.just("pop"),
    ),
)


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(_op, max_size=80),
    policy=st.sampled_from(["edf", "fifo"]),
    delay=st.booleans(),
    limit=st.integers(1, 8),
)
def test_one_users_items_leave_their_class_in_offer_order_and_none_is_lost(
    ops: list[tuple], policy: str, delay: bool, limit: int
) -> None:
    clock = FakeClock()
    policies = (
        {Priority.REALTIME: DeadlinePolicy.DELAY, Priority.BATCH: DeadlinePolicy.DELAY} if delay else {}
    )
    sched = make(
        policy,
        clock,
        base_batch_size=2,
        max_batch_size=4,
        queue_limit={p: limit for p in Priority},
        deadline_policy=policies,
    )
    offered: dict[str, tuple[str, Priority, int]] = {}
    taken: list[QueuedItem] = []
    expired: list[QueuedItem] = []
    for n, op in enumerate(ops):
        if op[0] == "offer":
            _, user, prio, tier, dl = op
            it = item(str(n), user=f"u{user}", priority=prio, tier=tier, deadline_in=dl, at=clock.now)
            try:
                sched.offer(it)
            except OverloadedError as err:
                assert err.depth == limit == sched.depth(prio)
                continue
            offered[it.item_id] = (it.user_id, prio, n)
        elif op[0] == "advance":
            clock.now += op[1]
        else:
            popped = sched.pop_batch(clock.now)
            assert len(popped.items) <= popped.limit
            taken += popped.items
            expired += popped.expired
    while sched.depth():
        popped = sched.pop_batch(clock.now)
        taken += popped.items
        expired += popped.expired

    # every accepted item leaves exactly once, served or expired
    assert sorted(ids(taken) + ids(expired)) == sorted(offered)
    # within one class, one user's items (those not moved to another class) leave in offer order
    seen: dict[tuple[str, Priority], list[int]] = defaultdict(list)
    for it in taken:
        user, prio, n = offered[it.item_id]
        if it.priority is prio:
            seen[(user, prio)].append(n)
    for order in seen.values():
        assert order == sorted(order)


@settings(max_examples=100, deadline=None)
@given(
    entries=st.lists(
        st.tuples(st.sampled_from(list(Priority)), st.sampled_from(list(Tier)), st.integers(1, 1000)),
        min_size=1,
        max_size=40,
    )
)
def test_edf_takes_classes_in_order_then_premium_then_deadline_when_users_are_distinct(
    entries: list[tuple[Priority, Tier, int]],
) -> None:
    sched = make(queue_limit={p: 100 for p in Priority})
    for n, (prio, tier, dl) in enumerate(entries):
        sched.offer(item(str(n), priority=prio, tier=tier, deadline_in=dl))
    out: list[QueuedItem] = []
    while sched.depth():
        out += sched.pop_batch(T0).items
    keys = [(i.priority.rank, i.tier.rank, i.deadline_at_ms, int(i.item_id)) for i in out]
    assert keys == sorted(keys)


# -- the estimator ----------------------------------------------------------------------------------


def test_estimator_uses_its_prior_before_any_batch() -> None:
    est = BatchTimeEstimator(prior_fixed_ms=10, prior_per_item_ms=2)
    assert est.observations == 0
    assert est.estimate_ms(1) == pytest.approx(12)
    assert est.estimate_ms(16) == pytest.approx(42)


def test_estimator_learns_a_linear_cost_from_recent_batches() -> None:
    est = BatchTimeEstimator(prior_fixed_ms=10, prior_per_item_ms=2)
    for size in [1, 4, 8, 16, 32] * 10:
        est.observe(size, (25 + 3 * size) / 1000)
    assert est.fixed_ms == pytest.approx(25, abs=0.5)
    assert est.per_item_ms == pytest.approx(3, abs=0.05)
    assert est.estimate_ms(10) == pytest.approx(55, abs=1)


def test_estimator_follows_a_change_and_forgets_old_batches() -> None:
    est = BatchTimeEstimator(window=32, halflife=4)
    for size in [2, 8] * 20:
        est.observe(size, 0.010 * size)
    for size in [2, 8] * 20:
        est.observe(size, 0.030 * size)
    assert est.observations == 32
    assert est.per_item_ms == pytest.approx(30, rel=0.02)


def test_estimator_is_never_negative() -> None:
    est = BatchTimeEstimator(prior_weight=0.01)
    for _ in range(20):  # bigger batches measured faster: noise, not physics
        est.observe(1, 0.050)
        est.observe(32, 0.001)
    assert est.per_item_ms == 0.0
    assert all(est.estimate_ms(s) >= 0 for s in (0, 1, 8, 32, 1000))
    with pytest.raises(ValueError):
        est.observe(4, -0.1)
    with pytest.raises(ValueError):
        est.observe(0, 0.1)
    with pytest.raises(SettingsError):
        BatchTimeEstimator(window=0)


@pytest.mark.parametrize("policy", ["edf", "fifo"])
def test_take_where_removes_what_it_selects_in_arrival_order_and_the_queue_works_on(policy: str) -> None:
    """A rebalance's drain gives back what waits: every class, none left behind for a batch or
    for the deadline sweep, and items offered afterwards are queued as usual."""
    clock = FakeClock()
    s = make(policy, clock)
    classes = [Priority.OFFLINE, Priority.REALTIME, Priority.BATCH, Priority.INTERACTIVE]
    for k, p in enumerate(classes):
        s.offer(item(f"i{k}", priority=p, deadline_in=None if p is Priority.OFFLINE else 50.0))
    s.offer(item("kept", priority=Priority.BATCH, deadline_in=None))
    assert ids(s.take_where(lambda i: i.item_id != "kept")) == ["i0", "i1", "i2", "i3"]
    assert s.depth() == 1 and s.depth(Priority.BATCH) == 1
    assert ids(s.take_where(lambda i: True)) == ["kept"]
    assert s.depth() == 0 and all(n == 0 for n in s.depths().values())
    assert s.flush_at_ms() is None and not s.ready()
    clock.now += 1_000  # the given-back items' deadlines have passed: none of them comes back
    popped = s.pop_batch()
    assert popped.items == [] and popped.expired == []
    s.offer(item("late", at=clock.now))
    assert ids(s.pop_batch().items) == ["late"]


def test_a_request_dated_early_by_more_than_a_quarter_of_its_deadline_is_client_dated() -> None:
    """Back-dated by 190 ms, a real-time request (200 ms) passed intake as on time with the 1 s clock
    slack, missed inside the worker and counted against everyone's degradation level. Now the slack
    is at most a quarter of the class deadline: 50 ms for real-time, 125 for interactive."""
    record = 1_700_000_000_000
    assert client_dated(record - 190, record, 200)
    assert not client_dated(record - 50, record, 200)  # a producer's clock or a slow send: on time
    assert client_dated(record - 126, record, 500) and not client_dated(record - 125, record, 500)
    assert not client_dated(record - 1_000, record, 5_000)  # batch: the 1 s slack
    assert client_dated(record - 1_001, record, None)  # offline: the slack alone
    assert not client_dated(record + 900, record, 200)  # dated after its record: never early


def test_a_request_dated_in_the_future_never_lengthens_its_deadline() -> None:
    record, now = 1_700_000_000_000, 1_700_000_000_050
    assert request_created_ms(None, record, now) == record  # no created_at: the record's timestamp
    assert request_created_ms(record - 60_000, record, now) == record - 60_000  # dated early: kept
    assert request_created_ms(record + 900, record, now) == record + 900  # within the clock slack
    # an hour ahead: counted from the record's time plus the slack, so a real-time request still
    # expires 200 ms (+ slack) after it was written instead of an hour later
    created = request_created_ms(record + 3_600_000, record, now, slack_ms=1_000)
    assert created == record + 1_000
    assert absolute_deadline_ms(created, 200, None) == record + 1_200
    # the producer chose the record's timestamp an hour ahead too: the worker's clock bounds both
    ahead = record + 3_600_000
    assert request_created_ms(None, ahead, now, slack_ms=1_000) == now + 1_000
    assert request_created_ms(ahead, ahead, now, slack_ms=1_000) == now + 1_000
