"""Forget expired reply-book entries in this worker's own store (docs/architecture.md, "Guarantees").

The reply book is a global table: every worker holds all of it in RocksDB. Its changelog expires
records after twice the reply TTL, but a worker's local store kept every entry it ever read: an
entry was deleted only when the same request came again after its TTL. At 100 replies a second that
is about 5 GB a day on every worker's disk. A timer sweeps one partition's store per tick, a chunk of
keys from where the last sweep of that partition stopped, and deletes the expired entries locally
(no tombstones: the changelog forgets them by retention, and a worker that restores from it gets
only the entries still within it).
"""

from __future__ import annotations

import json
import logging
from typing import Any

from pipeline.compat import delete_in_partition, scan_partition
from pipeline.ratelimit import SweepSchedule
from pipeline.replybook import expired_entry

log = logging.getLogger("surge.replybook")

#: how often a partition of the store is swept, and how many keys each sweep reads (about 1.5 ms
#: of the event loop each: 4.5 us to decode an entry, about as much to read it)
SWEEP_INTERVAL_S = 0.25
SWEEP_KEYS = 250


class BookSweeper:
    """Sweeps ``table``'s local stores one partition per :meth:`tick`, in turn."""

    def __init__(self, table: Any, partitions: int, ttl_ms: float, keys: int = SWEEP_KEYS) -> None:
        self.table = table
        self.partitions = partitions
        self.ttl_ms = ttl_ms
        self.schedule = SweepSchedule(every=1, keys=keys)
        self._next = 0
        #: entries deleted so far
        self.deleted = 0

    def tick(self, now_ms: float) -> int:
        """Called by a timer: sweep the next partition; returns the entries deleted."""
        partition = self._next
        self._next = (self._next + 1) % max(1, self.partitions)
        try:
            return self.sweep(partition, now_ms)
        except Exception:  # housekeeping never stops the worker; the next round tries again
            log.warning("sweeping reply-book partition %d failed", partition, exc_info=True)
            return 0

    def sweep(self, partition: int, now_ms: float) -> int:
        """Delete the expired entries among the next keys of ``partition``'s local store."""
        chunk = scan_partition(self.table, partition, self.schedule.cursor(partition), self.schedule.keys)
        self.schedule.moved(partition, chunk[-1][0] if chunk else None, len(chunk))
        gone = []
        for raw_key, raw_value in chunk:
            try:
                value = json.loads(raw_value) if raw_value else None
            except ValueError:
                continue
            if expired_entry(value, now_ms, self.ttl_ms):
                gone.append(raw_key)
        if gone:
            delete_in_partition(self.table, partition, gone)
            self.deleted += len(gone)
        return len(gone)
