"""Unit tests of the risk path's pure logic (pipeline/risk): tiled windows at their edges, features
against the brute-force recomputation, idempotency, lateness, the state's JSON, the re-keying
partitioner, the chain over a store, rules, decisions, records, and the simulator's determinism."""

from __future__ import annotations

import gc
import json
import random
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.risk.decide import Thresholds, decide
from pipeline.risk.features import (
    ALL_FEATURES,
    DUP,
    LATE,
    NAMES,
    OK,
    SPECS,
    EntityState,
    FeatureConfig,
    FeatureEngine,
    step,
)
from pipeline.risk.records import (
    EventAheadOfClockError,
    InvalidRiskEventError,
    RiskDecision,
    check_event_time,
    decode_event,
    salvage_event_ids,
)
from pipeline.risk.reference import compare, recompute
from pipeline.risk.rules import DEFAULT_RULES, Rule, RuleBook, RuleError, RuleSet, parse_rule
from pipeline.risk.simulate import DAY_MS, SCENARIOS, SimConfig, as_event, disorder, simulate
from pipeline.risk.stages import (
    RepartitionRecordError,
    Stage,
    StateCache,
    decision_record,
    full_features,
    key_partition,
    murmur2,
    new_item,
    next_kind,
    pack,
    partition_for,
    unpack,
)
from pipeline.risk.windows import WINDOWS, Window

CFG = FeatureConfig()
T0 = 1_735_689_600_000  # a multiple of every tile size


def ev(i: int | str, t: int, account: str = "a1", amount: float = 10.0, **kw: Any) -> dict[str, Any]:
    e = {
        "event_id": f"e{i}",
        "type": "payment",
        "account": account,
        "card": "c1",
        "device": None,
        "ip": None,
        "amount": amount,
        "currency": "EUR",
        "merchant": "m1",
        "country": "DE",
        "event_time_ms": t,
    }
    e.update(kw)
    return e


def feats(kind: str, res: Any) -> dict[str, Any]:
    assert res.status == OK
    return dict(zip(NAMES[kind], res.features, strict=True))


