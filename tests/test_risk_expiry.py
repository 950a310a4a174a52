"""Entity states that expire (pipeline/risk/expiry.py, ``Stage.state``): the rule, the stored time
the sweep reads without decoding, which stored states the sweep deletes, and its schedule. The
agent's sweep on the real broker: tests/test_risk_expiry_integration.py."""

from __future__ import annotations

from typing import Any

from pipeline.risk.expiry import SweepPlan, expired, expired_keys, sweep, written_ms
from pipeline.risk.features import NAMES, SPECS, EntityState, FeatureConfig
from pipeline.risk.stages import Stage, StateCache, new_item

T0 = 1_735_689_600_000
TTL_MS = 60_000
CFG = FeatureConfig(state_ttl_ms=TTL_MS)


def ev(i: int, t: int, account: str = "a1", device: str | None = "d1") -> dict[str, Any]:
    return {
        "event_id": f"e{i}",
        "type": "payment",
        "account": account,
        "card": "c1",
        "device": device,
        "ip": None,
        "amount": 10.0,
        "currency": "EUR",
        "merchant": "m1",
        "country": "DE",
        "event_time_ms": t,
    }


def account_stage(cfg: FeatureConfig = CFG, cache_entries: int = 100) -> tuple[Stage, dict[str, bytes]]:
    """An account stage over a dict standing in for its table (written as the agent writes it)."""
    store: dict[str, bytes] = {}
    return Stage("account", cfg, 4, StateCache(cache_entries), lambda key, _ctx: store.get(key)), store


def run(stage: Stage, store: dict[str, bytes], i: int, t: int, now: int | None) -> tuple[dict[str, Any], int]:
    """One event through the stage at worker clock ``now``, its changed states written to ``store``;
    the account's features and how many states were found expired."""
    res = stage.run([(new_item(ev(i, t), "v1", t, t), None)], now_ms=now)
    for key, (st, _) in res.dirty.items():
        store[key] = st.dumps()
    item = next(iter(res.forward.values()))[0]  # on to the card's stage
    return dict(zip(NAMES["account"], item["f"]["account"], strict=True)), res.expired


def test_the_rule_counts_from_the_last_change_and_never_with_ttl_0_or_no_time() -> None:
    assert not expired(1_000, 1_000 + TTL_MS, TTL_MS)  # exactly the TTL: still live
    assert expired(1_000, 1_000 + TTL_MS + 1, TTL_MS)
    assert not expired(1_000, 10**15, 0)  # 0: never
    assert not expired(None, 10**15, TTL_MS)  # written offline, or before expiry existed


def test_the_stored_time_is_read_from_the_first_field_without_decoding() -> None:
    st = EntityState(SPECS["card"], CFG)
    assert written_ms(st.dumps()) is None  # never changed online
    st.wrote = T0 + 123
    data = st.dumps()
    assert data.startswith(b'{"w":') and written_ms(data) == T0 + 123
    assert EntityState.loads(data, SPECS["card"], CFG).wrote == T0 + 123
    # a state written before expiry existed has no "w": it loads, and never expires
    legacy = data.replace(b'"w":%d,' % (T0 + 123), b"")
    assert written_ms(legacy) is None and EntityState.loads(legacy, SPECS["card"], CFG).wrote is None


def test_an_expired_state_reads_as_a_new_entity_and_a_live_one_does_not() -> None:
    stage, store = account_stage()
    now = T0 + 5_000
    run(stage, store, 1, T0, now)
    f, n = run(stage, store, 2, T0 + 1_000, now + TTL_MS)  # changed exactly a TTL ago: live
    assert n == 0 and f["account_count_24h"] == 1 and f["account_new_device"] == 0
    f, n = run(stage, store, 3, T0 + 2_000, now + 2 * TTL_MS + 1)  # 1 ms past the TTL since e2
    assert n == 1
    # as a new entity: nothing counted, no time since a last event, no first-seen answer
    assert f["account_count_24h"] == 0 and f["account_since_last_s"] is None
    assert f["account_new_device"] is None
    assert written_ms(store["a1"]) == now + 2 * TTL_MS + 1  # the new state records its change


