"""Semantic dedup: text normalisation, cache scopes, leader clustering and the semantic answer index.

Pure logic (numpy only); see docs/architecture.md ("Semantic dedup"). The intake agent calls
:func:`normalize`, :func:`scope_key` and :func:`exact_key` for the exact answer cache; the inference
agent embeds new work items in batches, looks them up in a :class:`SemanticIndex` (the semantic answer
cache) and merges near-duplicates into the leaders already waiting or in flight
(:class:`pipeline.merge.MergeRegistry`; :func:`cluster` runs the same registry over a batch).

Two requests may share one answer only within one scope (tenant, model, generation parameters), and
only when they normalise to the same text or the merge decision (:mod:`pipeline.pairs`) allows it.
"""

from __future__ import annotations

import hashlib
import json
import re
import unicodedata
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

import numpy as np

from pipeline.exceptions import SurgeError
from pipeline.guard import guard_allows
from pipeline.pairs import MergeDecision
from pipeline.textcache import TextCache

__all__ = [
    "DEFAULT_SEMANTIC_THRESHOLD",
    "Assignment",
    "Cluster",
    "EmbeddingDimensionError",
    "SemanticIndex",
    "cluster",
    "exact_key",
    "guard_allows",
    "is_embeddable",
    "normalize",
    "scope_key",
    "would_merge",
]

#: Recommended cosine-similarity threshold for all-MiniLM-L6-v2 (with the guard); measured by
#: ``surge dedup eval`` on STS-B train, reported on dev (see the README's results).
DEFAULT_SEMANTIC_THRESHOLD: float = 0.87

#: English filler words and phrases that do not change what is asked; removed as whole words.
FILLER_PHRASES_EN: tuple[tuple[str, ...], ...] = (
    ("thank", "you"),
    ("thank", "u"),
    ("please",),
    ("pls",),
    ("plz",),
    ("thanks",),
    ("thx",),
    ("hi",),
    ("hello",),
    ("hey",),
    ("kindly",),
)

#: English greetings, removed only at the start of a text ("excuse me" inside a text may be meant).
FILLER_LEADING_EN: tuple[tuple[str, ...], ...] = (
    ("excuse", "me"),
    ("hey", "there"),
    ("hi", "there"),
    ("hello", "there"),
    ("good", "morning"),
    ("good", "afternoon"),
    ("good", "evening"),
    ("dear", "support"),
    ("dear", "team"),
)

#: English courtesies, removed only at the end of a text ("tell me if you can cancel it" keeps them).
FILLER_TRAILING_EN: tuple[tuple[str, ...], ...] = (
    ("thanks", "in", "advance"),
    ("thank", "you", "in", "advance"),
    ("many", "thanks"),
    ("if", "you", "can"),
    ("if", "you", "could"),
    ("if", "possible"),
    ("please", "help"),
    ("please", "help", "me"),
    ("help", "please"),
    ("cheers",),
)

#: Chinese fillers, removed only at the start of a run of Chinese text (请 inside 申请 must stay).
FILLER_PREFIXES_ZH: tuple[str, ...] = ("您好", "你好", "请问", "麻烦您", "麻烦你", "请")

#: Chinese fillers, removed only at the end of a run of Chinese text.
FILLER_SUFFIXES_ZH: tuple[str, ...] = ("谢谢您", "谢谢你", "谢谢", "多谢")

_CJK_RANGES: tuple[tuple[int, int], ...] = (
    (0x3040, 0x30FF),  # kana
    (0x3400, 0x4DBF),  # CJK extension A
    (0x4E00, 0x9FFF),  # CJK unified ideographs
    (0xAC00, 0xD7AF),  # hangul
    (0xF900, 0xFAFF),  # CJK compatibility ideographs
    (0x20000, 0x2FA1F),  # CJK extensions B-F
)
_CJK_CLASS = "".join(f"{chr(lo)}-{chr(hi)}" for lo, hi in _CJK_RANGES)
_CJK_GAP_RE = re.compile(f"(?<=[{_CJK_CLASS}]) (?=[{_CJK_CLASS}])")
_SPACE_RE = re.compile(r"\s+")


