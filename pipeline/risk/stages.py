"""The re-keyed chain of the risk path, as pure logic over a state store (docs/architecture.md,
"Risk: the chain").

An event visits its entities in the order account → card → device → ip (skipping those it lacks).
Each entity kind is a stage: it runs on the partition that owns the entity, reads and updates the
entity's state (:func:`pipeline.risk.features.step`), adds that entity's features to the event's
*item*, and hands the item on to the next entity's stage through a repartition topic, on the
partition Kafka's default partitioner gives the next entity's id (murmur2, as a record keyed by it
would land), or, at the last entity, to the decision. So each entity's state lives on exactly one
partition, as in Kafka Streams.

Records on the repartition topics carry several items each (all bound for the record's partition):
one record per target partition per batch, which keeps the per-record cost of the broker and of
Faust off the per-event path.

An item (JSON): ``e`` the event, ``f`` the features so far (each visited kind's values, in
:data:`pipeline.risk.features.NAMES` order), ``rv`` the rule-set version pinned at the
account stage (so a decision repeated after a crash evaluates the same rules), ``ts`` the event
record's produce time and ``rx`` when the account stage read it.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from pipeline.exceptions import SurgeError
from pipeline.risk import jsonio
from pipeline.risk.expiry import expired
from pipeline.risk.features import DUP, LATE, NAMES, SPECS, EntityState, FeatureConfig, step
from pipeline.risk.records import ENTITY_KINDS, MAX_AMOUNT

#: the kinds that are reached through a repartition topic
REKEYED_KINDS: tuple[str, ...] = ENTITY_KINDS[1:]
#: where a stage read an item: (partition, offset of its record, index of the item in that record)
Position = tuple[int, int, int]
#: where :meth:`Stage.state` found a state
FOUND, NEW, EXPIRED = "found", "new", "expired"


class RepartitionRecordError(SurgeError):
    """A record on a repartition topic that surge did not write (it is dead-lettered)."""

    code = "internal"

    def __init__(self, topic: str, partition: int, offset: int, detail: str) -> None:
        super().__init__(f"undecodable repartition record at {topic}[{partition}]@{offset}: {detail}")
        self.topic, self.partition, self.offset = topic, partition, offset


def murmur2(data: bytes) -> int:
    """Kafka's murmur2 hash (org.apache.kafka.common.utils.Utils.murmur2), unsigned 32-bit."""
    length = len(data)
    m, r = 0x5BD1E995, 24
    h = (0x9747B28C ^ length) & 0xFFFFFFFF
    for i in range(0, length - length % 4, 4):
        k = data[i] | (data[i + 1] << 8) | (data[i + 2] << 16) | (data[i + 3] << 24)
        k = (k * m) & 0xFFFFFFFF
        k ^= k >> r
        k = (k * m) & 0xFFFFFFFF
        h = ((h * m) & 0xFFFFFFFF) ^ k
    tail = length & ~3
    extra = length % 4
    if extra >= 3:
        h ^= data[tail + 2] << 16
    if extra >= 2:
        h ^= data[tail + 1] << 8
    if extra >= 1:
        h ^= data[tail]
        h = (h * m) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * m) & 0xFFFFFFFF
    h ^= h >> 15
    return h


def key_partition(key: bytes, partitions: int) -> int:
    """The partition a record keyed by the bytes ``key`` gets from Kafka's default partitioner."""
    return (murmur2(key) & 0x7FFFFFFF) % partitions


@lru_cache(maxsize=1 << 16)
def partition_for(key: str, partitions: int) -> int:
    """The partition a record keyed ``key`` gets from Kafka's default partitioner."""
    return key_partition(key.encode(), partitions)


def next_kind(event: dict[str, Any], after: str) -> str | None:
    """The next entity kind after ``after`` that the event has, or None (then it is decided)."""
    for kind in ENTITY_KINDS[ENTITY_KINDS.index(after) + 1 :]:
        if event.get(kind) is not None:
            return kind
    return None


def new_item(event: dict[str, Any], rule_version: str, produced_ms: int, received_ms: int) -> dict[str, Any]:
    """The item the account stage starts from."""
    return {"e": event, "f": {}, "rv": rule_version, "ts": produced_ms, "rx": received_ms}


