"""Entity states that expire: the rule, and what the sweep deletes.

docs/architecture.md, "Risk: state expiry".

A state not changed for the TTL (by the worker's clock, as Flink's state TTL counts) has expired: its
entity's next event starts from an empty state, as a new entity's would. The rule is applied where a
state is read (:meth:`pipeline.risk.stages.Stage.state`), so a state the sweep has not reached yet,
or one restored from the changelog after the sweep deleted it, reads the same as a deleted one. The
sweep (:func:`sweep`, run by ``agents/risk.py``, paced by :class:`SweepPlan`) only gives the space
back: it walks each partition's store in key order and deletes the expired states, with a tombstone
on the changelog.

Pure: standard library only.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

_WROTE_PREFIX = b'{"w":'


@dataclass
class SweepPlan:
    """When the sweep looks at a partition's store, and where it goes on from.

    Every new entity a stage makes owes ``per_new`` keys of its partition's sweep, and every item
    ``per_item`` (so states expire from a table that no longer grows, too); once a partition owes
    ``keys`` or more, :meth:`owe` says how many (in whole ``keys``) and the sweep looks at that many
    stored states from :meth:`cursor`, then reports with :meth:`moved`. Looking at two keys per new
    entity, a full pass over a partition's S states comes round before S / 2 new ones have arrived,
    so a state is deleted at most a pass after it expired and the table holds at most about twice its
    live states, however fast new ids come; where they seldom come, the sweep costs next to nothing.
    """

    keys: int = 64
    per_new: float = 2.0
    per_item: float = 1 / 64
    #: the most keys one call may ask for (bounds one batch's pause, about 1 ms); the rest is carried
    #: over to the partition's next batches
    max_keys: int = 1024
    _owed: dict[int, float] = field(default_factory=dict)
    _cursor: dict[int, bytes | None] = field(default_factory=dict)

    def owe(self, partition: int, items: int, new: int) -> int:
        """Called after a batch with ``items`` items of ``partition`` that made ``new`` new entities:
        how many stored states of it to look at now (whole multiples of ``keys``, 0 for none)."""
        owed = self._owed.get(partition, 0.0) + items * self.per_item + new * self.per_new
        now = min(int(owed // self.keys) * self.keys, self.max_keys)
        self._owed[partition] = owed - now
        return now

    def cursor(self, partition: int) -> bytes | None:
        """The store key the next look starts after (None: from the first)."""
        return self._cursor.get(partition)

    def moved(self, partition: int, last: bytes | None, scanned: int, asked: int) -> None:
        """A look at ``scanned`` of the ``asked`` states ended at ``last``; a short one reached the
        end, and the next starts from the first key again."""
        self._cursor[partition] = last if scanned >= asked else None


def expired(wrote: int | None, now_ms: int, ttl_ms: int) -> bool:
    """Whether a state last changed at ``wrote`` has expired at ``now_ms`` (never with ``ttl_ms`` 0,
    nor a state with no time: written offline, or before expiry existed)."""
    return ttl_ms > 0 and wrote is not None and now_ms - wrote > ttl_ms


def written_ms(data: bytes) -> int | None:
    """When a stored state was last changed, read from its first field (``EntityState.dumps``
    writes ``"w"`` first) without decoding the rest: the sweep looks at every stored state. None when
    it has no time."""
    if not data.startswith(_WROTE_PREFIX):
        return None
    end = data.find(b",", len(_WROTE_PREFIX))
    try:
        return int(data[len(_WROTE_PREFIX) : end])
    except ValueError:  # null
        return None


def expired_keys(entries: Iterable[tuple[bytes, bytes | None]], now_ms: int, ttl_ms: int) -> list[bytes]:
    """The keys among ``entries`` (raw store keys and values) whose stored states have expired. The
    caller leaves out those a batch in flight has changed since (the store still holds their old
    state, which that batch replaces once the broker has its outputs)."""
    return [key for key, value in entries if value is not None and expired(written_ms(value), now_ms, ttl_ms)]


def sweep(
    plan: SweepPlan,
    partition: int,
    items: int,
    new: int,
    scan: Callable[[bytes | None, int], Sequence[tuple[bytes, bytes | None]]],
    now_ms: int,
    ttl_ms: int,
    busy: Callable[[bytes], bool],
) -> list[bytes]:
    """One partition's share of the sweep after a batch: the stored keys to delete. ``scan(after,
    n)`` gives up to ``n`` raw (key, value) pairs of the partition's store in key order after
    ``after``; ``busy(key)`` says whether a batch in flight has changed that state (left alone)."""
    keys = plan.owe(partition, items, new)
    if not keys or ttl_ms <= 0:
        return []
    chunk = scan(plan.cursor(partition), keys)
    plan.moved(partition, chunk[-1][0] if chunk else None, len(chunk), keys)
    return [key for key in expired_keys(chunk, now_ms, ttl_ms) if not busy(key)]