class EmbeddingDimensionError(SurgeError):
    """A vector of the wrong size reached a :class:`SemanticIndex` (an embedder was swapped)."""

    def __init__(self, expected: int, got: int) -> None:
        super().__init__(f"embedding has {got} dimensions; this index holds {expected}-dimensional vectors")
        self.expected = expected
        self.got = got


def _is_cjk(ch: str) -> bool:
    code = ord(ch)
    return code >= _CJK_RANGES[0][0] and any(lo <= code <= hi for lo, hi in _CJK_RANGES)


def _char_class(chars: Iterable[str]) -> str:
    return "[" + "".join(re.escape(ch) for ch in sorted(chars)) + "]"


def _strip_punctuation(text: str) -> str:
    """Replace punctuation (ASCII, CJK, any Unicode ``P*``) with spaces, except between two digits.

    Each distinct character's category is looked up once, and the replacement is one regular
    expression over the text (its classes made of the punctuation and digits this text holds): a
    character-by-character loop cost a 32 KiB text about 40 ms of the event loop per pass."""
    distinct = set(text)
    punct = [ch for ch in distinct if unicodedata.category(ch).startswith("P")]
    if not punct:
        return text
    digits = [ch for ch in distinct if ch.isdigit()]
    if not digits:
        return text.translate(dict.fromkeys(map(ord, punct), " "))
    # ASCII digits (nearly every text) as one fixed class: the pattern then depends on the
    # punctuation alone, which few texts vary, so re's cache of compiled patterns serves it
    d = "[0-9]" if all(ch.isascii() for ch in digits) else _char_class(digits)
    p = _char_class(punct)
    return re.sub(f"(?<!{d}){p}|{p}(?!{d})", " ", text)


def _strip_zh_fillers(token: str) -> str:
    changed = True
    while changed and token:
        changed = False
        for prefix in FILLER_PREFIXES_ZH:
            if token.startswith(prefix):
                token, changed = token[len(prefix) :], True
        for suffix in FILLER_SUFFIXES_ZH:
            if token.endswith(suffix):
                token, changed = token[: -len(suffix)], True
    return token


def _drop_edge_fillers(tokens: list[str]) -> list[str]:
    """Drop :data:`FILLER_LEADING_EN` from the start and :data:`FILLER_TRAILING_EN` from the end."""
    changed = True
    while changed and tokens:
        changed = False
        for phrase in FILLER_LEADING_EN:
            if tuple(tokens[: len(phrase)]) == phrase and len(tokens) > len(phrase):
                tokens, changed = tokens[len(phrase) :], True
        for phrase in FILLER_TRAILING_EN:
            if tuple(tokens[-len(phrase) :]) == phrase and len(tokens) > len(phrase):
                tokens, changed = tokens[: -len(phrase)], True
    return tokens


#: :data:`FILLER_PHRASES_EN` by their first word, in their order: a token that starts none is
#: passed by one lookup (a 32 KiB text has thousands of tokens)
_FILLERS_BY_FIRST: dict[str, tuple[tuple[str, ...], ...]] = {
    first: tuple(p for p in FILLER_PHRASES_EN if p[0] == first) for first in {p[0] for p in FILLER_PHRASES_EN}
}


def _drop_fillers(tokens: list[str]) -> list[str]:
    tokens = _drop_edge_fillers(tokens)
    out: list[str] = []
    i = 0
    while i < len(tokens):
        for phrase in _FILLERS_BY_FIRST.get(tokens[i], ()):
            if tuple(tokens[i : i + len(phrase)]) == phrase:
                i += len(phrase)
                break
        else:
            token = tokens[i]
            if token and _is_cjk(token[0]):
                token = _strip_zh_fillers(token)
            if token:
                out.append(token)
            i += 1
    return out


def _normalize_once(text: str) -> str:
    text = unicodedata.normalize("NFKC", text).casefold()
    text = unicodedata.normalize("NFKC", text)
    text = _strip_punctuation(text)
    text = _SPACE_RE.sub(" ", text).strip()
    text = _CJK_GAP_RE.sub("", text)
    tokens = text.split(" ") if text else []
    kept = _drop_fillers(tokens)
    # a text made only of fillers ("thanks", "hello") keeps them: those differ in meaning
    return " ".join(kept) if kept else text


