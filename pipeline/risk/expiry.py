"""Entity states that expire: the rule, and what the sweep deletes (docs/architecture.md,
"Risk: state expiry").

A state not changed for the TTL (by the worker's clock, as Flink's state TTL counts) has expired: its
entity's next event starts from an empty state, as a new entity's would. The rule is applied where a
state is read (:meth:`pipeline.risk.stages.Stage.state`), so a state the sweep has not reached yet,
or one restored from the changelog after the sweep deleted it, reads the same as a deleted one. The
sweep (``agents/risk.py``) only gives the space back: it walks each partition's store a few keys per
event and deletes the expired states, with a tombstone on the changelog.

Pure: standard library only.
"""

from __future__ import annotations

from collections.abc import Iterable

_WROTE_PREFIX = b'{"w":'

#: the sweep looks at ``SWEEP_KEYS`` stored states of a partition per ``SWEEP_EVERY`` items of it: a
#: quarter of a key per item, so a full pass over a table costs about four items per state, and a
#: table growing by one new entity per item (the most it can) holds at most the live states plus
#: four TTLs' worth
SWEEP_EVERY = 256
SWEEP_KEYS = 64


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
    if ttl_ms <= 0:
        return []
    return [key for key, value in entries if value is not None and expired(written_ms(value), now_ms, ttl_ms)]