def test_a_cached_state_expires_like_a_stored_one_and_offline_nothing_expires() -> None:
    for cache_entries in (0, 100):  # read from the store each time, or kept decoded
        stage, store = account_stage(cache_entries=cache_entries)
        run(stage, store, 1, T0, T0)
        f, n = run(stage, store, 2, T0 + 1, T0 + TTL_MS + 1)
        assert (n, f["account_count_24h"]) == (1, 0), cache_entries
    stage, store = account_stage()
    run(stage, store, 1, T0, None)
    f, n = run(stage, store, 2, T0 + 1, None)
    assert (n, f["account_count_24h"]) == (0, 1)
    stage, store = account_stage(FeatureConfig(state_ttl_ms=0))
    run(stage, store, 1, T0, T0)
    f, n = run(stage, store, 2, T0 + 1, T0 + 10 * TTL_MS)
    assert (n, f["account_count_24h"]) == (0, 1)


def test_the_sweep_picks_expired_stored_states_only() -> None:
    def stored(wrote: int | None) -> bytes:
        st = EntityState(SPECS["ip"], CFG)
        st.wrote = wrote
        return st.dumps()

    now = T0 + 10 * TTL_MS
    entries = [
        (b'"old"', stored(now - TTL_MS - 1)),
        (b'"edge"', stored(now - TTL_MS)),
        (b'"new"', stored(now - 1)),
        (b'"untimed"', stored(None)),
        (b'"tombstone"', None),
    ]
    assert expired_keys(entries, now, TTL_MS) == [b'"old"']
    assert expired_keys(entries, now, 0) == []


def test_the_plan_asks_two_keys_per_new_entity_and_a_little_per_item() -> None:
    plan = SweepPlan(keys=64, per_new=2.0, per_item=1 / 64, max_keys=256)
    assert plan.owe(0, 10, 31) == 0  # 62.2 owed
    assert plan.owe(0, 1, 1) == 64  # 64.2: one look, 0.2 carried over
    assert plan.owe(1, 64 * 63, 0) == 0  # partitions owe apart; items alone owe little (63)
    assert plan.owe(1, 64, 0) == 64
    # a batch of many new entities asks for several looks, at most max_keys, and carries the rest
    assert plan.owe(0, 500, 500) == 256
    assert plan.owe(0, 0, 0) == 256
    assert plan.owe(0, 0, 0) == 256
    assert plan.owe(0, 0, 0) == 192  # 1,000 + 7.8 + 0.2 owed in all
    plan.moved(0, b'"k"', 64, 64)
    assert plan.cursor(0) == b'"k"'
    plan.moved(0, b'"z"', 10, 64)  # a short look reached the end: the next starts again
    assert plan.cursor(0) is None


def test_a_table_of_ever_new_entities_stays_within_about_twice_its_live_states() -> None:
    """Every event a new account (the most a table can grow), one a millisecond, a TTL of a second:
    about 1,000 states are live at any time; the sweep keeps the store near that, where without it
    the store would hold all 20,000."""
    ttl_ms, n = 1_000, 20_000
    cfg = FeatureConfig(state_ttl_ms=ttl_ms)
    store: dict[bytes, bytes] = {}
    stage = Stage("account", cfg, 1, StateCache(0), lambda key, _ctx: store.get(f'"{key}"'.encode()))
    plan, largest = SweepPlan(), 0

    def scan(after: bytes | None, limit: int) -> list[tuple[bytes, bytes | None]]:
        keys = sorted(k for k in store if after is None or k > after)[:limit]
        return [(k, store[k]) for k in keys]

    for i in range(n):
        now = T0 + i
        e = {**ev(i, now, account=f"acct-{i * 7919 % n:05d}"), "card": None}
        res = stage.run([(new_item(e, "v1", now, now), None)], [(0, i, 0)], now_ms=now)
        for key, (st, _) in res.dirty.items():
            store[f'"{key}"'.encode()] = st.dumps()
        for key in sweep(plan, 0, 1, res.new.get(0, 0), scan, now, ttl_ms, lambda _k: False):
            del store[key]
        largest = max(largest, len(store))
    assert res.new == {0: 1}
    assert 1_000 < largest <= 2_200, largest


def test_the_sweep_leaves_a_state_a_batch_in_flight_changed() -> None:
    stale = EntityState(SPECS["ip"], CFG)
    stale.wrote = T0
    entries = [(b'"a"', stale.dumps()), (b'"b"', stale.dumps())]
    plan = SweepPlan(keys=2)
    gone = sweep(plan, 0, 0, 1, lambda _after, _n: entries, T0 + TTL_MS + 1, TTL_MS, lambda k: k == b'"b"')
    assert gone == [b'"a"']
    assert (
        sweep(SweepPlan(keys=2), 0, 0, 1, lambda _a, _n: entries, T0 + TTL_MS + 1, 0, lambda _k: False) == []
    )