#: texts whose normal form is kept: a question and its normal form take about 0.3 KB, so the count
#: binds first (about 5 MiB); a text of the content limit takes 64 KiB or more, and the bytes bind
#: (docs/architecture.md, "Security")
NORMALIZE_CACHE = 16_384
NORMALIZE_CACHE_BYTES = 8 << 20


def _normalize(text: str) -> str:
    """Normalise ``text`` for exact matching: NFKC, casefold, no punctuation, single spaces, no fillers.

    Cached (:data:`normalize`): the registry, the merge decision and the caches all ask for the same
    texts.

    Called by intake for the exact cache key and by :func:`cluster` for exact merges. Punctuation
    between two digits stays (``12.5`` is not ``125``). Idempotent: applied until it stops changing.
    """
    current = text
    for _ in range(8):
        nxt = _normalize_once(current)
        if nxt == current:
            break
        current = nxt
    return current


normalize: TextCache[str] = TextCache(_normalize, NORMALIZE_CACHE, NORMALIZE_CACHE_BYTES)


def scope_key(tenant: str, model: str | None, max_tokens: int, temperature: float, logprobs: bool) -> str:
    """The scope within which requests may share an answer (sha256 hex of the parameters).

    Called once per request at intake; caches and leaders are partitioned by it, so two tenants,
    models or parameter sets never share an answer.
    """
    payload = json.dumps([tenant, model or "", int(max_tokens), float(temperature), bool(logprobs)])
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def exact_key(normalized_text: str, scope: str) -> str:
    """The exact answer-cache key of a normalised text within a scope (sha256 hex)."""
    digest = hashlib.sha256()
    digest.update(scope.encode("utf-8"))
    digest.update(b"\x00")
    digest.update(normalized_text.encode("utf-8"))
    return digest.hexdigest()


def is_embeddable(text: str, multilingual: bool) -> bool:
    """Whether the embedder reads ``text``: always with a multilingual one; with an English-only one,
    only when at least 90% of its letters are Latin. Other texts merge only by exact match."""
    if multilingual:
        return True
    letters = [ch for ch in text if ch.isalpha()]
    if not letters:
        return True
    latin = sum(1 for ch in letters if ch.isascii() or unicodedata.name(ch, "").startswith("LATIN"))
    return latin >= 0.9 * len(letters)


def would_merge(a: str, b: str, similarity: float, threshold: float, multilingual: bool) -> bool:
    """The plain threshold rule for two texts in one scope: exact normalised match, or both
    embeddable, ``similarity >= threshold`` and the guard allows. :func:`cluster` with a threshold
    applies the same rule (:class:`pipeline.pairs.ThresholdDecision`)."""
    if normalize(a) == normalize(b):
        return True
    if not (is_embeddable(a, multilingual) and is_embeddable(b, multilingual)):
        return False
    return similarity >= threshold and guard_allows(a, b)[0]


@dataclass
class Cluster:
    """A leader: the request whose model call serves its followers.

    Leaders still waiting or in flight are passed back into :func:`cluster` with the next batch so
    new arrivals can follow them; the caller drops a leader once its answer has been sent.
    """

    leader_id: str
    scope: str
    text: str
    #: unit vector, or None when the text is not embeddable (merges by exact match only)
    vector: np.ndarray | None
    normalized: str = ""
    followers: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.normalized:
            self.normalized = normalize(self.text)


@dataclass(frozen=True)
class Assignment:
    """Where one item of a batch went: a new leader, or a follower of ``leader_id``."""

    index: int
    item_id: str
    leader_id: str
    is_leader: bool
    similarity: float
    exact: bool
    #: the new cluster, set when ``is_leader``; the caller keeps it while the leader is in flight
    cluster: Cluster | None = None


def _unit(vector: np.ndarray) -> np.ndarray:
    v = np.asarray(vector, dtype=np.float32).reshape(-1)
    norm = float(np.linalg.norm(v))
    return v / norm if norm > 0 else v


