"""Writes kept in memory and handed to a slower store in batches, per partition (docs/architecture.md,
"Rate-limit buckets: written behind").

The intake's rate-limit table took two writes per request (the user's bucket and the tenant's),
each a RocksDB write and a changelog record: at twice the model's limit a third of the records the
broker received, and a share of the intake's event loop. Written behind, a bucket's newest state
stays here and reaches the store (and its changelog) once per ``flush_ms`` of its partition, one
write per bucket however many requests changed it. Reads see the newest state first.

What a crash costs: the states written here since the partition's last flush, at most ``flush_ms``
of its requests (a user's bucket is restored that much fuller; :class:`pipeline.ratelimit.RateLimiter`
still admits at most ``rate * T + burst`` in any ``T`` between crashes). The store's own writes were
never awaited either: Faust sends a table's changelog record some time after the write.

Pure: the caller says which partition the next writes belong to (:attr:`partition`, the record being
handled), when to flush (:meth:`due`), and makes the store write to the right partition.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, MutableMapping
from typing import Any

_MISSING = object()


def _monotonic_ms() -> float:
    return time.monotonic() * 1000.0


class WriteBehind(MutableMapping[str, Any]):
    """A mapping in front of ``store``: reads and writes are those of :attr:`partition`, as a Faust
    table's are those of the current record's partition; reads see the unflushed writes first, and
    writes stay here until :meth:`flush` of their partition."""

    def __init__(
        self, store: MutableMapping[str, Any], flush_ms: float, clock: Callable[[], float] = _monotonic_ms
    ) -> None:
        if flush_ms < 0:
            raise ValueError(f"flush_ms must not be negative, got {flush_ms}")
        self.store = store
        self.flush_ms = flush_ms
        self.clock = clock
        #: the partition of the record being handled: its reads and writes are that partition's
        self.partition = 0
        self._dirty: dict[int, dict[str, Any]] = {}
        #: when each partition's oldest unflushed write was made (ms, ``clock``)
        self._since: dict[int, float] = {}
        self.flushed = 0  # writes handed to the store
        self.coalesced = 0  # writes that replaced an unflushed one (one store write saved each)

    def _unflushed_value(self, key: str) -> Any:
        """:attr:`partition`'s unflushed value of ``key``, or ``_MISSING``."""
        dirty = self._dirty.get(self.partition)
        return _MISSING if dirty is None else dirty.get(key, _MISSING)

    def __getitem__(self, key: str) -> Any:
        value = self._unflushed_value(key)
        return self.store[key] if value is _MISSING else value

    def get(self, key: str, default: Any = None) -> Any:
        value = self._unflushed_value(key)
        return self.store.get(key, default) if value is _MISSING else value

    def __setitem__(self, key: str, value: Any) -> None:
        dirty = self._dirty.setdefault(self.partition, {})
        if key in dirty:
            self.coalesced += 1
        elif not dirty:
            self._since[self.partition] = self.clock()
        dirty[key] = value

    def _forget(self, key: str) -> None:
        dirty = self._dirty.get(self.partition)
        if dirty is not None:
            dirty.pop(key, None)

    def __delitem__(self, key: str) -> None:
        self._forget(key)
        del self.store[key]

    def pop(self, key: str, default: Any = _MISSING) -> Any:
        self._forget(key)
        if default is _MISSING:
            return self.store.pop(key)
        return self.store.pop(key, default)

    def __iter__(self) -> Iterator[str]:
        return iter(self.store)

    def __len__(self) -> int:
        return len(self.store)

    def unflushed(self, key: str) -> bool:
        """Whether :attr:`partition` holds a write of ``key`` the store has not seen."""
        return self._unflushed_value(key) is not _MISSING

    def pending(self, partition: int | None = None) -> int:
        """Unflushed writes (of one partition, or of all)."""
        if partition is not None:
            return len(self._dirty.get(partition, ()))
        return sum(map(len, self._dirty.values()))

    def partitions(self) -> list[int]:
        """The partitions with unflushed writes."""
        return [p for p, dirty in self._dirty.items() if dirty]

    def due(self, partition: int) -> bool:
        """Whether ``partition``'s oldest unflushed write is ``flush_ms`` old: asked after each record
        of that partition, and by a timer for partitions whose records stopped."""
        since = self._since.get(partition)
        return since is not None and self.clock() - since >= self.flush_ms

    def flush(self, partition: int) -> int:
        """Hand ``partition``'s unflushed writes to the store, in the order first written (the
        caller makes the store write them to that partition); returns how many. Should the store
        raise, the writes not yet handed over stay here for the next flush."""
        dirty = self._dirty.get(partition)
        n = 0
        if dirty:
            for key in list(dirty):
                self.store[key] = dirty[key]
                del dirty[key]
                n += 1
        self._since.pop(partition, None)
        self.flushed += n
        return n

    def drop(self, partitions: set[int]) -> int:
        """Forget the unflushed writes of ``partitions`` (revoked: their next owner restores the
        buckets from the changelog, at most ``flush_ms`` older); returns how many."""
        n = 0
        for partition in partitions:
            n += len(self._dirty.pop(partition, ()))
            self._since.pop(partition, None)
        return n