def pack(items: Sequence[dict[str, Any]]) -> bytes:
    """One repartition record holding ``items``."""
    return jsonio.dumps({"items": list(items)})


def unpack(raw: bytes | None, where: tuple[str, int, int], kind: str | None = None) -> list[dict[str, Any]]:
    """The items of one repartition record, each checked as a stage, the decision and the model will
    read it (for the stage of ``kind``, its entity must be there); :class:`RepartitionRecordError`
    for anything else. surge writes these records itself, but a record it did not write (a client
    with access to the topic, a worker of another version in a rolling upgrade) must be
    dead-lettered, not stop the worker each time it reads the record again."""
    try:
        items = jsonio.loads(raw or b"")["items"]
        if not isinstance(items, list):
            raise ValueError("items must be a list")
        for n, item in enumerate(items):
            problem = _item_problem(item, kind)
            if problem is not None:
                raise ValueError(f"item {n}: {problem}")
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise RepartitionRecordError(*where, str(exc)) from exc
    return items


#: an item's event as the account stage writes it (``RiskEvent.model_dump``): field -> allowed types
_EVENT_FIELDS: dict[str, tuple[type, ...]] = {
    "event_id": (str,),
    "type": (str,),
    "account": (str,),
    "card": (str, type(None)),
    "device": (str, type(None)),
    "ip": (str, type(None)),
    "amount": (float, int),
    "currency": (str,),
    "merchant": (str, type(None)),
    "country": (str,),
    "event_time_ms": (int,),
}
_FEATURE_TYPES = frozenset((int, float, type(None)))


def _item_problem(item: Any, kind: str | None) -> str | None:
    """What is wrong with one repartition item, or None. Types are checked exactly (``type(x) in``:
    no bools for numbers), so an item read here is one the stages, :func:`decision_record` and the
    model can take."""
    if type(item) is not dict:
        return "not an object"
    ev, feats = item.get("e"), item.get("f")
    if type(ev) is not dict or ev.keys() != _EVENT_FIELDS.keys():
        return f"e must be an event with the fields {', '.join(_EVENT_FIELDS)}"
    for name, types in _EVENT_FIELDS.items():
        if type(ev[name]) not in types:
            return f"e.{name} has type {type(ev[name]).__name__}"
    amount = ev["amount"]
    if not 0 <= amount <= MAX_AMOUNT:  # False for NaN too
        return f"e.amount {amount!r} is outside [0, {MAX_AMOUNT:g}]"
    if kind is not None and ev[kind] is None:
        return f"the event has no {kind}, yet it came to the {kind} stage"
    if type(feats) is not dict:
        return "f must be an object"
    for k, values in feats.items():
        names = NAMES.get(k)
        if names is None or type(values) is not list or len(values) != len(names):
            return f"f.{k} must be the {len(names or ())} values of a known entity kind"
        if not _FEATURE_TYPES.issuperset(map(type, values)):
            return f"f.{k} holds a value that is not a number or null"
    if type(item.get("rv")) is not str or type(item.get("ts")) is not int:
        return "rv must be a string and ts an integer"
    if not _origin_ok(item.get("o")):
        return "o (if any) must be four integers"
    return None


def _origin_ok(o: Any) -> bool:
    return o is None or (
        type(o) is list
        and len(o) == 4
        and type(o[0]) is int
        and type(o[1]) is int
        and type(o[2]) is int
        and type(o[3]) is int
    )


def full_features(partial: dict[str, list[Any]]) -> dict[str, Any]:
    """Every feature by name (``partial`` holds each visited kind's values in :data:`NAMES` order),
    None where the event had no such entity."""
    out: dict[str, Any] = {}
    for kind in ENTITY_KINDS:
        values = partial.get(kind)
        out.update(
            zip(NAMES[kind], values, strict=True) if values is not None else dict.fromkeys(NAMES[kind])
        )
    return out


