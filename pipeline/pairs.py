"""Pair features and the merge decision: may two requests of one scope share one answer?

Pure logic (numpy only); see docs/architecture.md ("Semantic dedup"). One decision object is used by
every place that merges: live merging of in-flight requests (:class:`pipeline.merge.MergeRegistry`),
the semantic answer cache (:meth:`pipeline.cache.AnswerCache.search`) and ``surge dedup eval``.

A pair merges when, in this order:

1. both texts normalise to the same string (:func:`pipeline.dedup.normalize`): always;
2. the lexical guard (:mod:`pipeline.guard`) finds a difference that changes the meaning: never;
3. otherwise the decision's rule says so. Two rules exist:

   * :class:`ThresholdDecision`: embedding cosine similarity at least a threshold (the old rule);
   * :class:`LearnedDecision`: a small calibrated classifier over pair features (below), one head per
     language, each with an operating point (a probability) chosen on training data. The English head
     reads MiniLM's cosine and word/character overlap; the Chinese head reads characters, since MiniLM
     turns every Chinese character into ``[UNK]``. Weights ship as ``.npz`` + ``.json`` in
     ``pipeline/merge_data`` (no pickle), trained by ``surge dedup train`` (:mod:`models.merge_train`).

Pair features (:data:`FEATURES`), computed from a per-text :class:`Profile` cached by text, so a
leader compared many times is read once. Units are stemmed words for English and characters for
Chinese; ``idf`` is a hashed inverse document frequency table learnt with the weights:

* ``cosine``: embedding cosine (0 for Chinese);
* ``unit_jaccard`` / ``bigram_jaccard``: overlap of the unit sets and of adjacent-unit pairs;
* ``content_overlap``: idf-weighted overlap of the content units (stop words left out);
* ``char_cosine``: cosine of the idf-weighted character n-gram vectors;
* what differs: ``unmatched_max_idf`` (the rarest unit only one text has), ``unmatched_mass`` (the
  share of a text's content weight the other lacks, larger side), ``unmatched_count``;
* ``length_ratio``, ``length_min``, ``same_content`` and ``cosine_x_overlap``;
* ``order_agreement``: the share of shared content units that come in the same order in both texts
  ("a man carries a dog" / "a dog carries a man" disagree);
* ``action_asymmetry``: action words of the guard's list that only one text names ("charged" on one
  side only). The guard vetoes an action against its opposite outright; this one-sided case is left
  to the classifier.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
import re
import unicodedata
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from pipeline.atomic import npz_bytes, replace_files
from pipeline.exceptions import SurgeError
from pipeline.guard import GUARD_TEXT_CHARS, action_asymmetry, guard_allows, hard_conflict
from pipeline.textcache import TextCache

__all__ = [
    "FEATURES",
    "LANGUAGES",
    "DecisionLoadError",
    "Head",
    "IdfTable",
    "LearnedDecision",
    "MergeDecision",
    "Profile",
    "ThresholdDecision",
    "Verdict",
    "decision_from_settings",
    "default_data_dir",
    "language",
    "lexical_keys",
    "load_decision",
]

#: Languages with a head: English (read through the embedder) and Chinese (read by characters).
LANGUAGES: tuple[str, ...] = ("en", "zh")

FEATURES: tuple[str, ...] = (
    "cosine",
    "unit_jaccard",
    "content_overlap",
    "bigram_jaccard",
    "char_cosine",
    "unmatched_max_idf",
    "unmatched_mass",
    "unmatched_count",
    "length_ratio",
    "length_min",
    "same_content",
    "cosine_x_overlap",
    "order_agreement",
    "action_asymmetry",
)

#: Hashed idf table size (2**18 buckets of float16: 512 KiB).
IDF_BITS = 18

#: English function words: left out of the content units ("not", "no", "never" stay content).
STOPWORDS_EN: frozenset[str] = frozenset(
    """a an the and or but if then so as of at by for with about to from in on into onto over under
    up down out off is are was were be been being am do does did doing have has had having will would
    shall should can could may might must i me my mine myself you your yours yourself he him his she
    her hers it its itself we us our ours they them their theirs this that these those there here
    what which who whom whose when where why how all any each some such own same too very just also
    than only again further once s t d ll m re ve y o get got please hi hello hey thanks thank""".split()
)

#: Chinese function characters: left out of the content units.
STOPCHARS_ZH: frozenset[str] = frozenset(
    "的了着过是在和与及或而也都就还又把被给对从向让一个这那些么吗呢吧啊呀哦嘛么之其此"
)

_HAN_RANGES: tuple[tuple[int, int], ...] = (
    (0x3400, 0x4DBF),
    (0x4E00, 0x9FFF),
    (0xF900, 0xFAFF),
    (0x20000, 0x2FA1F),
)
_WORD_RE = re.compile(r"[^\W_]+")


class DecisionLoadError(SurgeError):
    """The merge decision's weights are missing, unreadable, or of another format version."""


