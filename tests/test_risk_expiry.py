"""Entity states that expire (pipeline/risk/expiry.py, ``Stage.state``): the rule, the stored time
the sweep reads without decoding, which stored states the sweep deletes, and its schedule. The
agent's sweep on the real broker: tests/test_risk_expiry_integration.py."""

from __future__ import annotations

from typing import Any

from pipeline.ratelimit import SweepSchedule
from pipeline.risk.expiry import expired, expired_keys, written_ms
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


def test_the_sweep_schedule_counts_a_batch_s_items_and_sweeps_once_per_call() -> None:
    sched = SweepSchedule(every=10, keys=4)
    assert not sched.due_after(0, 6)
    assert sched.due_after(0, 6)  # 12 items: due, 2 carried over
    assert not sched.due_after(1, 9)  # partitions count apart
    assert sched.due_after(0, 8)
    # a batch of many times ``every`` sweeps once, and carries over at most one more sweep's worth
    assert sched.due_after(0, 1_000)
    assert not sched.due_after(0, 0)
    assert sched.due_after(0, 1)