class StateCache:
    """The feature cache: decoded entity states of one stage, least recently used evicted first.

    Reads it serves skip the RocksDB read and the JSON decode. It is cleared on every rebalance (a
    partition this worker gets back may have been updated elsewhere meanwhile)."""

    def __init__(self, max_entries: int) -> None:
        self.max_entries = max_entries
        self._data: OrderedDict[str, EntityState] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: str) -> EntityState | None:
        st = self._data.get(key)
        if st is None:
            self.misses += 1
        else:
            self.hits += 1
            self._data.move_to_end(key)
        return st

    def put(self, key: str, state: EntityState) -> None:
        if self.max_entries <= 0:
            return
        self._data[key] = state
        self._data.move_to_end(key)
        while len(self._data) > self.max_entries:
            self._data.popitem(last=False)

    def discard(self, key: str) -> None:
        """Forget ``key`` (its state was deleted from the store)."""
        self._data.pop(key, None)

    def clear(self) -> None:
        self._data.clear()

    def __len__(self) -> int:
        return len(self._data)


@dataclass
class StageResult:
    """What one stage made of a batch."""

    #: items for the next stage, by (kind, partition)
    forward: dict[tuple[str, int], list[dict[str, Any]]] = field(default_factory=dict)
    #: items with all their features: to be decided
    decide: list[tuple[dict[str, Any], Any]] = field(default_factory=list)
    #: late items (account stage), with the account's head and the context they came with
    late: list[tuple[dict[str, Any], int, Any]] = field(default_factory=list)
    #: changed states to write once the outputs are on the broker: key → (state, context)
    dirty: dict[str, tuple[EntityState, Any]] = field(default_factory=dict)
    #: items skipped as seen before: by event id (a repeat sent again upstream) or by position
    duplicates: int = 0
    #: of those, items at or before their entity's position: input read again after a crash
    reread: int = 0
    #: of those, items an upstream stage sent again (at or before the position taken from it)
    resent: int = 0
    #: entities whose state had expired (not changed for the TTL): they started again empty
    expired: int = 0
    #: entities with no state yet, by the input partition of the item that made them (where their
    #: state is stored; the sweep's pace, :class:`pipeline.risk.expiry.SweepPlan`)
    new: dict[int, int] = field(default_factory=dict)