def _is_han(ch: str) -> bool:
    code = ord(ch)
    return any(lo <= code <= hi for lo, hi in _HAN_RANGES)


def language(text: str) -> str:
    """``"zh"`` when at least half the letters are Han characters, ``"en"`` when at least 90 % are
    Latin (or there are none), else ``"other"`` (merged only by exact match)."""
    letters = [ch for ch in text if ch.isalpha()]
    if not letters:
        return "en"
    han = sum(1 for ch in letters if _is_han(ch))
    if han * 2 >= len(letters):
        return "zh"
    latin = sum(1 for ch in letters if ch.isascii() or unicodedata.name(ch, "").startswith("LATIN"))
    return "en" if latin * 10 >= 9 * len(letters) else "other"


def stem(word: str) -> str:
    """A light English stemmer: plural and verb endings and a final ``e`` go, so that "charge",
    "charges", "charged" and "charging" meet. Digits and words of three letters or fewer are kept as
    they are, and the -ed/-ing endings only go from words long enough to keep a stem of three."""
    if len(word) <= 3 or not word.isalpha():
        return word
    w = word
    if w.endswith("ies") and len(w) > 4:
        w = w[:-3] + "y"
    elif w.endswith("ing") and len(w) >= 6:
        w = w[:-3]
    elif w.endswith("ed") and len(w) >= 5:
        w = w[:-2]
    elif w.endswith("s") and not w.endswith("ss") and not w.endswith("us") and len(w) >= 4:
        w = w[:-1]
    if len(w) >= 4 and w[-1] == w[-2] and w[-1] not in "aeiouls":
        w = w[:-1]
    if len(w) >= 4 and w.endswith("e"):
        w = w[:-1]
    return w


def _hash(key: str) -> int:
    return zlib.crc32(key.encode("utf-8")) & ((1 << IDF_BITS) - 1)


class IdfTable:
    """Hashed inverse document frequencies: ``idf(key) = ln((n + 1) / (df + 1)) + 1``.

    Keys are hashed into :data:`IDF_BITS` buckets, so the table holds numbers only, never text.
    """

    def __init__(self, values: np.ndarray, documents: int) -> None:
        if values.shape != (1 << IDF_BITS,):
            raise DecisionLoadError(f"idf table has shape {values.shape}; expected ({1 << IDF_BITS},)")
        self.values = np.asarray(values, dtype=np.float32)
        self._list: list[float] = self.values.tolist()  # plain floats: indexing a list is much faster
        self.documents = documents
        self.max_idf = math.log(documents + 1) + 1.0

    @classmethod
    def fit(cls, documents: Iterable[Iterable[str]]) -> IdfTable:
        """Count each key once per document (an iterable of keys per text)."""
        df = np.zeros(1 << IDF_BITS, dtype=np.float64)
        n = 0
        for keys in documents:
            n += 1
            for h in {_hash(k) for k in keys}:
                df[h] += 1
        return cls((np.log((n + 1) / (df + 1)) + 1.0).astype(np.float32), n)

    @classmethod
    def uniform(cls) -> IdfTable:
        """Every key weighs the same (used only before training, and in tests)."""
        return cls(np.ones(1 << IDF_BITS, dtype=np.float32), 1)

    def __call__(self, key: str) -> float:
        return self._list[_hash(key)]

    def at(self, bucket: int) -> float:
        """The idf of a hashed bucket."""
        return self._list[bucket]