# ---- windows ---------------------------------------------------------------------------------------
def test_window_spans_whole_tiles_and_the_floor_follows_the_head() -> None:
    w = Window("1m", 60_000, 10_000)
    assert w.tiles == 6 and w.kept(60_000) == 12 and w.kept(1) == 7
    # an event at the start of a tile reads the 5 tiles before it and its own
    assert w.span(T0, T0, 60_000) == (T0 // 10_000 - 5, T0 // 10_000)
    # far behind the head, the floor (window + horizon behind the head) cuts the span
    head = T0 + 100_000
    lo, hi = w.span(T0, head, 60_000)
    assert hi == T0 // 10_000 and lo == head // 10_000 - 11
    with pytest.raises(ValueError, match="must divide"):
        Window("x", 60_000, 7_000)
    assert [x.name for x in WINDOWS] == ["1m", "1h", "24h"]


def test_one_minute_window_edges() -> None:
    st_ = EntityState(SPECS["card"], CFG)
    s = SPECS["card"]
    assert feats("card", step(s, CFG, st_, ev(1, T0)))["card_count_1m"] == 0  # nothing before it
    # 59.999 s later, still inside the window (its tile is 5 tiles on)
    f = feats("card", step(s, CFG, st_, ev(2, T0 + 59_999)))
    assert f["card_count_1m"] == 1 and f["card_amount_1m"] == 10.0
    # exactly 60 s after the first: the first event's tile has left the 1 min window
    f = feats("card", step(s, CFG, st_, ev(3, T0 + 60_000)))
    assert f["card_count_1m"] == 1  # only e2
    assert f["card_count_1h"] == 2 and f["card_count_24h"] == 2
    assert f["card_since_last_s"] == pytest.approx(0.001)


def test_24h_window_edge_and_tile_granularity() -> None:
    s = SPECS["account"]
    st_ = EntityState(s, CFG)
    step(s, CFG, st_, ev(1, T0 + 3_599_999, amount=100.0))  # last ms of the first hour tile
    f = feats("account", step(s, CFG, st_, ev(2, T0 + 86_400_000 + 3_599_999, amount=50.0)))
    assert f["account_count_24h"] == 0  # 24 h later, in the tile 24 on: out
    st_ = EntityState(s, CFG)
    step(s, CFG, st_, ev(1, T0 + 3_600_000, amount=100.0))
    f = feats("account", step(s, CFG, st_, ev(2, T0 + 86_400_000 + 3_599_999, amount=50.0)))
    # the first event is 24 h minus 1 ms before: in (its tile is 23 tiles back)
    assert f["account_count_24h"] == 1 and f["account_amount_24h"] == 100.0
    assert f["account_amount_ratio_24h"] == pytest.approx(0.5)


def test_distinct_counts_small_amounts_and_first_seen() -> None:
    s = SPECS["account"]
    st_ = EntityState(s, CFG)
    f = feats("account", step(s, CFG, st_, ev(1, T0, device="d1", country="DE")))
    assert f["account_new_device"] is None and f["account_since_last_s"] is None  # no history yet
    step(s, CFG, st_, ev(2, T0 + 1000, device="d2", country="FR", merchant="m2"))
    f = feats("account", step(s, CFG, st_, ev(3, T0 + 2000, device="d1", country="ES")))
    assert f["account_distinct_device_1m"] == 2 and f["account_distinct_country_1m"] == 2
    assert f["account_distinct_merchant_1h"] == 2
    assert f["account_new_device"] == 0 and f["account_new_country"] == 1
    c = SPECS["card"]
    cs = EntityState(c, CFG)
    for i, amount in enumerate([1.0, 5.0, 5.01, 0.0, 2.5]):
        step(c, CFG, cs, ev(i, T0 + i * 100, amount=amount))
    f = feats("card", step(c, CFG, cs, ev(9, T0 + 900)))
    assert f["card_small_1m"] == 3  # 1.00, 5.00 (at the limit) and 2.50; not 5.01, not 0
    assert f["card_amount_1m"] == pytest.approx(13.51)


def test_redelivered_event_counts_once_and_late_events_are_not_added() -> None:
    s = SPECS["account"]
    st_ = EntityState(s, CFG)
    assert step(s, CFG, st_, ev(1, T0)).status == OK
    before = st_.dumps()
    assert step(s, CFG, st_, ev(1, T0)).status == DUP
    assert st_.dumps() == before
    step(s, CFG, st_, ev(2, T0 + 10_000))
    # 4.999 s behind the head: out of order but within the grace; e2 is later (in a later tile)
    f = feats("account", step(s, CFG, st_, ev(3, T0 + 5_001)))
    assert f["account_count_1m"] == 1 and f["account_since_last_s"] == 0
    res = step(s, CFG, st_, ev(4, T0 + 4_999))  # 5.001 s behind: late
    assert res.status == LATE and res.watermark_ms == T0 + 10_000
    assert feats("account", step(s, CFG, st_, ev(5, T0 + 10_000)))["account_count_1m"] == 3
    assert step(s, CFG, st_, ev(4, T0 + 4_999)).status == DUP  # remembered, never counted
    # only the account judges lateness: a card takes events far behind its head
    c = SPECS["card"]
    cs = EntityState(c, CFG)
    step(c, CFG, cs, ev(1, T0 + 100_000))
    assert feats("card", step(c, CFG, cs, ev(2, T0)))["card_count_24h"] == 1


def test_two_accounts_events_with_one_id_on_a_shared_ip_are_two_events() -> None:
    """Event ids are each account's own: account y's e1 on the ip account x's e1 used is a new event
    there, decided and counted, online (the ip stage) and offline (the engine) alike. When every
    entity judged repeats by id, y's e1 was dropped at the ip stage: no decision, no dead letter."""
    x1 = ev(1, T0, account="x", card="cx", ip="i1")
    y1 = ev(1, T0 + 10, account="y", card="cy", ip="i1")
    y2 = ev(2, T0 + 20, account="y", card="cy", ip="i1")
    stage = Stage("ip", CFG, 8, StateCache(10), lambda key, ctx: None)
    res = stage.run(
        [(new_item(dict(e), "v", T0, T0), None) for e in (x1, y1, y2)], [(0, i, 0) for i in range(3)]
    )
    assert res.duplicates == 0
    decided = [(i["e"]["account"], i["e"]["event_id"]) for i, _ in res.decide]
    assert decided == [("x", "e1"), ("y", "e1"), ("y", "e2")]
    assert [full_features(i["f"])["ip_count_1m"] for i, _ in res.decide] == [0, 1, 2]
    engine = FeatureEngine(CFG)
    out = [engine.process(dict(e)) for e in (x1, y1, y2)]
    assert [status for status, _ in out] == [OK, OK, OK]
    assert [f["ip_count_1m"] for _, f in out if f is not None] == [0, 1, 2]
    # the account still judges its own repeats: y's e1 again is a duplicate, nowhere counted
    assert engine.process(dict(y1)) == (DUP, None)


def test_state_json_round_trip_keeps_features() -> None:
    s = SPECS["ip"]
    a, b = EntityState(s, CFG), None
    rng = random.Random(3)
    for i in range(200):
        e = ev(
            i,
            T0 + rng.randrange(3_600_000),
            account=f"a{rng.randrange(9)}",
            card=f"c{rng.randrange(5)}",
            ip="i1",
        )
        b = EntityState.loads(a.dumps(), s, CFG)
        fa, fb = step(s, CFG, a, e), step(s, CFG, b, e)
        assert fa == fb
        assert _canon(a.dumps()) == _canon(b.dumps())


def _count_tracked(root: object) -> int:
    """Objects reachable from ``root`` that the cyclic garbage collector tracks (walks on every full
    collection, with the event loop stopped)."""
    seen: dict[int, object] = {}
    todo = [root]
    while todo:
        obj = todo.pop()
        if id(obj) not in seen and not isinstance(obj, type):  # not into the class and its module
            seen[id(obj)] = obj
            todo.extend(gc.get_referents(obj))
    return sum(1 for o in seen.values() if gc.is_tracked(o))


@pytest.mark.parametrize("kind", ["account", "card", "ip"])
def test_a_busy_state_adds_a_few_objects_to_each_full_collection(kind: str) -> None:
    """Tiles and first-seen values are tuples, which the collector stops tracking: a state of 200
    events over a day (dozens of tiles, each with distinct values) stays at a handful of tracked
    objects (with sets and lists in place it was over a hundred), and a state read back from its
    JSON the same. A risk worker holds tens of thousands of states."""
    s = SPECS[kind]
    a = EntityState(s, CFG)
    rng = random.Random(5)
    for i, t in enumerate(sorted(rng.randrange(86_400_000) for _ in range(200))):
        step(
            s,
            CFG,
            a,
            ev(
                i,
                T0 + t,
                device=f"d{rng.randrange(9)}",
                country=f"C{rng.randrange(6)}",
                merchant=f"m{rng.randrange(20)}",
                account=f"a{rng.randrange(9)}",
                card=f"c{rng.randrange(5)}",
            ),
        )
    b = EntityState.loads(a.dumps(), s, CFG)
    for _ in range(3):  # a collection untracks a tuple of untracked values, one level of nesting each
        gc.collect()
    assert sum(len(ts) for ts in a.tiles) > 20
    # what is left: the state, its list of windows and its deque of recent ids
    assert _count_tracked(a) == 3 and _count_tracked(b) == 3


def _canon(data: bytes) -> Any:
    """A state's JSON with its sets of distinct values sorted (their order carries no meaning)."""
    obj = json.loads(data)
    obj["t"] = [[[idx, [*t[:3], *(sorted(v) for v in t[3:])]] for idx, t in ts] for ts in obj["t"]]
    return obj


def _stream(seed: int, n: int, share: float) -> list[dict[str, Any]]:
    events = [as_event(e) for e in simulate(SimConfig(customers=200, days=3, seed=seed, fraud_scale=20))][:n]
    return disorder(events, share=share, late_share=0.01, grace_ms=CFG.grace_ms, seed=seed)


@pytest.mark.parametrize("share", [0.0, 0.05, 0.3])
def test_engine_equals_the_brute_force_recomputation(share: float) -> None:
    events = _stream(5, 3000, share)
    eng = FeatureEngine(CFG)
    got = {e["event_id"]: eng.process(e) for e in events}
    late: set[str] = set()
    checked = 0
    for kind in ("account", "card", "device", "ip"):
        want, lt = recompute(kind, [e for e in events if e["event_id"] not in late], CFG)
        late |= lt
        for eid, f in want.items():
            status, features = got[eid]
            assert status == OK and features is not None
            assert not compare(features, f), (kind, eid, compare(features, f))
            checked += 1
    assert len(events) == 3000 and checked > 2 * len(events)
    assert {eid for eid, (s, _) in got.items() if s == LATE} == late
    assert share == 0 or late


@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 200_000), st.integers(0, 3), st.sampled_from([0.5, 3.0, 7.25, 120.0])),
        min_size=1,
        max_size=40,
    ),
    st.integers(0, 30_000),
    st.integers(1, 3),
    st.integers(1, 5),
)
def test_any_order_matches_the_brute_force(
    rows: list[tuple[int, int, float]], horizon: int, dedup: int, distinct_max: int
) -> None:
    cfg = FeatureConfig(
        grace_ms=20_000, horizon_ms=horizon, dedup_ids=dedup, seen_max=2, distinct_max=distinct_max
    )
    events = [
        ev(i, T0 + t, device=f"d{d}", country=["DE", "FR", "IT", "ES"][d], amount=a)
        for i, (t, d, a) in enumerate(rows)
    ]
    events += [dict(events[0])]  # a redelivery
    eng = FeatureEngine(cfg)
    got = {}
    for e in events:
        got.setdefault(e["event_id"], eng.process(e))
    want, late = recompute("account", events, cfg)
    for eid, f in want.items():
        assert not compare(got[eid][1], f)
    assert {eid for eid, (s, _) in got.items() if s == LATE} == late


