"""Entity states expire on the real broker (docs/architecture.md, "Risk: state expiry"): a risk
worker with a TTL of seconds reads a state not changed for longer as a new entity's, in every one of
the four stages; its sweep deletes expired states from the RocksDB stores with a tombstone on each
changelog; a live state beside them is neither deleted nor reset."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from agents.risk import changelog_topic
from pipeline.metrics import scrape
from pipeline.records import now_ms
from pipeline.risk.records import ENTITY_KINDS
from pipeline.risk.stages import partition_for
from tests.test_risk_integration import PARTITIONS, decide_all, on_partition, start

pytestmark = pytest.mark.integration

TTL_S = 6


def entities(name: str, like: dict[str, str] | None = None) -> dict[str, str]:
    """One id per kind, each sorting before every filler's (the sweep walks a store in key order);
    ``like``: each on the partition of that entity of ``like``'s kind."""
    return {
        kind: f"aa-{kind}-{name}"
        if like is None
        else on_partition(f"aa-{kind}-{name}-", partition_for(like[kind], PARTITIONS))[0]
        for kind in ENTITY_KINDS
    }


def event(eid: str, ids: dict[str, str], t: int) -> dict[str, Any]:
    return {
        "event_id": eid,
        "type": "payment",
        "amount": 20.0,
        "currency": "EUR",
        "merchant": "m1",
        "country": "DE",
        "event_time_ms": t,
        **ids,
    }


def fillers(like: dict[str, str], n: int, t: int) -> list[dict[str, Any]]:
    """``n`` events of new entities that land, in every stage, on the partition of ``like``'s entity
    of that kind: they drive that partition's sweep (two keys per new entity)."""
    ids = {
        kind: on_partition(f"zz-{kind}-", partition_for(like[kind], PARTITIONS), n) for kind in ENTITY_KINDS
    }
    return [event(f"fill-{i}", {k: ids[k][i] for k in ENTITY_KINDS}, t + i) for i in range(n)]


def counts(dec: Any) -> dict[str, Any]:
    return {k: dec.features[f"{k}_count_24h"] for k in ENTITY_KINDS}


async def test_expired_states_read_as_new_entities_and_the_sweep_deletes_them(deployment: Any) -> None:
    d, w, c = await start(deployment, risk_state_ttl_s=TTL_S)
    a, b = entities("a"), entities("b")
    live = entities("live", like=b)  # on b's partitions: swept beside it
    t = now_ms() - 60_000
    first = await decide_all(c, [event("a1", a, t), event("a2", a, t + 1_000), event("b1", b, t)])
    assert counts(first["a2"]) == dict.fromkeys(ENTITY_KINDS, 1)

    await asyncio.sleep(TTL_S + 1.5)
    # read expired, in each of the four stages: the entity starts again as a new one
    a3 = (await decide_all(c, [event("a3", a, t + 2_000)]))["a3"]
    assert counts(a3) == dict.fromkeys(ENTITY_KINDS, 0), a3.features
    assert a3.features["account_since_last_s"] is None and a3.features["account_new_device"] is None
    m = scrape(w.metrics())
    for kind in ENTITY_KINDS:
        assert m[("surge_risk_states_expired_total", (("how", "read"), ("kind", kind)))] == 1

    # b's states are left alone until the sweep of their partitions comes round: new entities on
    # each of them (owing 300 keys there), with a live entity changed just before and read just after
    await decide_all(c, [event("live1", live, t + 3_000)])
    await decide_all(c, fillers(b, 150, t + 4_000))
    live2 = (await decide_all(c, [event("live2", live, t + 5_000)]))["live2"]
    assert counts(live2) == dict.fromkeys(ENTITY_KINDS, 1)  # not deleted, not reset

    m = scrape(w.metrics())
    for kind in ENTITY_KINDS:
        assert m[("surge_risk_states_expired_total", (("how", "swept"), ("kind", kind)))] >= 1
        log = await d.read_topic(changelog_topic(d.settings, kind), min_count=1)
        gone = {r.key for r in log if r.value is None}
        key = f'"{b[kind]}"'.encode()
        assert key in gone, (kind, sorted(gone)[:5])
        # b's tombstone is the last record of its key: a restore from the changelog forgets it
        assert [r.value for r in log if r.key == key][-1] is None
        assert f'"{live[kind]}"'.encode() not in gone
    b2 = (await decide_all(c, [event("b2", b, t + 6_000)]))["b2"]
    assert counts(b2) == dict.fromkeys(ENTITY_KINDS, 0)