@dataclass(frozen=True, slots=True, eq=False)
class Profile:
    """What the pair features read from one text (see :func:`LearnedDecision.profile`). Compared by
    identity: it holds arrays."""

    text: str
    normalized: str
    lang: str
    units: frozenset[str]
    #: content unit -> idf
    content: Mapping[str, float]
    content_mass: float
    bigrams: frozenset[str]
    #: the hashed character n-grams, sorted (int32), and their weights, L2-normalised (float64): two
    #: arrays rather than a dict of 100-odd entries, which held 70 % of a profile's 12 KiB, and the
    #: decision keeps 2,048 profiles (docs/architecture.md, "Security")
    gram_keys: np.ndarray
    gram_weights: np.ndarray
    n_units: int
    #: content units in the order of their first appearance
    order: tuple[str, ...]


def _units(normalized: str, lang: str) -> list[str]:
    if lang == "zh":
        return [ch for ch in normalized if not ch.isspace()]
    return [stem(w) for w in _WORD_RE.findall(normalized)]


def _grams(normalized: str, lang: str) -> list[str]:
    if lang == "zh":
        s = "".join(normalized.split())
        return [s[i : i + n] for n in (1, 2, 3) for i in range(len(s) - n + 1)]
    s = f" {normalized} "
    return [s[i : i + n] for n in (3, 4) for i in range(len(s) - n + 1)]


def idf_keys(text: str) -> list[str]:
    """The keys of ``text`` that the idf table counts (units and character n-grams)."""
    from pipeline.dedup import normalize

    norm = normalize(text)
    lang = language(norm)
    return [f"u:{u}" for u in _units(norm, lang)] + [f"g:{g}" for g in _grams(norm, lang)]


def lexical_keys(text: str) -> frozenset[str]:
    """Character bigrams of a Chinese text, for the cache's lexical candidate index (empty otherwise)."""
    from pipeline.dedup import normalize

    norm = normalize(text)
    if language(norm) != "zh":
        return frozenset()
    s = "".join(ch for ch in norm if not ch.isspace() and ch not in STOPCHARS_ZH)
    return frozenset(s[i : i + 2] for i in range(len(s) - 1)) or frozenset(s)


#: how much of a normalised text the pair features read: as much as the guard reads. A question is
#: far shorter; what lies past the bound is compared whole by the guard (two texts that differ there
#: never merge), so reading it too told the decision nothing and cost a 32 KiB request about half a
#: second of the event loop per profile (docs/architecture.md, "Semantic dedup")
PROFILE_TEXT_CHARS = GUARD_TEXT_CHARS


def build_profile(text: str, idf: IdfTable) -> Profile:
    """Read ``text`` once: normalised form (whole, for exact matches), and of its first
    :data:`PROFILE_TEXT_CHARS` characters the language, units, content weights, n-gram vector."""
    from pipeline.dedup import normalize

    norm = normalize(text)
    read = norm[:PROFILE_TEXT_CHARS]
    lang = language(read)
    units = _units(read, lang)
    stop = STOPCHARS_ZH if lang == "zh" else STOPWORDS_EN
    content = {u: idf(f"u:{u}") for u in units if u not in stop}
    counts: dict[int, float] = {}
    for g in _grams(read, lang):
        h = _hash(f"g:{g}")
        counts[h] = counts.get(h, 0.0) + 1.0
    weights = {h: c * idf.at(h) for h, c in counts.items()}
    norm2 = math.sqrt(sum(w * w for w in weights.values())) or 1.0
    keys = np.fromiter(weights.keys(), dtype=np.int32, count=len(weights))
    order = np.argsort(keys)
    values = np.fromiter(weights.values(), dtype=np.float64, count=len(weights)) / norm2
    return Profile(
        text=text,
        normalized=norm,
        lang=lang,
        units=frozenset(units),
        content=content,
        content_mass=sum(content.values()),
        bigrams=frozenset(f"{x} {y}" for x, y in itertools.pairwise(units)),
        gram_keys=keys[order],
        gram_weights=values[order],
        n_units=len(units),
        order=tuple(dict.fromkeys(u for u in units if u in content)),
    )