def test_a_shared_ip_s_distinct_counts_stop_at_the_cap_and_its_state_stays_small() -> None:
    """2,000 accounts through one IP within a minute (a carrier's NAT, or a client making up ids):
    the distinct count reads the cap, each tile keeps at most the cap, the state stays a few KB,
    and the brute force agrees on every event."""
    cfg = FeatureConfig(distinct_max=64)
    events = [ev(i, T0 + 20 * i, account=f"acct-{i}", card=f"card-{i}", ip="10.1.2.3") for i in range(2_000)]
    eng = FeatureEngine(cfg)
    got = {e["event_id"]: eng.process(e)[1] for e in events}
    want, _ = recompute("ip", events, cfg)
    assert all(not compare(got[eid] or {}, f) for eid, f in want.items())
    last = got[events[-1]["event_id"]] or {}
    assert last["ip_distinct_account_1m"] == last["ip_distinct_account_24h"] == 64
    assert last["ip_count_1m"] == 1_999  # counts are not capped: every earlier event, 40 s in all
    state = eng.states["ip"]["10.1.2.3"]
    assert all(len(vs) <= 64 for tiles in state.tiles for tile in tiles.values() for vs in tile[3:])
    assert len(state.dumps()) < 32_000


# ---- re-keying and the chain ---------------------------------------------------------------------
def test_murmur2_and_partitions_match_kafkas_default_partitioner() -> None:
    from aiokafka.partitioner import DefaultPartitioner
    from aiokafka.partitioner import murmur2 as kafka_murmur2

    for key in ["", "a", "ab", "abc", "abcd", "acc-000017", "card-000001-1", "ip-nat-0003", "日本"]:
        assert murmur2(key.encode()) == kafka_murmur2(key.encode())
        parts = list(range(8))
        assert partition_for(key, 8) == DefaultPartitioner()(key.encode(), parts, parts)
    # keys that are not UTF-8 (a record key is any bytes; the replay finds their home partition)
    for raw in (b"\x80", b"k\xff\xfe", bytes(range(7))):
        assert key_partition(raw, 8) == DefaultPartitioner()(raw, list(range(8)), list(range(8)))