def cluster(
    vectors: np.ndarray,
    texts: Sequence[str],
    scopes: Sequence[str],
    threshold: float,
    leaders: Sequence[Cluster] = (),
    ids: Sequence[str] | None = None,
    multilingual: bool = False,
    decision: MergeDecision | None = None,
) -> list[Assignment]:
    """Assign each item of a batch to an existing or new leader, in arrival order.

    Runs :class:`pipeline.merge.MergeRegistry` (what live merging runs) with ``decision``, or with the
    plain rule at ``threshold`` when no decision is given. Greedy leader clustering: each item is
    compared with the leaders of its scope only (never with followers); it follows the leader the
    decision ranks highest among those it allows, else becomes a leader itself. Why this algorithm:
    it is online (items arrive in a stream and must be placed at once), costs O(n·k) for n items and
    k leaders, and since an item joins a leader only on its own similarity to THAT leader, clusters
    cannot drift by chaining (a~b, b~c, but a not ~ c).

    Exact normalised matches within a scope always merge. Texts the embedder cannot read (see
    :func:`is_embeddable`) get no vector: they merge by exact match, or by the decision's Chinese
    head when it has one.
    """
    from pipeline.merge import MergeRegistry

    n = len(texts)
    if len(scopes) != n or (ids is not None and len(ids) != n):
        raise ValueError(f"cluster: {n} texts but {len(scopes)} scopes and {len(ids or texts)} ids")
    vecs = np.asarray(vectors, dtype=np.float32)
    if vecs.ndim != 2 or vecs.shape[0] != n:
        raise ValueError(f"cluster: {n} texts but vectors of shape {vecs.shape}")
    item_ids = list(ids) if ids is not None else [str(i) for i in range(n)]
    registry = MergeRegistry(threshold, decision=decision)
    clusters: dict[str, Cluster] = {}
    for leader in leaders:
        embeddable = leader.vector is not None and is_embeddable(leader.text, multilingual)
        registry.open(leader.leader_id, leader.scope, leader.text, leader.vector if embeddable else None, 0)
        clusters.setdefault(leader.leader_id, leader)

    out: list[Assignment] = []
    for i, (text, scope) in enumerate(zip(texts, scopes, strict=True)):
        vector = _unit(vecs[i]) if is_embeddable(text, multilingual) else None
        found = registry.find(scope, text, vector, 0)
        if found is not None:
            hit, sim = found
            clusters[hit.leader_id].followers.append(item_ids[i])
            exact = hit.norm_text == normalize(text)
            out.append(Assignment(i, item_ids[i], hit.leader_id, False, 1.0 if exact else sim, exact))
            continue
        new = Cluster(item_ids[i], scope, text, vector)
        registry.open(item_ids[i], scope, text, vector, 0)
        clusters[item_ids[i]] = new
        out.append(Assignment(i, item_ids[i], item_ids[i], True, 1.0, False, new))
    return out


