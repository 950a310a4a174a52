"""Answer cache policy: an exact layer and a semantic layer over any key-value store.

The store is any ``MutableMapping[str, dict]`` — in a worker a Faust GlobalTable on RocksDB (so
every worker sees every answer, and answers survive restarts through the changelog), in tests a
dict. Entries expire after ``ttl_s``; beyond ``max_entries`` the least recently used are evicted.
Recency is tracked in memory per worker (a read must not write to the changelog); creation time
lives in the entry, so TTL holds across workers and restarts.

Lookups may run in a worker thread (:meth:`AnswerCache.lookup`: the inference agent searches a whole
embedding batch off the event loop): every method holds one lock, and a lookup never writes the
store — an expired entry it meets is forgotten in memory and deleted later by :meth:`drop_expired`,
on the thread that owns the store.

The semantic layer can accept a cached answer by the same merge decision live merging uses
(:mod:`pipeline.pairs`, see docs/architecture.md "Semantic dedup"): candidates come from the vector
index (cosine at least the decision's floor) and, for Chinese questions, which MiniLM cannot embed,
from a lexical index of character bigrams.

A merge is remembered (:meth:`CachedAnswer.remembered_as`): a request answered by another's model call
(merged into it, or served from the semantic layer) stores that answer under its own exact key, so its
repeats get the same answer at intake. Such an entry carries the similarity of that merge and is found
by its exact key only, never indexed: a merge is decided against a question the model answered, so
merges never chain.
"""

from __future__ import annotations

import base64
import binascii
import threading
from collections import OrderedDict, deque
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass, fields, replace

import numpy as np

from pipeline.dedup import SemanticIndex, normalize
from pipeline.pairs import MergeDecision, lexical_keys

#: Candidates a semantic lookup hands to the merge decision, from each index.
SEARCH_CANDIDATES = 16


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
    #: set on a remembered merge: ``text`` got the answer of ``request_id``'s model call at this similarity
    similarity: float | None = None

    @property
    def remembered(self) -> bool:
        """A remembered merge: found by its exact key only, never indexed."""
        return self.similarity is not None

    def remembered_as(self, text: str, similarity: float, scope: str) -> CachedAnswer | None:
        """This answer stored for ``text`` of ``scope``, which was merged into (or served from) this
        entry at ``similarity``. None when ``text`` has this entry's own normal form (its key is this
        entry's), or when the answer was made in another scope (a leader re-planned at a higher
        degradation level after its followers joined: its capped answer must not be cached for the
        parameters they asked). Keeps ``created_ms``, so the remembered merge expires with the answer."""
        if scope != self.scope or normalize(text) == normalize(self.text):
            return None
        return replace(self, text=text, vector=None, similarity=similarity)

    def to_dict(self) -> dict[str, object]:
        """The fields as a dict, the vector packed (:func:`pack_vector`) under ``vector_f32``. Not
        ``dataclasses.asdict``: it deep-copies the 384 floats of the vector one recursive call each,
        0.5 ms per write on the event loop against 2 us for this."""
        d: dict[str, object] = {name: getattr(self, name) for name in _FIELDS}
        del d["vector"]
        if self.vector is not None:
            d["vector_f32"] = pack_vector(self.vector)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, object]) -> CachedAnswer:
        """Read what :meth:`to_dict` wrote, or an older record with the vector as a JSON list; raises
        ``TypeError`` or ``ValueError`` on a malformed one."""
        packed = d.get("vector_f32")
        if packed is None:
            return cls(**d)  # type: ignore[arg-type]
        fields_ = {k: v for k, v in d.items() if k != "vector_f32"}
        return cls(**fields_, vector=unpack_vector(packed))  # type: ignore[arg-type]

    @staticmethod
    def has_vector(d: dict[str, object]) -> bool:
        """Whether a stored record carries a vector, without decoding it."""
        return d.get("vector_f32") is not None or d.get("vector") is not None


def pack_vector(vector: list[float]) -> str:
    """A vector as base64 of its float32 bytes (little-endian): 2 KiB of JSON for MiniLM's 384
    dimensions where a list of floats takes 8 KiB, and about 10 us to write and read where the list
    took 250 and 150 on every answer a worker stores, reads back from the changelog or serves from
    the cache (docs/architecture.md, "Caches and scopes"). Exact: the vectors are float32."""
    return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")