def test_next_kind_skips_missing_entities_and_pack_round_trips() -> None:
    e = ev(1, T0, card=None, device="d1", ip=None)
    assert next_kind(e, "account") == "device" and next_kind(e, "device") is None
    items = [new_item(e, "v1-x", T0, T0 + 3)]
    assert unpack(pack(items), ("t", 0, 0)) == items
    for bad in (b"", b"[]", b'{"items": [1]}', b'{"items": "x"}', b"\xff"):
        with pytest.raises(RepartitionRecordError, match=r"t\[0\]@7"):
            unpack(bad, ("t", 0, 7))


def test_stage_routes_by_next_entity_and_marks_dirty_states() -> None:
    store: dict[str, bytes] = {}
    cache = StateCache(10)
    stage = Stage("account", CFG, 8, cache, lambda key, ctx: store.get(key))
    e1, e2 = ev(1, T0, device="d1", ip="i1"), ev(2, T0 + 1, card=None, device=None, ip=None)
    res = stage.run(
        [
            (new_item(e1, "v", T0, T0), "ctx1"),
            (new_item(e2, "v", T0, T0), "ctx2"),
            (new_item(dict(e1), "v", T0, T0), "ctx3"),
        ]
    )
    assert res.duplicates == 1
    assert list(res.forward) == [("card", partition_for("c1", 8))]
    assert [i["e"]["event_id"] for i, _ in res.decide] == ["e2"]
    assert set(res.dirty) == {"a1"} and res.dirty["a1"][1] == "ctx2"
    assert full_features(res.decide[0][0]["f"])["account_count_1m"] == 1
    # without the cache, a state comes back from the store
    store["a1"] = res.dirty["a1"][0].dumps()
    cache.clear()
    res = Stage("account", CFG, 8, cache, lambda key, ctx: store.get(key)).run(
        [(new_item(ev(3, T0 + 2), "v", T0, T0), None)]
    )
    assert full_features(res.forward[("card", partition_for("c1", 8))][0]["f"])["account_count_1m"] == 2
    assert cache.misses == 2 and cache.hits == 0