def _sparse_dot(
    keys_a: np.ndarray, weights_a: np.ndarray, keys_b: np.ndarray, weights_b: np.ndarray
) -> float:
    """Dot product of two sparse vectors, each given as sorted keys and their weights."""
    if not len(keys_a) or not len(keys_b):
        return 0.0
    at = np.minimum(np.searchsorted(keys_b, keys_a), len(keys_b) - 1)
    shared = keys_b[at] == keys_a
    return float(np.dot(weights_a[shared], weights_b[at[shared]]))


def _jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    if not a and not b:
        return 1.0
    return len(a & b) / len(a | b)


def _order_agreement(a: tuple[str, ...], b: tuple[str, ...]) -> float:
    """Longest run of shared units in the same order in both texts, over the shared units (1: same)."""
    position = {u: i for i, u in enumerate(b)}
    seq = [position[u] for u in a if u in position]
    if len(seq) < 2:
        return 1.0
    tails: list[int] = []
    for x in seq:
        k = bisect.bisect_left(tails, x)
        if k == len(tails):
            tails.append(x)
        else:
            tails[k] = x
    return len(tails) / len(seq)


def pair_features(pa: Profile, pb: Profile, cosine: float | None, max_idf: float) -> np.ndarray:
    """The :data:`FEATURES` vector of a pair (symmetric in ``pa`` and ``pb``)."""
    cos = 0.0 if cosine is None else float(cosine)
    ca, cb = pa.content, pb.content
    shared = sum(w for u, w in ca.items() if u in cb)
    union = pa.content_mass + pb.content_mass - shared
    overlap = shared / union if union > 0 else 1.0
    only_a = [w for u, w in ca.items() if u not in cb]
    only_b = [w for u, w in cb.items() if u not in ca]
    unmatched_max = max(only_a + only_b, default=0.0) / max_idf
    mass_a = sum(only_a) / pa.content_mass if pa.content_mass > 0 else 0.0
    mass_b = sum(only_b) / pb.content_mass if pb.content_mass > 0 else 0.0
    char_cos = _sparse_dot(pa.gram_keys, pa.gram_weights, pb.gram_keys, pb.gram_weights)
    na, nb = pa.n_units, pb.n_units
    return np.array(
        [
            cos,
            _jaccard(pa.units, pb.units),
            overlap,
            _jaccard(pa.bigrams, pb.bigrams),
            char_cos,
            unmatched_max,
            max(mass_a, mass_b),
            math.log1p(max(len(only_a), len(only_b))),
            min(na, nb) / max(na, nb) if max(na, nb) else 1.0,
            math.log1p(min(na, nb)),
            1.0 if ca.keys() == cb.keys() else 0.0,
            cos * overlap,
            _order_agreement(pa.order, pb.order),
            float(action_asymmetry(pa.text, pb.text)),
        ],
        dtype=np.float32,
    )


@dataclass(frozen=True, slots=True)
class Verdict:
    """A decision on one pair: ``merge``; ``score`` ranks candidates (a probability for the learned
    decision, the cosine for the threshold one); ``similarity`` is what a merged reply reports;
    ``reason`` says why (``exact``, ``guard: ...``, ``model``, ``threshold``, ``below ...``)."""

    merge: bool
    score: float
    similarity: float
    reason: str


_EXACT = Verdict(True, 1.0, 1.0, "exact")


class MergeDecision(Protocol):
    """What merging, the semantic cache and the evaluation ask about a pair of texts of one scope."""

    name: str
    #: an embedded pair whose cosine is under this never merges (the vector search's prefilter)
    cosine_floor: float

    def decide(self, a: str, b: str, cosine: float | None) -> Verdict:
        """Whether ``a`` and ``b`` may share one answer; ``cosine`` is None when either is not embedded."""
        ...


