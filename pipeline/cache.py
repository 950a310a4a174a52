"""Answer cache policy: an exact layer and a semantic layer over any key-value store.

The store is any ``MutableMapping[str, dict]`` — in a worker a Faust GlobalTable on RocksDB (so
every worker sees every answer, and answers survive restarts through the changelog), in tests a
dict. Entries expire after ``ttl_s``; beyond ``max_entries`` the least recently used are evicted.
Recency is tracked in memory per worker (a read must not write to the changelog); creation time
lives in the entry, so TTL holds across workers and restarts.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, MutableMapping
from dataclasses import asdict, dataclass

import numpy as np

from pipeline.dedup import SemanticIndex


@dataclass(frozen=True, slots=True)
class CachedAnswer:
    answer: str
    finish_reason: str
    model_version: str
    created_ms: float
    scope: str
    text: str
    request_id: str
    vector: list[float] | None = None

    def to_dict(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> CachedAnswer:
        return cls(**d)  # type: ignore[arg-type]


class AnswerCache:
    """Exact and semantic answer lookups with TTL and LRU eviction."""

    def __init__(
        self,
        store: MutableMapping[str, dict[str, object]],
        *,
        ttl_s: float,
        max_entries: int,
        clock_ms: Callable[[], float],
        index_capacity: int | None = None,
    ) -> None:
        self.store = store
        self.ttl_ms = ttl_s * 1000
        self.max_entries = max_entries
        self.clock_ms = clock_ms
        # one spare slot: only this cache's LRU decides what leaves, never the index on its own
        self._index_capacity = index_capacity or max_entries + 1
        self.index: SemanticIndex | None = None  # created at the first vector (its dim)
        self._lru: OrderedDict[str, None] = OrderedDict()
        self._indexed: set[str] = set()
        self._scope_of: dict[str, str] = {}  # indexed key -> its scope

    def _fresh(self, entry: CachedAnswer, now: float) -> bool:
        return now - entry.created_ms < self.ttl_ms

    def get_exact(self, key: str) -> CachedAnswer | None:
        """Called by intake (and inference) before forwarding: a fresh answer stored under ``key``."""
        raw = self.store.get(key)
        if raw is None:
            return None
        entry = CachedAnswer.from_dict(raw)
        if not self._fresh(entry, self.clock_ms()):
            self._drop(key, entry)
            return None
        self._touch(key)
        return entry

    def search(
        self,
        scope: str,
        vector: np.ndarray,
        threshold: float,
        accept: Callable[[CachedAnswer], bool] | None = None,
    ) -> tuple[CachedAnswer, float] | None:
        """Called by inference for a request with no exact hit: the most similar fresh answer in
        ``scope`` that ``accept`` (the lexical guard against the cached question) allows.

        Expired entries and entries another worker deleted are dropped from the index on the way,
        so they never shadow a usable match.
        """
        if self.index is None:
            return None
        found: dict[str, CachedAnswer] = {}
        stale: list[str] = []

        def usable(key: str) -> bool:
            entry = self.get_exact(key)
            if entry is None:
                stale.append(key)
                return False
            if accept is not None and not accept(entry):
                return False
            found[key] = entry
            return True

        hit = self.index.search(scope, vector, threshold, accept=usable)
        for key in stale:  # after the search: removing moves rows of the matrix being read
            self._forget(scope, key)
        if hit is None:
            return None
        key, sim = hit
        return found[key], sim

    def _forget(self, scope: str, key: str) -> None:
        if key in self._indexed and self.index is not None:
            self._indexed.discard(key)
            self._scope_of.pop(key, None)
            self.index.remove(scope, key)
        self._lru.pop(key, None)

    def put(self, key: str, entry: CachedAnswer) -> None:
        """Called by inference after a model answer: store it and index its question's vector."""
        self.store[key] = entry.to_dict()
        self._index(key, entry)
        self._touch(key)
        self._evict()

    def sync(self) -> int:
        """Index entries other workers wrote (read from the shared store); returns how many were new."""
        added = 0
        now = self.clock_ms()
        for key, raw in list(self.store.items()):
            known = key in self._lru
            if key in self._indexed or (known and raw.get("vector") is None):
                continue
            entry = CachedAnswer.from_dict(raw)
            if self._fresh(entry, now):
                self._index(key, entry)
                if not known:
                    self._lru[key] = None
                    self._lru.move_to_end(key, last=False)  # unknown recency: evict these first
                added += 1
        return added

    def learn(self, key: str, raw: dict[str, object] | None) -> bool:
        """Index one entry another worker wrote, as its changelog record arrives (None: deleted).

        Called for each changelog event of the store, so that the semantic layer follows other
        workers' answers without re-reading the whole store; returns whether it was indexed.
        """
        if raw is None:
            self._unindex(key)
            self._lru.pop(key, None)
            return False
        if key in self._indexed or raw.get("vector") is None:
            return False
        try:
            entry = CachedAnswer.from_dict(raw)
        except TypeError:
            return False
        if not self._fresh(entry, self.clock_ms()):
            return False
        self._index(key, entry)
        if key not in self._lru:
            self._lru[key] = None
            self._lru.move_to_end(key, last=False)
        self._evict_index_only()
        return True

    def _evict_index_only(self) -> None:
        """Keep what this worker indexes within ``max_entries`` without writing the shared store."""
        while len(self._lru) > self.max_entries:
            key, _ = self._lru.popitem(last=False)
            self._unindex(key)

    def _unindex(self, key: str) -> None:
        scope = self._scope_of.pop(key, None)
        self._indexed.discard(key)
        if scope is not None and self.index is not None:
            self.index.remove(scope, key)

    def __len__(self) -> int:
        return len(self._lru)

    def _index(self, key: str, entry: CachedAnswer) -> None:
        if entry.vector is not None and key not in self._indexed:
            if self.index is None:
                self.index = SemanticIndex(dim=len(entry.vector), max_per_scope=self._index_capacity)
            self.index.add(entry.scope, key, np.asarray(entry.vector, dtype=np.float32))
            self._indexed.add(key)
            self._scope_of[key] = entry.scope

    def _touch(self, key: str) -> None:
        self._lru[key] = None
        self._lru.move_to_end(key)

    def _drop(self, key: str, entry: CachedAnswer | None = None) -> None:
        self._lru.pop(key, None)
        if key in self._indexed:
            self._indexed.discard(key)
            self._scope_of.pop(key, None)
            scope = entry.scope if entry else None
            if scope is not None and self.index is not None:
                self.index.remove(scope, key)
        if key in self.store:
            del self.store[key]

    def _evict(self) -> None:
        while len(self._lru) > self.max_entries:
            key, _ = self._lru.popitem(last=False)
            raw = self.store.get(key)
            self._drop(key, CachedAnswer.from_dict(raw) if raw is not None else None)