def test_input_read_again_after_a_crash_is_skipped_by_position_whatever_its_length() -> None:
    """A worker killed after writing its states and before committing: its successor reads the
    uncommitted records again. The 16 event ids an entity remembers cover 16 of them; the position
    of the last input its state took covers them all (docs/architecture.md, "Risk: takeover")."""
    events = [ev(i, T0 + 1_000 * i) for i in range(40)]  # one account, one card
    positions = [(5, 100 + i, 0) for i in range(40)]

    def crash_and_read_again(with_positions: bool) -> tuple[Stage, int]:
        store: dict[str, bytes] = {}
        stage = Stage("account", CFG, 8, StateCache(10), lambda key, ctx: store.get(key))
        res = stage.run([(new_item(dict(e), "v", T0, T0), None) for e in events], positions)
        assert res.reread == 0 and len(res.forward[("card", partition_for("c1", 8))]) == 40
        store["a1"] = res.dirty["a1"][0].dumps()  # the state reached the store; the commit did not
        again = Stage("account", CFG, 8, StateCache(10), lambda key, ctx: store.get(key))
        res = again.run(
            [(new_item(dict(e), "v", T0, T0), None) for e in events], positions if with_positions else None
        )
        return again, sum(len(items) for items in res.forward.values()) + len(res.late)

    stage, repeated = crash_and_read_again(with_positions=True)
    assert repeated == 0  # every one skipped: no repeat that counts an event twice or calls it late
    nxt = stage.run([(new_item(ev(40, T0 + 40_000), "v", T0, T0), None)], [(5, 140, 0)])
    assert nxt.reread == 0
    assert full_features(nxt.forward[("card", partition_for("c1", 8))][0]["f"])["account_count_1h"] == 40
    # by event id alone, the 24 events older than the entity's last 16 come again, late (more than the
    # grace behind the head the first reading left) or counted twice, and as each is remembered it
    # pushes one of the 16 out: all 40 come again
    _, repeated = crash_and_read_again(with_positions=False)
    assert repeated == 40
    # a position at or past its partition's end is from an earlier incarnation of the topic (deleted
    # and created again while the state stayed): new records at low offsets are taken, not skipped
    fresh = stage.run([(new_item(ev(42, T0 + 42_000), "v", T0, T0), None)], [(5, 3, 0)], {5: 10}.get)
    assert fresh.reread == 0 and len(fresh.forward[("card", partition_for("c1", 8))]) == 1
    # while the topic still reaches past the position, the same offset is one read again
    again = stage.run([(new_item(ev(43, T0 + 43_000), "v", T0, T0), None)], [(5, 3, 0)], {5: 141}.get)
    assert again.reread == 1 and not again.forward
    # a position on another partition says nothing about this one (ids hash to one partition, but a
    # state restored into a topic with another partition count must not drop its input)
    other = stage.run([(new_item(ev(41, T0 + 41_000), "v", T0, T0), None)], [(6, 0, 0)])
    assert other.reread == 0 and other.duplicates == 0


def test_items_an_upstream_stage_sends_again_are_skipped_downstream_however_many_came_between() -> None:
    """An account stage that died after sending its items on and before writing its states reads its
    input again and sends the same items again. The card downstream took the originals, then more
    than 16 events from another partition: by event id alone the repeats count twice; by the
    position it took from each upstream partition they are skipped
    (docs/architecture.md, "Risk: takeover")."""
    hot = "c-hot"
    first = [ev(f"p0-{i}", T0 + 1_000 * i, account=f"a{i}", card=hot) for i in range(10)]
    other = [ev(f"p1-{i}", T0 + 20_000 + 100 * i, account=f"b{i}", card=hot) for i in range(30)]

    def account_items(
        events: list[dict[str, Any]], partition: int, offset: int = 100
    ) -> list[dict[str, Any]]:
        # an account stage whose states were never written: a restart computes the same items,
        # which reach the card stage through a repartition record
        stage = Stage("account", CFG, 8, StateCache(100), lambda key, ctx: None)
        res = stage.run(
            [(new_item(dict(e), "v", T0, T0), None) for e in events],
            [(partition, offset + i, 0) for i in range(len(events))],
        )
        return unpack(pack([it for items in res.forward.values() for it in items]), ("t", 3, 0))

    def card_run(card: Stage, items: list[dict[str, Any]], offset: int) -> Any:
        return card.run([(it, None) for it in items], [(3, offset, j) for j in range(len(items))])

    def scenario(track_upstream: bool) -> tuple[Stage, Any]:
        card = Stage("card", CFG, 8, StateCache(100), lambda key, ctx: None)
        originals = account_items(first, 0)
        assert [it["o"] for it in originals] == [[0, 0, 100 + i, 0] for i in range(10)]
        card_run(card, originals, 500)
        card_run(card, account_items(other, 1), 501)
        again = account_items(first, 0)
        if not track_upstream:
            for it in again:
                del it["o"]
        return card, card_run(card, again, 502)

    card, res = scenario(track_upstream=True)
    assert res.resent == 10 and not res.decide  # no second decision, nothing counted twice
    nxt = card_run(card, account_items([ev("p1-x", T0 + 23_000, account="b0", card=hot)], 1, 130), 503)
    assert nxt.resent == 0 and full_features(nxt.decide[0][0]["f"])["card_count_1h"] == 40
    _, res = scenario(track_upstream=False)
    assert len(res.decide) == 10  # by the last 16 ids alone: all ten decided again, counted twice
    # an item from an upstream position already taken but later than anything the entity has seen:
    # the upstream topic was created again under a state that stayed; it is taken, not dropped
    late_new = account_items([ev("p0-new", T0 + 60_000, account="a0", card=hot)], 0)
    assert late_new[0]["o"] == [0, 0, 100, 0]  # the offsets started over
    assert len(card_run(card, late_new, 504).decide) == 1
    # a repartition record whose origin is not four integers is refused, like any malformed record
    with pytest.raises(RepartitionRecordError):
        unpack(pack([dict(late_new[0], o=["x", 0, 1, 2])]), ("t", 3, 9))