class Stage:
    """One entity kind's stage. ``load(key, ctx)`` reads a state's bytes from the table (``ctx`` is
    whatever the caller needs to find the right partition: the Faust event)."""

    def __init__(
        self,
        kind: str,
        cfg: FeatureConfig,
        partitions: int,
        cache: StateCache,
        load: Callable[[str, Any], bytes | None],
    ) -> None:
        self.kind = kind
        #: this kind's index, in the origin (``o``) of the items it sends on
        self.stamp = ENTITY_KINDS.index(kind)
        self.spec = SPECS[kind]
        self.names = NAMES[kind]
        self.cfg = cfg
        self.partitions = partitions
        self.cache = cache
        self.load = load

    def state(self, key: str, ctx: Any, now_ms: int | None = None) -> tuple[EntityState, str]:
        """The entity's state and where it came from: FOUND (cached or stored), NEW (none yet), or
        EXPIRED: the one found was not changed for ``cfg.state_ttl_ms`` before ``now_ms``, and a new
        one replaces it (the sweep deletes such states from the store; this rule makes a state the
        sweep has not reached yet, or one restored from the changelog, read the same:
        docs/architecture.md, "Risk: state expiry")."""
        st = self.cache.get(key)
        how = FOUND
        if st is None:
            raw = self.load(key, ctx)
            if raw is None:
                st, how = EntityState(self.spec, self.cfg), NEW
            else:
                st = EntityState.loads(raw, self.spec, self.cfg)
            self.cache.put(key, st)
        if now_ms is not None and expired(st.wrote, now_ms, self.cfg.state_ttl_ms):
            st, how = EntityState(self.spec, self.cfg), EXPIRED
            self.cache.put(key, st)
        return st, how

    def run(
        self,
        batch: Sequence[tuple[dict[str, Any], Any]],
        positions: Sequence[Position] | None = None,
        end_of: Callable[[int], int | None] | None = None,
        now_ms: int | None = None,
    ) -> StageResult:
        """Step every item of ``batch`` (in order) through its entity's state.

        ``now_ms``: the worker's clock (online): each state changed records it, and a state not
        changed for ``cfg.state_ttl_ms`` before it starts again empty (:meth:`state`). None
        offline: nothing expires.

        ``positions``: where each item was read, ``(partition, offset, index in the record)``. All of
        an entity's input comes from one partition of one topic (the one its id hashes to), in offset
        order, so an item at or before the position its state last took was taken already: input read
        again after a crash, from the last committed offset, is skipped whatever its length (the event
        ids an entity remembers cover only a repeat sent again upstream;
        docs/architecture.md, "Risk: takeover").

        ``end_of(partition)``: that input partition's end offset as the reader last saw it (asked
        only when an item would be skipped). A state's position at or past its partition's end was
        left by an earlier incarnation of the topic (deleted and created again while the state
        stayed): it is ignored rather than taken to mean that every new record was read before,
        which would leave those events without a decision.

        An item a stage sends on carries where that stage read it (``o``: its kind's index, partition,
        offset, index). A stage that died after sending its outputs and before writing its states
        sends the same items again from the same positions when its input is read again; the entity
        downstream keeps the last position it took from each upstream partition (whose items reach
        it in order) and skips an item at or before it, however many events from other partitions
        came in between. Only if the event is also no later than the entity's latest: a repeat always
        is (its original was taken), and a new event after the upstream's topic was created again
        under a state that stayed (its offsets start over) mostly is not."""
        out = StageResult()
        kind, stamp = self.kind, self.stamp
        for i, (item, ctx) in enumerate(batch):
            ev = item["e"]
            key = ev[kind]
            dirty = out.dirty.get(key)
            pos = positions[i] if positions is not None else None
            if dirty is not None:
                st = dirty[0]
            else:
                st, how = self.state(key, ctx, now_ms)
                if how == EXPIRED:
                    out.expired += 1
                elif how == NEW and pos is not None:
                    out.new[pos[0]] = out.new.get(pos[0], 0) + 1
            if pos is not None:
                last = st.pos
                if last is not None and last[0] == pos[0] and pos <= last:
                    end = end_of(pos[0]) if end_of is not None else None
                    if end is None or last[1] < end:
                        out.duplicates += 1
                        out.reread += 1
                        continue
            origin = item.get("o")
            if origin is not None:
                src, at = (origin[0], origin[1]), (origin[2], origin[3])
                seen = st.ups.get(src)
                if seen is not None and at <= seen and st.head is not None and ev["event_time_ms"] <= st.head:
                    out.duplicates += 1
                    out.resent += 1
                    continue
            res = step(self.spec, self.cfg, st, ev)
            if res.status == DUP:
                out.duplicates += 1
                continue
            if pos is not None:
                st.pos = pos
            if origin is not None:
                st.ups[src] = at
            st.wrote = now_ms
            out.dirty[key] = (st, ctx)
            if res.status == LATE:
                out.late.append((item, res.watermark_ms or 0, ctx))
                continue
            item["f"][kind] = res.features
            nxt = next_kind(ev, kind)
            if nxt is None:
                out.decide.append((item, ctx))
            else:
                if pos is not None:
                    item["o"] = (stamp, *pos)
                else:
                    item.pop("o", None)
                out.forward.setdefault((nxt, partition_for(ev[nxt], self.partitions)), []).append(item)
        return out


def decision_record(
    item: dict[str, Any],
    *,
    decision: str,
    score: float | None,
    reasons: list[str],
    rule_version: str | None,
    model_version: str | None,
    decided_ms: int,
    late: bool = False,
    features: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A RiskDecision as a dict (see :class:`pipeline.risk.records.RiskDecision`). ``features``: the
    item's :func:`full_features` when the caller has them already."""
    ev = item["e"]
    return {
        "event_id": ev["event_id"],
        "account": ev["account"],
        "decision": decision,
        "score": score,
        "reasons": reasons,
        "rule_version": rule_version,
        "model_version": model_version,
        "features": {} if late else features if features is not None else full_features(item["f"]),
        "late": late,
        "timings": {
            "event_time_ms": ev["event_time_ms"],
            "produced_ms": item["ts"],
            "decided_ms": decided_ms,
            "produce_to_decision_ms": max(0, decided_ms - item["ts"]),
        },
    }