class ThresholdDecision:
    """The plain rule: exact normalised match, or cosine at least ``threshold`` and the guard allows.

    Only texts both embedded (``cosine`` given) can merge by similarity.
    """

    name = "threshold"

    def __init__(self, threshold: float) -> None:
        self.threshold = float(threshold)
        self.cosine_floor = float(threshold)

    def decide(self, a: str, b: str, cosine: float | None) -> Verdict:
        from pipeline.dedup import normalize

        if normalize(a) == normalize(b):
            return _EXACT
        if cosine is None or cosine < self.threshold:
            return Verdict(False, cosine or 0.0, cosine or 0.0, "below threshold")
        allowed, why = guard_allows(a, b)
        if not allowed:
            return Verdict(False, cosine, cosine, f"guard: {why}")
        return Verdict(True, cosine, cosine, "threshold")


@dataclass(frozen=True)
class Head:
    """One language's classifier: standardise, a small network (or a linear layer), Platt scaling.

    ``layers`` are ``(weight, bias)`` pairs with ReLU between them; the last layer has one output, the
    logit ``z``; the probability is ``sigmoid(calibration[0] * z + calibration[1])``.
    """

    mean: np.ndarray
    scale: np.ndarray
    layers: tuple[tuple[np.ndarray, np.ndarray], ...]
    calibration: tuple[float, float]
    #: the operating point: merge when the probability is at least this
    threshold: float
    #: pairs whose embedding cosine is below this never merge (English head only)
    cosine_floor: float = 0.0

    def __post_init__(self) -> None:
        # a single linear layer folds the standardisation into its weights: one dot product a pair
        if len(self.layers) == 1:
            w, b = self.layers[0]
            folded = (w[:, 0] / self.scale).astype(np.float64)
            offset = float(b[0]) - float(np.dot(self.mean.astype(np.float64), folded))
            object.__setattr__(self, "_folded", (folded.tolist(), offset))
        else:
            object.__setattr__(self, "_folded", None)

    def probability(self, x: Sequence[float]) -> float:
        """The calibrated probability of one feature vector (the fast path :meth:`decide` uses)."""
        folded = self._folded  # type: ignore[attr-defined]
        if folded is None:
            return float(self.probabilities(np.asarray(x))[0])
        weights, offset = folded
        z = offset + sum(a * b for a, b in zip(weights, x, strict=True))
        a, b = self.calibration
        return 1.0 / (1.0 + math.exp(-max(-40.0, min(40.0, a * z + b))))

    def logits(self, x: np.ndarray) -> np.ndarray:
        h = (np.asarray(x, dtype=np.float32) - self.mean) / self.scale
        for i, (w, b) in enumerate(self.layers):
            h = h @ w + b
            if i < len(self.layers) - 1:
                h = np.maximum(h, 0.0)
        return h.reshape(-1)

    def probabilities(self, x: np.ndarray) -> np.ndarray:
        a, b = self.calibration
        z = np.clip(a * self.logits(np.atleast_2d(x)) + b, -40.0, 40.0)
        return 1.0 / (1.0 + np.exp(-z))


#: what the merge decision's cached text profiles may hold, per profile kept (see :class:`LearnedDecision`)
PROFILE_BYTES = 16 << 10