@pytest.mark.parametrize(
    "poison",
    [
        lambda i: i["e"].pop("event_id"),
        lambda i: i["e"].update(amount="12.5"),
        lambda i: i["e"].update(amount=True),
        lambda i: i["e"].update(amount=-1.0),
        lambda i: i["e"].update(event_time_ms=1.5),
        lambda i: i["e"].update(card=None),  # at the card stage
        lambda i: i["e"].update(account=["a1"]),
        lambda i: i["e"].update(extra=1),
        lambda i: i.update(e=[]),
        lambda i: i["f"].update(account=[1, 2]),
        lambda i: i["f"].update(account=["x"] * len(NAMES["account"])),
        lambda i: i["f"].update(planet=[]),
        lambda i: i.update(rv=7),
        lambda i: i.pop("ts"),
        lambda i: i.update(o=["x", 0, 1, 2]),
    ],
)
def test_a_repartition_item_surge_did_not_write_is_refused_not_read(poison: Any) -> None:
    """Each item is checked as the stages, the decision and the model read it: one that would raise
    there (a missing event id, an amount of the wrong type, features of the wrong length ...) makes
    the record a RepartitionRecordError, which the worker dead-letters. A record with such an item
    once stopped the risk worker with a KeyError, again each time it read the record anew."""
    stage = Stage("account", CFG, 8, StateCache(10), lambda key, ctx: None)
    res = stage.run([(new_item(ev(1, T0), "v", T0, T0), None)], [(0, 0, 0)])
    good = unpack(pack(res.forward[("card", partition_for("c1", 8))]), ("t", 1, 0), "card")
    assert good[0]["e"]["event_id"] == "e1" and len(good[0]["f"]["account"]) == len(NAMES["account"])
    bad = json.loads(pack(good))["items"][0]
    poison(bad)
    with pytest.raises(RepartitionRecordError, match=r"t\[1\]@5: item 1: "):
        unpack(pack([good[0], bad]), ("t", 1, 5), "card")


def test_state_cache_is_an_lru() -> None:
    c = StateCache(2)
    a, b, d = (EntityState(SPECS["ip"], CFG) for _ in range(3))
    c.put("a", a)
    c.put("b", b)
    assert c.get("a") is a
    c.put("d", d)
    assert c.get("b") is None and c.get("a") is a and len(c) == 2
    assert (c.hits, c.misses) == (2, 1)
    StateCache(0).put("x", a)


# ---- rules and decisions -------------------------------------------------------------------------
def test_rules_parse_validate_and_version_by_content() -> None:
    r = parse_rule(
        b"big", b'{"rule_id":"big","version":2,"action":"decline","when":[["event.amount",">=",1000]]}'
    )
    assert r is not None and r.points == 1.0
    assert parse_rule(b"big", None) is None
    for key, value, match in [
        (b"x", b'{"rule_id":"y","version":1,"action":"review","when":[["event.amount",">",1]]}', "differs"),
        (
            b"x",
            b'{"rule_id":"x","version":1,"action":"review","when":[["no_such_feature",">",1]]}',
            "unknown",
        ),
        (
            b"x",
            b'{"rule_id":"x","version":1,"action":"review","when":[["event.amount",">","big"]]}',
            "number",
        ),
        (b"x", b'{"rule_id":"x","version":1,"action":"review","when":[["event.country","in","DE"]]}', "list"),
        (b"x", b'{"rule_id":"x","version":0,"action":"review","when":[["event.amount",">",1]]}', "version"),
        (b"x", b"not json", "x"),
    ]:
        with pytest.raises(RuleError, match=match):
            parse_rule(key, value)
    a = RuleSet(DEFAULT_RULES)
    b = RuleSet(reversed(DEFAULT_RULES))
    assert a.version == b.version and a.version.startswith("v1-")
    changed = RuleSet([*DEFAULT_RULES[1:], DEFAULT_RULES[0].model_copy(update={"points": 9.0})])
    assert changed.version != a.version


def test_rule_book_applies_updates_and_tombstones_and_keeps_history() -> None:
    book = RuleBook(DEFAULT_RULES, keep=3)
    v0 = book.current.version
    rule = Rule(rule_id="card_testing", version=2, action="decline", when=[("card_small_1m", ">=", 2)])
    v1 = book.apply(b"card_testing", rule.model_dump_json().encode()).version
    assert v1 != v0 and v1.startswith("v2-")
    assert book.get(v0) is not None and book.get(v1) is book.current
    v2 = book.apply(b"card_testing", None).version
    assert len(book.current) == len(DEFAULT_RULES) - 1
    assert book.apply(b"nothing_here", None).version == v2
    with pytest.raises(RuleError):
        book.apply(b"bad", b"{}")
    assert book.current.version == v2
    book.apply(b"card_testing", rule.model_dump_json().encode())
    book.apply(
        b"x1",
        Rule(rule_id="x1", version=1, action="review", when=[("event.amount", ">", 1)])
        .model_dump_json()
        .encode(),
    )
    assert book.get(v0) is None  # only the last three versions are kept


