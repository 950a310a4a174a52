"""Per-entity window features: one entity's state and the step that reads it and then updates it.

docs/architecture.md, "Risk: features". Four kinds of entity (account, card, device, ip) each keep,
per window of :data:`pipeline.risk.windows.WINDOWS`, per tile: the event count, the amount (in integer
cents, so sums are exact), the count of small amounts (cards) and the distinct values of a few fields
(e.g. an account's devices, countries and merchants; an ip's accounts and cards). Features of an
event are read from the state *before* the event is added (the event does not count itself), then
the event is added. An entity also keeps its head (latest event time), the devices and countries it
has seen (accounts) and the ids of its last events, so a redelivered event is recognised and never
counted twice.

Lateness is decided on the account (the first entity an event visits): an event more than
``grace_ms`` behind its account's head is late; it is not added anywhere.

Pure: standard library only. :mod:`pipeline.risk.reference` recomputes the same features by brute
force.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, NamedTuple

from pipeline.risk import jsonio
from pipeline.risk.records import ENTITY_KINDS
from pipeline.risk.windows import WINDOWS

DUP, LATE, OK = "dup", "late", "ok"


@dataclass(frozen=True, slots=True)
class FeatureConfig:
    """The knobs of the feature logic (Settings ``risk_*`` fields)."""

    #: an event more than this behind its account's latest event time is late
    grace_ms: int = 5_000
    #: tiles are kept for the window plus this much behind an entity's head
    horizon_ms: int = 60_000
    #: amounts at or below this (and above 0) count as small
    small_amount_cents: int = 500
    #: ids of an entity's last events kept to recognise a redelivered event
    dedup_ids: int = 16
    #: devices and countries an account remembers for the first-seen features
    seen_max: int = 64
    #: distinct values a tile keeps per field: a distinct-count feature is the count up to this (a
    #: shared IP's thousands of accounts would otherwise make its state, and each read, grow without
    #: bound: docs/architecture.md, "Risk: features")
    distinct_max: int = 64
    #: a state not changed for this long (worker clock) is expired: its entity starts again empty,
    #: and the sweep deletes it (docs/architecture.md, "Risk: state expiry"); 0 = never
    state_ttl_ms: int = 0


@dataclass(frozen=True, slots=True)
class EntitySpec:
    """What one kind of entity aggregates."""

    kind: str
    #: event fields whose distinct values are counted per window
    distinct: tuple[str, ...]
    #: count small amounts (card testing)
    small: bool = False
    #: event fields with a first-seen feature (accounts)
    seen: tuple[str, ...] = ()


SPECS: dict[str, EntitySpec] = {
    "account": EntitySpec("account", ("device", "country", "merchant"), seen=("device", "country")),
    "card": EntitySpec("card", ("merchant", "country"), small=True),
    "device": EntitySpec("device", ("account", "card")),
    "ip": EntitySpec("ip", ("account", "card")),
}


def feature_names(kind: str) -> tuple[str, ...]:
    """The features one kind contributes, in the order :func:`step` returns them."""
    spec = SPECS[kind]
    names: list[str] = []
    for w in WINDOWS:
        names += [f"{kind}_count_{w.name}", f"{kind}_amount_{w.name}"]
        if spec.small:
            names.append(f"{kind}_small_{w.name}")
        names += [f"{kind}_distinct_{f}_{w.name}" for f in spec.distinct]
    names.append(f"{kind}_since_last_s")
    if kind == "account":
        names += ["account_amount_ratio_24h", *(f"account_new_{f}" for f in spec.seen)]
    return tuple(names)


NAMES: dict[str, tuple[str, ...]] = {k: feature_names(k) for k in ENTITY_KINDS}
#: every feature of an event, account first
ALL_FEATURES: tuple[str, ...] = tuple(n for k in ENTITY_KINDS for n in NAMES[k])


def cents(amount: float) -> int:
    """An amount in integer cents (sums of cents are exact, whatever the order)."""
    return round(amount * 100)


class EntityState:
    """One entity's tiles, head, first-seen values and (an account's) recent event ids. JSON via
    :meth:`dumps`.

    Tiles and first-seen values are tuples of numbers and strings, replaced rather than changed in
    place: the garbage collector stops tracking such tuples (and the dicts holding only them), so a
    worker's tens of thousands of states add a few objects each to every full collection instead of
    dozens of sets and lists (a full collection stopped the event loop for about 0.4 s each with sets;
    docs/architecture.md, "Risk: features")."""

    __slots__ = ("head", "pos", "recent", "seen", "tiles", "ups", "wrote")

    def __init__(self, spec: EntitySpec, cfg: FeatureConfig) -> None:
        self.head: int | None = None
        #: when an online stage last changed the state (worker clock, ms; None offline): what its
        #: expiry counts from (:mod:`pipeline.risk.expiry`)
        self.wrote: int | None = None
        #: where the last input this state took came from: (partition, offset, index in the record);
        #: set by the online stages (pipeline/risk/stages.py, ``Stage.run``), None offline
        self.pos: tuple[int, int, int] | None = None
        #: per upstream (stage kind index, partition): where that stage had read the last item it
        #: sent here, (offset, index in the record); set by ``Stage.run``, empty offline
        self.ups: dict[tuple[int, int], tuple[int, int]] = {}
        #: per window: {tile index: (count, cents, small, (values of distinct field 0), ...)}
        self.tiles: list[dict[int, tuple[Any, ...]]] = [{} for _ in WINDOWS]
        self.seen: dict[str, tuple[str, ...]] = dict.fromkeys(spec.seen, ())
        self.recent: deque[str] = deque(maxlen=cfg.dedup_ids)

    def dumps(self) -> bytes:
        """Compact JSON bytes (what the RocksDB table and its changelog hold): ``{"w": when last
        changed (first, so :func:`pipeline.risk.expiry.written_ms` reads it without decoding the
        rest), "h": head, "t": per window [[tile index, [count, cents, small, [values], ...]], ...],
        "s": seen, "r": recent ids, "p": [partition, offset, index] of the last input taken, or null,
        "u": [[upstream kind index, partition, offset, index], ...]}`` ("u" only when not empty)."""
        doc: dict[str, Any] = {
            "w": self.wrote,
            "h": self.head,
            "t": [list(ts.items()) for ts in self.tiles],
            "s": self.seen,
            "r": list(self.recent),
            "p": self.pos,
        }
        if self.ups:
            doc["u"] = [(*src, *at) for src, at in self.ups.items()]
        return jsonio.dumps(doc)

    @classmethod
    def loads(cls, data: bytes, spec: EntitySpec, cfg: FeatureConfig) -> EntityState:
        obj = jsonio.loads(data)
        st = cls(spec, cfg)
        st.head = obj["h"]
        st.wrote = obj.get("w")  # absent in states written before expiry existed
        st.tiles = [{idx: (t[0], t[1], t[2], *map(tuple, t[3:])) for idx, t in ts} for ts in obj["t"]]
        st.seen = {f: tuple(obj["s"].get(f, ())) for f in spec.seen}
        if spec.kind == "account":  # other kinds kept ids before only the account judged repeats
            st.recent.extend(obj["r"])
        pos = obj.get("p")  # absent in states written before positions were kept
        st.pos = (pos[0], pos[1], pos[2]) if pos else None
        st.ups = {(u[0], u[1]): (u[2], u[3]) for u in obj.get("u", ())}
        return st


class StepResult(NamedTuple):
    """What :func:`step` found: ``status`` DUP (seen before), LATE (account only) or OK with features.
    A named tuple: one is made per entity an event visits, and a frozen dataclass costs more to make."""

    status: str
    features: list[Any] | None = None
    #: the account's head when a late event arrived
    watermark_ms: int | None = None


def _geometry(horizon_ms: int) -> tuple[tuple[int, int, int], ...]:
    """``(tile_ms, tiles per window, tiles kept)`` of each window for a reorder horizon."""
    g = _GEOMETRY.get(horizon_ms)
    if g is None:
        g = _GEOMETRY[horizon_ms] = tuple((w.tile_ms, w.tiles, w.kept(horizon_ms)) for w in WINDOWS)
    return g


_GEOMETRY: dict[int, tuple[tuple[int, int, int], ...]] = {}
#: the features of a window with no tiles, by (counts small amounts, distinct fields)
_ZEROS: dict[bool, list[list[Any]]] = {
    small: [([0, 0.0, 0] if small else [0, 0.0]) + [0] * nf for nf in range(8)] for small in (False, True)
}


def step(spec: EntitySpec, cfg: FeatureConfig, state: EntityState, ev: dict[str, Any]) -> StepResult:
    """Read the entity's features as of ``ev`` (a RiskEvent as a dict), then add ``ev`` to ``state``.

    Idempotent per ``event_id`` on the account: an event found among the account's recent ids
    returns DUP and changes nothing, and an event more than ``grace_ms`` behind the head returns LATE
    and is only remembered as seen. Only the account judges repeats: ids are the account's own, so
    two accounts' events with one id on a shared card, device or ip are two events, and what the
    account took as new is counted everywhere it goes (an upstream stage's repeats are skipped by
    position in :meth:`pipeline.risk.stages.Stage.run`; docs/architecture.md, "Risk: takeover").
    Windows: see :class:`pipeline.risk.windows.Window` (``span`` and ``floor``).
    """
    account = spec.kind == "account"
    eid = ev["event_id"]
    t: int = ev["event_time_ms"]
    prev = state.head
    if account:
        if eid in state.recent:
            return StepResult(DUP)
        if prev is not None and t < prev - cfg.grace_ms:
            state.recent.append(eid)
            return StepResult(LATE, watermark_ms=prev)
    head = t if prev is None or t > prev else prev
    amount = cents(ev["amount"])
    fields = spec.distinct
    nf = len(fields)
    cap = cfg.distinct_max
    small_on = spec.small
    is_small = int(small_on and 0 < amount <= cfg.small_amount_cents)
    values = [ev[f] for f in fields]
    fresh = [(v,) if v is not None else () for v in values]
    zeros = _ZEROS[small_on][nf]
    out: list[Any] = []
    count = total = 0
    chosen: tuple[tuple[Any, ...], ...]
    for wi, (tile_ms, n, kept) in enumerate(_geometry(cfg.horizon_ms)):
        tiles = state.tiles[wi]
        hi = t // tile_ms
        floor = head // tile_ms - kept + 1
        lo = hi - n + 1
        if floor > lo:
            lo = floor
        count = total = small = 0
        if not tiles:
            out += zeros
        else:
            if len(tiles) == 1:  # the most common case by far (one tile of each window)
                for idx, tile in tiles.items():
                    chosen = (tile,) if lo <= idx <= hi else ()
            elif len(tiles) <= hi - lo + 1:
                chosen = tuple([tile for idx, tile in tiles.items() if lo <= idx <= hi])
            else:
                chosen = tuple([got for idx in range(lo, hi + 1) if (got := tiles.get(idx)) is not None])
            if len(chosen) == 1:
                one = chosen[0]
                count, total, small = one[0], one[1], one[2]
                out.append(count)
                out.append(total / 100)
                if small_on:
                    out.append(small)
                out += [n if (n := len(x)) <= cap else cap for x in one[3:]]
            else:
                for tile in chosen:
                    count += tile[0]
                    total += tile[1]
                    small += tile[2]
                out.append(count)
                out.append(total / 100)
                if small_on:
                    out.append(small)
                for k in range(3, 3 + nf):
                    n = len(set().union(*[tile[k] for tile in chosen]))
                    out.append(n if n <= cap else cap)
            # prune tiles below the floor (no later event reads them): tiles are mostly added in
            # order, so the first is the oldest; a full sweep when there are more than kept
            if next(iter(tiles)) < floor or len(tiles) > kept:
                for idx in [i for i in tiles if i < floor]:
                    del tiles[idx]
        if hi >= floor:
            cur = tiles.get(hi)
            if cur is None:
                tiles[hi] = (1, amount, is_small, *fresh)
            else:
                tiles[hi] = (
                    cur[0] + 1,
                    cur[1] + amount,
                    cur[2] + is_small,
                    *[
                        vs if v is None or v in vs or len(vs) >= cap else (*vs, v)
                        for v, vs in zip(values, cur[3:], strict=True)
                    ],
                )
    out.append(None if prev is None else max(0, t - prev) / 1000)
    if spec.kind == "account":
        # count and total are the last window's (24 h), read before the event was added
        out.append(amount * count / total if count and total else None)
        for f in spec.seen:
            v = ev[f]
            seen = state.seen[f]
            out.append(None if prev is None or v is None else int(v not in seen))
            if v is not None and v not in seen:
                state.seen[f] = (*seen, v)[-cfg.seen_max :]
    state.head = head
    if account:
        state.recent.append(eid)
    return StepResult(OK, out)


class FeatureEngine:
    """All four kinds in one process, every entity seeing events in the order given: the offline
    replay that training, the simulator's evaluation and the demo's summary use. (Online, each kind
    runs on the partition that owns the entity, see :mod:`pipeline.risk.stages`.)"""

    def __init__(self, cfg: FeatureConfig | None = None) -> None:
        self.cfg = cfg or FeatureConfig()
        self.states: dict[str, dict[str, EntityState]] = {k: {} for k in ENTITY_KINDS}

    def process(self, ev: dict[str, Any]) -> tuple[str, dict[str, Any] | None]:
        """``(status, features)``: features of every kind (None for kinds the event lacks), or
        ``(LATE, None)`` / ``(DUP, None)``."""
        feats: dict[str, Any] = dict.fromkeys(ALL_FEATURES)
        for kind in ENTITY_KINDS:
            key = ev[kind]
            if key is None:
                continue
            states = self.states[kind]
            st = states.get(key)
            if st is None:
                st = states[key] = EntityState(SPECS[kind], self.cfg)
            res = step(SPECS[kind], self.cfg, st, ev)
            if res.status != OK:
                if kind == "account":
                    return res.status, None
                continue  # a duplicate further down: already counted there
            feats.update(zip(NAMES[kind], res.features or (), strict=True))
        return OK, feats