class LearnedDecision:
    """The shipped pair classifier (see the module docstring); load it with :func:`load_decision`.

    ``cosine_fallback``: with an embedder other than the one the English head was trained with, its
    cosines mean something else; give the plain threshold for it here and embedded pairs fall back to
    :class:`ThresholdDecision` (the Chinese head reads characters and keeps working).
    ``profile_cache``: how many texts' profiles are kept (the open leaders and the cache's candidates
    are what is read again), and ``profile_cache_bytes`` how much they may hold (default: 16 KiB a
    profile, 32 MiB for 2,048): a question's profile takes about 5 KiB, so the count binds first; one
    of a text of the content limit (32 KiB) takes about 1.2 MiB, and the bytes bind
    (docs/architecture.md, "Security").
    """

    name = "learned"

    def __init__(
        self,
        heads: Mapping[str, Head],
        idf: IdfTable,
        meta: Mapping[str, Any] | None = None,
        cosine_fallback: float | None = None,
        profile_cache: int = 2048,
        profile_cache_bytes: int | None = None,
    ) -> None:
        self.heads = dict(heads)
        self.idf = idf
        self.meta = dict(meta or {})
        self.cosine_fallback = cosine_fallback
        self._fallback = ThresholdDecision(cosine_fallback) if cosine_fallback is not None else None
        en = self.heads.get("en")
        if self._fallback is not None:
            self.cosine_floor = self._fallback.cosine_floor
        else:
            self.cosine_floor = en.cosine_floor if en is not None else 1.0
        if profile_cache_bytes is None:
            profile_cache_bytes = profile_cache * PROFILE_BYTES
        self.profile: TextCache[Profile] = TextCache(self._profile, profile_cache, profile_cache_bytes)

    def _profile(self, text: str) -> Profile:
        return build_profile(text, self.idf)

    def with_cosine_fallback(self, threshold: float | None) -> LearnedDecision:
        """The same heads, with embedded pairs decided by a plain cosine ``threshold`` (None: the head)."""
        return LearnedDecision(self.heads, self.idf, self.meta, threshold)

    def head_for(self, pa: Profile, pb: Profile, cosine: float | None) -> str | None:
        """Which head decides a pair: ``"zh"`` when both texts are Chinese, ``"en"`` when both are
        English and embedded; None (exact match only) otherwise."""
        if pa.lang == pb.lang == "zh" and "zh" in self.heads:
            return "zh"
        if pa.lang == pb.lang == "en" and cosine is not None and "en" in self.heads:
            return "en"
        return None

    def features(self, a: str, b: str, cosine: float | None) -> np.ndarray:
        """The pair's :data:`FEATURES` (what training and :meth:`decide` feed the heads)."""
        return pair_features(self.profile(a), self.profile(b), cosine, self.idf.max_idf)

    def probability(self, a: str, b: str, cosine: float | None) -> float | None:
        """The calibrated probability that ``a`` and ``b`` mean the same, or None without a head."""
        pa, pb = self.profile(a), self.profile(b)
        head = self.head_for(pa, pb, cosine)
        if head is None:
            return None
        x = pair_features(pa, pb, cosine, self.idf.max_idf)
        return float(self.heads[head].probabilities(x)[0])

    def decide(self, a: str, b: str, cosine: float | None) -> Verdict:
        pa, pb = self.profile(a), self.profile(b)
        if pa.normalized == pb.normalized:
            return _EXACT
        head = self.head_for(pa, pb, cosine)
        if self._fallback is not None and cosine is not None and head != "zh":
            return self._fallback.decide(a, b, cosine)
        if head is None:
            return Verdict(False, 0.0, cosine or 0.0, "no head for this pair")
        h = self.heads[head]
        if head == "en" and (cosine or 0.0) < h.cosine_floor:
            return Verdict(False, 0.0, cosine or 0.0, "below the cosine floor")
        x = pair_features(pa, pb, cosine, self.idf.max_idf)
        similarity = float(x[0]) if head == "en" else float(x[4])
        p = h.probability(x.tolist())
        if p < h.threshold:
            return Verdict(False, p, similarity, f"model {head}: {p:.3f} < {h.threshold:.3f}")
        why = hard_conflict(a, b)
        if why is not None:
            return Verdict(False, p, similarity, f"guard: {why}")
        return Verdict(True, p, similarity, f"model {head}")

    # ---- persistence -------------------------------------------------------------------------------

    def save(self, out_dir: str | Path) -> None:
        """Write ``merge_weights.npz`` (arrays) and ``merge_model.json`` (everything else), atomically.

        Both are made in memory, written to temporary files in ``out_dir`` and renamed over the old
        ones, ``merge_model.json`` (the file :func:`read_decision` opens and checks first) last: a
        failure before the renames leaves the old weights as they were, and no file is ever seen
        half-written (docs/architecture.md, "Semantic dedup")."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        arrays: dict[str, np.ndarray] = {"idf": self.idf.values.astype(np.float16)}
        heads: dict[str, Any] = {}
        for name, h in self.heads.items():
            arrays[f"{name}_mean"] = h.mean.astype(np.float32)
            arrays[f"{name}_scale"] = h.scale.astype(np.float32)
            for i, (w, b) in enumerate(h.layers):
                arrays[f"{name}_w{i}"] = w.astype(np.float32)
                arrays[f"{name}_b{i}"] = b.astype(np.float32)
            heads[name] = {
                "layers": len(h.layers),
                "calibration": list(h.calibration),
                "threshold": h.threshold,
                "cosine_floor": h.cosine_floor,
            }
        doc = {
            "format": FORMAT_VERSION,
            "features": list(FEATURES),
            "idf_bits": IDF_BITS,
            "idf_documents": self.idf.documents,
            "heads": heads,
            "meta": self.meta,
        }
        text = json.dumps(doc, indent=1, sort_keys=True) + "\n"
        replace_files([(out / WEIGHTS_FILE, npz_bytes(arrays)), (out / MODEL_FILE, text.encode("utf-8"))])


FORMAT_VERSION = 1
WEIGHTS_FILE = "merge_weights.npz"
MODEL_FILE = "merge_model.json"


def default_data_dir() -> Path:
    """``pipeline/merge_data`` of the installed package: where the shipped weights are (beside this
    module, so the pipeline's core reads them without importing ``models``)."""
    return Path(__file__).resolve().parent / "merge_data"


def read_decision(data_dir: str | Path) -> LearnedDecision:
    """Load weights written by :meth:`LearnedDecision.save` (no caching)."""
    folder = Path(data_dir)
    try:
        doc = json.loads((folder / MODEL_FILE).read_text(encoding="utf-8"))
        with np.load(folder / WEIGHTS_FILE, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
    except (OSError, ValueError) as exc:
        raise DecisionLoadError(f"cannot read the merge decision in {folder}: {exc}") from exc
    if doc.get("format") != FORMAT_VERSION or tuple(doc.get("features", ())) != FEATURES:
        raise DecisionLoadError(
            f"{folder / MODEL_FILE}: format {doc.get('format')} with features {doc.get('features')}; "
            f"this code reads format {FORMAT_VERSION} with {list(FEATURES)}: retrain (surge dedup train)"
        )
    heads = {}
    for name, h in doc["heads"].items():
        layers = tuple((arrays[f"{name}_w{i}"], arrays[f"{name}_b{i}"]) for i in range(int(h["layers"])))
        heads[name] = Head(
            mean=arrays[f"{name}_mean"],
            scale=arrays[f"{name}_scale"],
            layers=layers,
            calibration=(float(h["calibration"][0]), float(h["calibration"][1])),
            threshold=float(h["threshold"]),
            cosine_floor=float(h.get("cosine_floor", 0.0)),
        )
    idf = IdfTable(arrays["idf"].astype(np.float32), int(doc["idf_documents"]))
    return LearnedDecision(heads, idf, doc.get("meta", {}))


@lru_cache(maxsize=4)
def load_decision(data_dir: str | None = None, cosine_fallback: float | None = None) -> LearnedDecision:
    """The learned decision from ``data_dir`` (default: the shipped weights), one per process."""
    decision = read_decision(data_dir or default_data_dir())
    return decision.with_cosine_fallback(cosine_fallback) if cosine_fallback is not None else decision


def decision_from_settings(settings: Any) -> MergeDecision:
    """The decision a worker uses: ``merge_decision`` (``learned`` or ``threshold``), the learned
    weights from ``merge_data_dir`` (default: shipped), and ``semantic_threshold`` for the plain rule.

    With a custom embedder (``embedder_path``) the English head's cosines mean something else, so
    embedded pairs fall back to the plain threshold; Chinese pairs keep the character head.
    """
    kind = getattr(settings, "merge_decision", "learned")
    threshold = float(settings.semantic_threshold)
    if kind == "threshold":
        return ThresholdDecision(threshold)
    fallback = threshold if getattr(settings, "embedder_path", None) else None
    return load_decision(getattr(settings, "merge_data_dir", None), fallback)
