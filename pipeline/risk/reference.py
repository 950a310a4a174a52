"""Brute-force recomputation of the risk features, in plain Python: no tiles, no state objects.

For every event, the features of one entity are recomputed from the full list of that entity's
earlier events, in the order the entity saw them (docs/architecture.md, "Risk: features"). The tests
and ``surge bench risk`` compare every decision's features with this. It shares nothing with
:mod:`pipeline.risk.features` but the definitions: window lengths and tile sizes, which fields each
kind counts, and the feature names.

An event counts in the window of a later event ``x`` of the same entity when its tile (event time //
tile size) lies in ``[tile(x) - tiles + 1, tile(x)]`` and is not below the floor kept behind the
entity's head as of ``x`` (the latest event time among the entity's events up to and including ``x``).
Duplicates (an account's event id seen before by that entity: ids are each account's own) are
skipped; on the account, an event more than
the grace period behind the account's head is late and skipped. A distinct count is the count up to
``distinct_max``.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from pipeline.risk.features import NAMES, SPECS, FeatureConfig
from pipeline.risk.windows import WINDOWS


def recompute(
    kind: str, events: Iterable[dict[str, Any]], cfg: FeatureConfig
) -> tuple[dict[str, dict[str, Any]], set[str]]:
    """``(features by event_id, late event ids)`` for one kind, ``events`` in arrival order (events
    without this kind's entity are ignored)."""
    spec = SPECS[kind]
    history: dict[str, list[dict[str, Any]]] = {}
    ids: dict[str, set[tuple[str, str]]] = {}
    out: dict[str, dict[str, Any]] = {}
    late: set[str] = set()
    for ev in events:
        key = ev[kind]
        if key is None:
            continue
        seen_ids = ids.setdefault(key, set())
        ident = (ev["account"], ev["event_id"])
        if ident in seen_ids:
            continue
        seen_ids.add(ident)
        past = history.setdefault(key, [])
        t = ev["event_time_ms"]
        if kind == "account" and past and t < max(p["event_time_ms"] for p in past) - cfg.grace_ms:
            late.add(ev["event_id"])
            continue
        head = max([t, *(p["event_time_ms"] for p in past)])
        values: list[Any] = []
        for w in WINDOWS:
            hi = t // w.tile_ms
            lo = max(
                hi - w.length_ms // w.tile_ms + 1, head // w.tile_ms - _kept(w.tile_ms, w.length_ms, cfg) + 1
            )
            inside = [p for p in past if lo <= p["event_time_ms"] // w.tile_ms <= hi]
            values.append(len(inside))
            values.append(sum(round(p["amount"] * 100) for p in inside) / 100)
            if spec.small:
                values.append(
                    sum(1 for p in inside if 0 < round(p["amount"] * 100) <= cfg.small_amount_cents)
                )
            for f in spec.distinct:
                values.append(min(len({p[f] for p in inside if p[f] is not None}), cfg.distinct_max))
        values.append(max(0, t - max(p["event_time_ms"] for p in past)) / 1000 if past else None)
        if kind == "account":
            day = [p for p in past if _in_last_window(p, t, head, cfg)]
            n, total = len(day), sum(round(p["amount"] * 100) for p in day)
            values.append(round(ev["amount"] * 100) * n / total if n and total else None)
            for f in spec.seen:
                v = ev[f]
                if not past or v is None:
                    values.append(None)
                else:
                    values.append(int(v not in _remembered(past, f, cfg.seen_max)))
        out[ev["event_id"]] = dict(zip(NAMES[kind], values, strict=True))
        past.append(ev)
    return out, late


def _kept(tile_ms: int, length_ms: int, cfg: FeatureConfig) -> int:
    return length_ms // tile_ms + -(-cfg.horizon_ms // tile_ms)


def _in_last_window(p: dict[str, Any], t: int, head: int, cfg: FeatureConfig) -> bool:
    w = WINDOWS[-1]
    hi = t // w.tile_ms
    lo = max(hi - w.length_ms // w.tile_ms + 1, head // w.tile_ms - _kept(w.tile_ms, w.length_ms, cfg) + 1)
    return lo <= p["event_time_ms"] // w.tile_ms <= hi


def _remembered(past: list[dict[str, Any]], field: str, cap: int) -> list[str]:
    """The last ``cap`` distinct values of ``field``, oldest forgotten first (a forgotten value seen
    again is remembered anew)."""
    mem: list[str] = []
    for p in past:
        v = p[field]
        if v is not None and v not in mem:
            mem.append(v)
            if len(mem) > cap:
                mem.pop(0)
    return mem


def compare(got: dict[str, Any], want: dict[str, Any], rel: float = 1e-9) -> list[tuple[str, Any, Any]]:
    """Features that differ: ``[(name, got, want)]`` (floats equal within ``rel``)."""
    diffs: list[tuple[str, Any, Any]] = []
    for name, w in want.items():
        g = got.get(name)
        if isinstance(g, float) and isinstance(w, float | int) and not isinstance(w, bool):
            if abs(g - w) > rel * max(1.0, abs(w)):
                diffs.append((name, g, w))
        elif g != w:
            diffs.append((name, g, w))
    return diffs