class SemanticIndex:
    """The semantic answer cache's index: unit vectors per scope, searched by cosine similarity.

    The inference agent calls :meth:`search` for each newly embedded item (before merging), and
    :meth:`add` when a model answer is stored in the cache; :meth:`remove` when the cache entry
    expires. Each scope holds at most ``max_per_scope`` vectors; adding beyond that evicts the
    least recently used (added or hit) one. A scope's matrix starts at one row and doubles as it
    fills, so many small scopes (one per tenant, conversation context and parameters) cost about
    their vectors, not a pre-allocated block each. Pure numpy: a brute-force matrix product, which at
    10k x 384 float32 costs about a millisecond.
    """

    def __init__(self, dim: int, max_per_scope: int = 10_000) -> None:
        if dim <= 0 or max_per_scope <= 0:
            raise ValueError(
                f"SemanticIndex needs dim > 0 and max_per_scope > 0 (got {dim}, {max_per_scope})"
            )
        self.dim = dim
        self.max_per_scope = max_per_scope
        self._matrix: dict[str, np.ndarray] = {}
        self._keys: dict[str, list[str]] = {}
        self._rows: dict[str, OrderedDict[str, int]] = {}  # key -> row, in LRU order

    def _check(self, vector: np.ndarray) -> np.ndarray:
        v = np.asarray(vector, dtype=np.float32).reshape(-1)
        if v.shape[0] != self.dim:
            raise EmbeddingDimensionError(self.dim, int(v.shape[0]))
        return _unit(v)

    def __len__(self) -> int:
        return sum(len(rows) for rows in self._rows.values())

    def scopes(self) -> int:
        """Number of scopes holding vectors."""
        return len(self._rows)

    def size(self, scope: str) -> int:
        """Number of vectors held for ``scope``."""
        return len(self._rows.get(scope, ()))

    def __contains__(self, item: tuple[str, str]) -> bool:
        scope, key = item
        return key in self._rows.get(scope, {})

    def add(self, scope: str, key: str, vector: np.ndarray) -> str | None:
        """Store ``vector`` under ``key`` (replacing an existing one); returns the evicted key, if any."""
        v = self._check(vector)
        rows = self._rows.setdefault(scope, OrderedDict())
        keys = self._keys.setdefault(scope, [])
        matrix = self._matrix.get(scope)
        if matrix is None:
            matrix = self._matrix[scope] = np.zeros((1, self.dim), dtype=np.float32)
        if key in rows:
            matrix[rows[key]] = v
            rows.move_to_end(key)
            return None
        evicted: str | None = None
        if len(rows) >= self.max_per_scope:
            evicted = next(iter(rows))
            self.remove(scope, evicted)
            # removing the last vector drops the scope's structures: take them anew
            rows = self._rows.setdefault(scope, OrderedDict())
            keys = self._keys.setdefault(scope, [])
            matrix = self._matrix.setdefault(scope, np.zeros((1, self.dim), dtype=np.float32))
        n = len(keys)
        if n == matrix.shape[0]:
            grown = np.zeros((min(2 * n, self.max_per_scope), self.dim), dtype=np.float32)
            grown[:n] = matrix[:n]
            matrix = self._matrix[scope] = grown
        matrix[n] = v
        keys.append(key)
        rows[key] = n
        return evicted

    def remove(self, scope: str, key: str) -> bool:
        """Drop ``key`` from ``scope``; False if it was not there. Moves the last row into its place."""
        rows = self._rows.get(scope)
        if rows is None or key not in rows:
            return False
        keys = self._keys[scope]
        matrix = self._matrix[scope]
        row = rows.pop(key)
        last = len(keys) - 1
        if row != last:
            moved = keys[last]
            matrix[row] = matrix[last]
            keys[row] = moved
            rows[moved] = row
        keys.pop()
        matrix[last] = 0.0
        if not keys:
            del self._rows[scope], self._keys[scope], self._matrix[scope]
        return True

    def candidates(self, scope: str, vector: np.ndarray, floor: float, limit: int) -> list[tuple[str, float]]:
        """Up to ``limit`` keys of ``scope`` with similarity >= ``floor``, most similar first; the
        caller decides which (if any) is a hit and :meth:`touch` es it."""
        rows = self._rows.get(scope)
        if not rows:
            return []
        v = self._check(vector)
        keys = self._keys[scope]
        sims = self._matrix[scope][: len(keys)] @ v
        found = np.flatnonzero(sims >= floor)
        if found.size > limit:
            found = found[np.argpartition(-sims[found], limit - 1)[:limit]]
        found = found[np.argsort(-sims[found], kind="stable")]
        return [(keys[int(j)], float(sims[j])) for j in found]

    def touch(self, scope: str, key: str) -> None:
        """Mark ``key`` as just used (LRU order)."""
        rows = self._rows.get(scope)
        if rows is not None and key in rows:
            rows.move_to_end(key)

    def search(
        self,
        scope: str,
        vector: np.ndarray,
        threshold: float,
        accept: Callable[[str], bool] | None = None,
    ) -> tuple[str, float] | None:
        """The most similar key in ``scope`` with similarity >= ``threshold`` (and ``accept(key)``
        true, if given: the caller passes the lexical guard against the cached text), or None."""
        rows = self._rows.get(scope)
        if not rows:
            return None
        v = self._check(vector)
        keys = list(self._keys[scope])  # a snapshot: ``accept`` may remove entries
        sims = self._matrix[scope][: len(keys)] @ v
        candidates = np.flatnonzero(sims >= threshold)
        if candidates.size == 0:
            return None
        for j in candidates[np.argsort(-sims[candidates], kind="stable")]:
            key = keys[int(j)]
            if accept is None or accept(key):
                if key in rows:
                    rows.move_to_end(key)
                return key, float(sims[j])
        return None