def test_rule_records_read_together_make_one_version_and_a_bad_one_is_left_out() -> None:
    book = RuleBook()
    records: list[tuple[bytes | None, bytes | None]] = [
        (r.rule_id.encode(), r.model_dump_json().encode()) for r in DEFAULT_RULES
    ]
    rs, errors = book.apply_many([*records[:2], (b"bad", b"{}"), *records[2:]])
    assert [e.rule_id for e in errors] == ["bad"]
    assert rs is book.current and rs.version == RuleSet(DEFAULT_RULES).version
    # one change: no version holding part of the set was ever current (a decision could name one)
    assert [
        v for v in (book.get(RuleSet(DEFAULT_RULES[:k]).version) for k in range(1, len(DEFAULT_RULES))) if v
    ] == []
    same, errors = book.apply_many([(b"nothing_here", None)])
    assert same is rs and errors == []


def test_rules_fire_with_the_values_that_made_them_fire() -> None:
    rs = RuleSet(DEFAULT_RULES)
    f = dict.fromkeys(ALL_FEATURES)
    f.update(card_small_1m=4, account_new_device=1, account_new_country=1, ip_distinct_account_1h=None)
    e = ev(1, T0, amount=2.0)
    hits = rs.evaluate(f, e)
    assert [h.rule_id for h in hits] == ["card_testing", "new_device_new_country"]
    assert hits[0].reason() == "rule card_testing@1: card_small_1m=4 >= 3"
    assert rs.points(f, e) == 5
    v = decide(e, f, rs, 0.01, Thresholds(0.5, 0.9))
    assert v.decision == "decline" and v.reasons[0].startswith("rule card_testing@1")
    quiet = dict.fromkeys(ALL_FEATURES)
    assert decide(e, quiet, rs, 0.1, Thresholds(0.5, 0.9)).decision == "approve"
    review = decide(e, quiet, rs, 0.6, Thresholds(0.5, 0.9))
    assert review.decision == "review" and review.reasons == ["model score 0.600 >= review threshold 0.5"]
    assert decide(e, quiet, rs, 0.95, Thresholds(0.5, 0.9)).decision == "decline"
    assert decide(e, quiet, rs, None, Thresholds(0.5, 0.9)).decision == "approve"


def test_decision_record_validates_as_a_risk_decision() -> None:
    item = new_item(ev(1, T0), "v1-abc", T0 + 5, T0 + 7)
    item["f"] = {"account": [2] + [0] * (len(NAMES["account"]) - 1)}
    rec = decision_record(
        item,
        decision="review",
        score=0.7,
        reasons=["r"],
        rule_version="v1-abc",
        model_version="m",
        decided_ms=T0 + 25,
    )
    d = RiskDecision.model_validate_json(json.dumps(rec))
    assert d.features["account_count_1m"] == 2 and d.features["ip_count_1m"] is None
    assert len(d.features) == len(ALL_FEATURES) and d.timings is not None
    assert d.timings.produce_to_decision_ms == 20
    assert d.same_as(d.model_copy(update={"timings": None}))


# ---- records -----------------------------------------------------------------------------------
def test_decode_event_says_what_is_wrong() -> None:
    good = ev(1, T0)
    assert decode_event(json.dumps(good).encode(), b"a1", max_record_bytes=10_000).account == "a1"
    whole = decode_event(json.dumps({**good, "amount": 12}).encode(), b"a1", max_record_bytes=10_000)
    assert whole.amount == 12.0 and type(whole.amount) is float  # an integer is a number too
    cases = [
        (None, b"a1", "empty record"),
        (b"x" * 20_000, b"a1", "20000 bytes; the limit is 10000"),
        (b"{not json", b"a1", "not a valid JSON"),
        (b"[1, 2]", b"a1", "JSON object|invalid risk event"),
        (json.dumps({**good, "amount": -1}).encode(), b"a1", "amount"),
        (json.dumps({**good, "card": None}).encode(), b"a1", "a payment needs a card"),
        (json.dumps({**good, "type": "login"}).encode(), b"a1", "a login carries no amount"),
        (json.dumps({**good, "country": "Germany"}).encode(), b"a1", "country"),
        (json.dumps({**good, "event_time_ms": "soon"}).encode(), b"a1", "event_time_ms"),
        (json.dumps({**good, "extra": 1}).encode(), b"a1", "extra"),
        (json.dumps(good).encode(), b"a2", "differs from account"),
        # no key: on whatever partition it lands it would start a second state of its account
        (json.dumps(good).encode(), None, "no key; key risk events by their account"),
        # an amount is a number: not a string, not a boolean (pydantic's lax mode took both)
        (json.dumps({**good, "amount": "12.5"}).encode(), b"a1", "amount"),
        (json.dumps({**good, "amount": True}).encode(), b"a1", "amount"),
    ]
    for raw, key, match in cases:
        with pytest.raises(InvalidRiskEventError, match=match):
            decode_event(raw, key, max_record_bytes=10_000)
    assert salvage_event_ids(json.dumps({**good, "amount": -1}).encode()) == ("e1", "a1")
    assert salvage_event_ids(b"{not json") is None and salvage_event_ids(b'{"event_id": 5}') is None