def unpack_vector(packed: object) -> list[float]:
    """The vector :func:`pack_vector` packed; ``ValueError`` when ``packed`` is not one."""
    if not isinstance(packed, str):
        raise ValueError(f"a packed vector is a base64 string, not {type(packed).__name__}")
    try:
        raw = base64.b64decode(packed, validate=True)
    except binascii.Error as exc:
        raise ValueError(f"a packed vector is not base64: {exc}") from exc
    if len(raw) % 4:
        raise ValueError(f"a packed vector of {len(raw)} bytes is not a whole number of float32")
    return np.frombuffer(raw, dtype="<f4").tolist()


_FIELDS = tuple(f.name for f in fields(CachedAnswer))


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
        # Chinese questions: scope -> bigram -> keys, and key -> (scope, bigrams)
        self._lexical: dict[str, dict[str, set[str]]] = {}
        self._lexical_keys: dict[str, tuple[str, frozenset[str]]] = {}
        # indexed key -> its question, what the merge decision reads (the store is read for the winner)
        self._question: dict[str, str] = {}
        #: one lock for every method: lookups run in a worker thread, writes on the event loop
        self._lock = threading.RLock()
        #: expired keys a lookup met (it never writes the store); deleted by drop_expired()
        self._expired: deque[str] = deque()

    def _fresh(self, entry: CachedAnswer, now: float) -> bool:
        return now - entry.created_ms < self.ttl_ms

    def get_exact(self, key: str) -> CachedAnswer | None:
        """Called by intake before forwarding: a fresh answer stored under ``key``."""
        with self._lock:
            return self._get(key, write=True)

    def _get(self, key: str, *, write: bool) -> CachedAnswer | None:
        raw = self.store.get(key)
        if raw is None:
            return None
        entry = CachedAnswer.from_dict(raw)
        if not self._fresh(entry, self.clock_ms()):
            if write:
                self._drop(key, entry)
            else:  # forgotten now, deleted from the store by drop_expired()
                self._forget(entry.scope, key)
                self._expired.append(key)
            return None
        self._touch(key)
        return entry

    def lookup(
        self, key: str, scope: str, vector: np.ndarray | None, text: str, decision: MergeDecision | None
    ) -> tuple[CachedAnswer, float] | None:
        """The exact answer under ``key``, else (with ``decision``) the best semantic match in
        ``scope``; similarity 1.0 for an exact hit. Safe in a worker thread: it writes no store."""
        with self._lock:
            hit = self._get(key, write=False)
            if hit is not None:
                return hit, hit.similarity if hit.similarity is not None else 1.0
            if decision is None:
                return None
            return self._decide(scope, vector, text, decision)

    def drop_expired(self) -> int:
        """Delete from the store the expired entries lookups met; called on the store's thread."""
        n = 0
        with self._lock:
            while self._expired:
                key = self._expired.popleft()
                raw = self.store.get(key)
                if raw is not None and not self._fresh(CachedAnswer.from_dict(raw), self.clock_ms()):
                    self._drop(key)
                    n += 1
        return n

    def _lexical_candidates(self, scope: str, text: str) -> list[str]:
        # a scope with no Chinese question cached has nothing to find: reading the text's language
        # took 0.13 of the 0.94 ms of an English lookup among 8,000 cached questions
        by_gram = self._lexical.get(scope)
        if not by_gram:
            return []
        grams = lexical_keys(text)
        if not grams:
            return []
        counts: dict[str, int] = {}
        for g in grams:
            for key in by_gram.get(g, ()):
                counts[key] = counts.get(key, 0) + 1
        need = max(1, len(grams) // 3)
        ranked = sorted((k for k, c in counts.items() if c >= need), key=lambda k: -counts[k])
        return ranked[:SEARCH_CANDIDATES]

    def _decide(
        self,
        scope: str,
        vector: np.ndarray | None,
        text: str,
        decision: MergeDecision,
    ) -> tuple[CachedAnswer, float] | None:
        """The cached question the decision ranks highest among those it lets merge with ``text``:
        vector candidates above the decision's cosine floor, plus lexical ones (texts the embedder does
        not read). Entries found expired or deleted are forgotten in memory (the store is not written:
        this may run in a worker thread)."""
        cands: dict[str, float | None] = {}
        if vector is not None and self.index is not None:
            cands.update(self.index.candidates(scope, vector, decision.cosine_floor, SEARCH_CANDIDATES))
        for key in self._lexical_candidates(scope, text):
            cands.setdefault(key, None)
        merging: list[tuple[float, str, float]] = []
        stale: list[str] = []
        for key, cos in cands.items():
            verdict = decision.decide(self._question[key], text, cos)
            if verdict.merge:
                merging.append((verdict.score, key, verdict.similarity))
        # the store is read for the best-ranked candidate only (the next when it expired or went):
        # reading each one (a RocksDB read and a JSON record with its vector) made every lookup dearer
        # as the cache filled and more candidates passed the cosine floor
        merging.sort(key=lambda m: -m[0])  # stable: on a tie the more similar vector, as before
        found: tuple[CachedAnswer, float] | None = None
        for _, key, similarity in merging:
            entry = self._get(key, write=False)
            if entry is None:
                stale.append(key)
                continue
            if self.index is not None:
                self.index.touch(scope, key)
            found = (entry, similarity)
            break
        for key in stale:
            self._forget(scope, key)
        return found

    def _forget(self, scope: str, key: str) -> None:
        if key in self._indexed and self.index is not None:
            self._indexed.discard(key)
            self._scope_of.pop(key, None)
            self.index.remove(scope, key)
        self._unindex_lexical(key)
        self._lru.pop(key, None)

    def _index_lexical(self, key: str, entry: CachedAnswer) -> bool:
        if key in self._lexical_keys:
            return False
        grams = lexical_keys(entry.text)
        if not grams:
            return False
        self._lexical_keys[key] = (entry.scope, grams)
        by_gram = self._lexical.setdefault(entry.scope, {})
        for g in grams:
            by_gram.setdefault(g, set()).add(key)
        return True

    def _unindex_lexical(self, key: str) -> None:
        # every path that takes a key out of the indexes comes here: its question goes with it
        self._question.pop(key, None)
        found = self._lexical_keys.pop(key, None)
        if found is None:
            return
        scope, grams = found
        by_gram = self._lexical.get(scope, {})
        for g in grams:
            keys = by_gram.get(g)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del by_gram[g]
        if not by_gram:
            self._lexical.pop(scope, None)

    def put(self, key: str, entry: CachedAnswer) -> None:
        """Called by inference after a model answer: store it and index its question's vector."""
        with self._lock:
            self.store[key] = entry.to_dict()
            self._index(key, entry)
            self._touch(key)
            self._evict()

    def sync(self) -> int:
        """Index entries other workers wrote (read from the shared store); returns how many were new."""
        with self._lock:
            added = 0
            now = self.clock_ms()
            for key, raw in list(self.store.items()):
                known = key in self._lru
                if (
                    key in self._indexed
                    or key in self._lexical_keys
                    or (known and not CachedAnswer.has_vector(raw))
                ):
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
        with self._lock:
            return self._learn(key, raw)

    def _learn(self, key: str, raw: dict[str, object] | None) -> bool:
        if raw is None:
            self._unindex(key)
            self._lru.pop(key, None)
            return False
        if key in self._indexed or key in self._lexical_keys:
            return False
        try:
            entry = CachedAnswer.from_dict(raw)
        except (TypeError, ValueError):
            return False
        if entry.remembered or (entry.vector is None and not lexical_keys(entry.text)):
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
        self._unindex_lexical(key)
        scope = self._scope_of.pop(key, None)
        self._indexed.discard(key)
        if scope is not None and self.index is not None:
            self.index.remove(scope, key)

    def __len__(self) -> int:
        return len(self._lru)

    def stats(self) -> dict[str, int]:
        """What a worker's /status shows: entries known, vectors indexed, scopes with vectors."""
        with self._lock:
            return {
                "entries": len(self._lru),
                "indexed": len(self._indexed),
                "scopes": self.index.scopes() if self.index is not None else 0,
            }

    def _index(self, key: str, entry: CachedAnswer) -> None:
        if entry.remembered:  # found by its exact key only: merges never chain
            return
        self._index_lexical(key, entry)
        if entry.vector is not None or key in self._lexical_keys:
            self._question[key] = entry.text
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
        self._unindex_lexical(key)
        if key in self._indexed:
            self._indexed.discard(key)
            known = self._scope_of.pop(key, None)
            scope = entry.scope if entry else known
            if scope is not None and self.index is not None:
                self.index.remove(scope, key)
        if key in self.store:
            del self.store[key]

    def _evict(self) -> None:
        while len(self._lru) > self.max_entries:
            key, _ = self._lru.popitem(last=False)
            raw = self.store.get(key)
            self._drop(key, CachedAnswer.from_dict(raw) if raw is not None else None)