def test_an_event_with_a_byte_order_mark_decodes_and_a_flawed_one_keeps_its_ids() -> None:
    good = json.dumps(ev(1, T0)).encode()
    assert decode_event(b"\xef\xbb\xbf" + good, b"a1", max_record_bytes=10_000).event_id == "e1"
    # an amount past Python's 4,300-digit limit and bytes that are not UTF-8 elsewhere in the record:
    # refused, but the ids are read, so the producer gets an error decision
    huge = good.replace(b'"amount": 10.0', b'"amount": 1' + b"0" * 5000)
    assert huge != good
    not_utf8 = good.replace(b'"merchant": "m1"', b'"merchant": "m\xff"')
    assert not_utf8 != good
    for raw in (huge, not_utf8):
        with pytest.raises(InvalidRiskEventError):
            decode_event(raw, b"a1", max_record_bytes=1 << 20)
        assert salvage_event_ids(raw) == ("e1", "a1")


def test_an_event_dated_past_the_clock_by_more_than_the_limit_is_refused_with_the_numbers() -> None:
    e = decode_event(json.dumps(ev(1, T0 + 5_000)).encode(), b"a1", max_record_bytes=10_000)
    assert check_event_time(e, T0, 5_000) is e  # exactly at the limit
    assert check_event_time(e, T0 + 60_000, 5_000) is e  # behind the clock: a backlog, never refused
    with pytest.raises(EventAheadOfClockError) as err:
        check_event_time(e, T0 - 1, 5_000)
    assert (err.value.ahead_ms, err.value.limit_ms, err.value.code) == (5_001, 5_000, "invalid_request")
    assert "5001 ms after this worker's clock; at most 5000 ms" in err.value.message


# ---- simulator -------------------------------------------------------------------------------------
def test_simulator_is_deterministic_with_a_seed_and_labels_every_scenario() -> None:
    cfg = SimConfig(customers=300, days=6, seed=21, fraud_scale=8)
    a, b = simulate(cfg), simulate(cfg)
    assert a == b
    assert simulate(SimConfig(customers=300, days=6, seed=22, fraud_scale=8)) != a
    times = [e["event_time_ms"] for e in a]
    assert times == sorted(times) and len({e["event_id"] for e in a}) == len(a)
    assert {e["scenario"] for e in a if e["label"]} == set(SCENARIOS)
    assert all((e["scenario"] is None) == (e["label"] == 0) for e in a)
    for e in a[:2000]:
        decode_event(json.dumps(as_event(e)).encode(), e["account"].encode(), max_record_bytes=1 << 20)
    ct = [e for e in a if e["scenario"] == "card_testing"]
    assert all(e["amount"] <= 3.0 or e["amount"] > 5 for e in ct) and any(e["amount"] <= 3.0 for e in ct)
    ato = [e for e in a if e["scenario"] == "account_takeover"]
    assert {e["type"] for e in ato} == {"login", "transfer"} and all(
        e["device"].startswith("dev-x-") for e in ato
    )
    with pytest.raises(ValueError, match="customers"):
        SimConfig(customers=1)


def test_a_later_period_of_a_seed_is_the_same_world_with_new_days() -> None:
    """A model trained on one period and scored on the next must not meet its training days again."""
    first = SimConfig(customers=200, days=3, seed=7)
    later = SimConfig(customers=200, days=3, seed=7, start_ms=first.start_ms + 3 * DAY_MS)
    a, b = simulate(first), simulate(later)
    owner_a = {e["card"]: e["account"] for e in a if not e["label"] and e["card"]}
    owner_b = {e["card"]: e["account"] for e in b if not e["label"] and e["card"]}
    both = owner_a.keys() & owner_b.keys()
    assert len(both) > 0.8 * len(owner_b), "the same customers with the same cards"
    assert all(owner_a[c] == owner_b[c] for c in both)
    assert min(e["event_time_ms"] for e in b) >= later.start_ms
    shifted = [(e["account"], e["type"], e["amount"], e["event_time_ms"] - first.start_ms) for e in a]
    again = [(e["account"], e["type"], e["amount"], e["event_time_ms"] - later.start_ms) for e in b]
    assert len(set(shifted) & set(again)) < 0.01 * len(shifted), "new days, not the first ones shifted"


def test_disorder_moves_events_back_within_or_beyond_the_grace() -> None:
    events = [as_event(e) for e in simulate(SimConfig(customers=50, days=1, seed=3))]
    out = disorder(events, share=0.3, late_share=0.1, grace_ms=5_000, seed=4)
    assert [e["event_id"] for e in out] == [e["event_id"] for e in events]
    head: dict[str, int] = {}
    within = late = 0
    for e in out:
        h = head.get(e["account"])
        if h is not None and e["event_time_ms"] < h:
            if h - e["event_time_ms"] <= 5_000:
                within += 1
            else:
                late += 1
        head[e["account"]] = max(h or 0, e["event_time_ms"])
    assert within > 0 and late > 0
    assert disorder(events, share=0, grace_ms=5_000) == events
