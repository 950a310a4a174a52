"""Measure semantic dedup on labelled pairs: the learned decision beside plain cosine thresholds.

``surge dedup eval --pairs CSV`` calls :func:`run_dedup_eval` (see docs/architecture.md,
"Semantic dedup"). The pairs are STS-B style (no header: ``sentence1,sentence2,score`` with a score of 0-5):
pairs scored 4.5 or more are paraphrases that should merge, pairs under 3 are different requests
that must not. A pair "merges" when :class:`pipeline.merge.MergeRegistry` (what live merging runs),
holding the first text as an open leader, lets the second join it: with the learned decision
(:mod:`pipeline.pairs`) and with :class:`pipeline.pairs.ThresholdDecision` at each threshold. Rates
are reported per language (``en``, ``zh``) as well as overall.

:func:`intent_wrong_merge_rate` measures wrong merges on intent-labelled rows (banking77 style):
merged pairs whose intents differ. :func:`decision_overhead` times the decision against embedding.

Data sets are read only from paths given by the caller; nothing here ships their sentences.
"""

from __future__ import annotations

import csv
import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.dedup import cluster, is_embeddable, normalize
from pipeline.exceptions import SurgeError
from pipeline.guard import guard_allows
from pipeline.merge import MergeRegistry
from pipeline.pairs import MergeDecision, ThresholdDecision, language

EmbedFn = Callable[[Sequence[str]], np.ndarray]

#: Score bands of STS-B used by the report.
PARAPHRASE_MIN_SCORE = 4.5
DIFFERENT_BELOW_SCORE = 3.0
NOT_SAME_BELOW_SCORE = 4.0


class PairsFileError(SurgeError):
    """A pairs file that cannot be used: missing or unreadable, not UTF-8, not CSV, a bad row
    (:class:`PairsFormatError`) or no pairs at all. Raised before the embedder loads."""

    def __init__(self, path: str | Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = str(path)


class PairsFormatError(PairsFileError):
    """A pairs file row is not ``sentence1,sentence2,score``."""

    def __init__(self, path: str | Path, line: int, detail: str) -> None:
        super().__init__(path, f"line {line}: {detail}; expected sentence1,sentence2,score (0-5)")
        self.line = line


class ThresholdsError(SurgeError):
    """A ``--thresholds`` value that names no usable list of cosine thresholds (each 0-1)."""

    def __init__(self, spec: str, problem: str) -> None:
        super().__init__(f"thresholds {spec!r}: {problem}; expected start:stop:step or a,b,c within 0-1")
        self.spec = spec


class OutputPathError(SurgeError):
    """A file or folder a command was asked to write cannot be written there. Raised before any
    model loads or any work is done, so that a long run does not end in a traceback."""

    def __init__(self, path: str | Path, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = str(path)


class NoThresholdError(SurgeError):
    """No threshold kept the wrong-merge rate of different pairs under the limit."""

    def __init__(self, limit: float, lowest: float, at_threshold: float) -> None:
        super().__init__(
            f"no threshold keeps the wrong-merge rate under {limit:.2%}: the lowest is {lowest:.2%} "
            f"at {at_threshold:.2f}; try higher thresholds"
        )
        self.limit = limit
        self.lowest = lowest
        self.at_threshold = at_threshold


def load_pairs(csv_path: str | Path) -> list[tuple[str, str, float]]:
    """Read an STS-B style pairs file (no header); sentences may contain quoted commas.

    :class:`PairsFileError` for a file that is missing or unreadable, not UTF-8, not CSV, with a bad
    row (:class:`PairsFormatError`, with its line) or without any pair."""
    try:
        with open(csv_path, newline="", encoding="utf-8") as fh:
            pairs = [
                _pair(csv_path, line, row)
                for line, row in enumerate(csv.reader(fh), start=1)
                if row and any(cell.strip() for cell in row)
            ]
    except OSError as exc:
        raise PairsFileError(csv_path, f"cannot be read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise PairsFileError(csv_path, f"is not UTF-8 ({exc.reason} at byte {exc.start})") from exc
    except csv.Error as exc:
        raise PairsFileError(csv_path, f"is not a CSV file: {exc}") from exc
    if not pairs:
        raise PairsFileError(csv_path, "holds no pairs; expected rows sentence1,sentence2,score (0-5)")
    return pairs


def _pair(csv_path: str | Path, line: int, row: list[str]) -> tuple[str, str, float]:
    if len(row) != 3:
        raise PairsFormatError(csv_path, line, f"{len(row)} fields")
    try:
        score = float(row[2])
    except ValueError:
        raise PairsFormatError(csv_path, line, f"score {row[2]!r} is not a number") from None
    if not 0.0 <= score <= 5.0:
        raise PairsFormatError(csv_path, line, f"score {score} outside 0-5")
    return row[0], row[1], score


def writable_path(path: str | Path, folder: bool = False) -> Path:
    """``path``, once it is known that a file (``folder``: a folder) can be written there: it is not
    the other kind, and its nearest existing ancestor is a folder this process may write in. Nothing
    is created; :class:`OutputPathError` otherwise. Called before a model loads."""
    out = Path(path)
    if out.exists() and out.is_dir() != folder:
        kind = "a folder" if out.is_dir() else "a file"
        raise OutputPathError(out, f"is {kind}; expected {'a folder' if folder else 'a file'} to write")
    ancestor = next(p for p in (out.parent, *out.parent.parents) if p.exists())
    if not ancestor.is_dir():
        raise OutputPathError(out, f"cannot be made: {ancestor} is a file")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        raise OutputPathError(out, f"cannot be written: {ancestor} is not writable")
    return out


def _embed_unique(texts: Sequence[str], embed: EmbedFn) -> dict[str, np.ndarray]:
    unique = list(dict.fromkeys(texts))
    vectors = np.asarray(embed(unique), dtype=np.float32) if unique else np.zeros((0, 1), np.float32)
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    units = vectors / np.where(norms > 0, norms, 1.0)
    return dict(zip(unique, units, strict=True))


def _rate(hits: np.ndarray, mask: np.ndarray) -> float:
    total = int(mask.sum())
    return float(hits[mask].sum()) / total if total else 0.0


def registry_merges(
    decision: MergeDecision, a: str, va: np.ndarray | None, b: str, vb: np.ndarray | None
) -> bool:
    """Whether ``b`` joins ``a`` held as an open leader in a :class:`MergeRegistry` with ``decision``."""
    registry = MergeRegistry(decision=decision)
    registry.open("a", "scope", a, va, 0)
    return registry.find("scope", b, vb, 0) is not None


def _pair_language(a: str, b: str) -> str:
    la, lb = language(a), language(b)
    return la if la == lb else "mixed"


def _rates(merged: np.ndarray, scores: np.ndarray) -> dict[str, float]:
    para, below3, below4 = (
        scores >= PARAPHRASE_MIN_SCORE,
        scores < DIFFERENT_BELOW_SCORE,
        scores < NOT_SAME_BELOW_SCORE,
    )
    return {
        "merge_rate_paraphrase": _rate(merged, para),
        "wrong_merge_rate_below_3": _rate(merged, below3),
        "wrong_merge_rate_below_4": _rate(merged, below4),
        "wrong_merges_below_3": int(merged[below3].sum()),
        "wrong_merges_below_4": int(merged[below4].sum()),
    }


def evaluate_pairs(
    pairs: Sequence[tuple[str, str, float]],
    embed: EmbedFn,
    thresholds: Sequence[float],
    multilingual: bool = False,
    decision: MergeDecision | None = None,
) -> dict[str, Any]:
    """Merge and wrong-merge rates per threshold (with and without the lexical guard) and, given a
    ``decision``, of that decision; overall and per language (``by_language``).

    ``merge_rate_paraphrase``: share of pairs scored >= 4.5 that merge; ``wrong_merge_rate_below_3``
    and ``wrong_merge_rate_below_4``: share of pairs scored < 3 (< 4) that merge. Texts the embedder
    does not read get no vector, as in a worker.
    """
    texts = [t for a, b, _ in pairs for t in (a, b)]
    readable = [t for t in dict.fromkeys(texts) if is_embeddable(t, multilingual)]
    vectors = _embed_unique(readable, embed) if readable else {}
    scores = np.array([s for _, _, s in pairs], dtype=np.float64)
    sims = np.array(
        [float(vectors[a] @ vectors[b]) if a in vectors and b in vectors else 0.0 for a, b, _ in pairs],
        dtype=np.float64,
    )
    exact = np.array([normalize(a) == normalize(b) for a, b, _ in pairs], dtype=bool)
    embeddable = np.array([a in vectors and b in vectors for a, b, _ in pairs], dtype=bool)
    allowed = np.array([guard_allows(a, b)[0] for a, b, _ in pairs], dtype=bool)
    langs = np.array([_pair_language(a, b) for a, b, _ in pairs])
    para = scores >= PARAPHRASE_MIN_SCORE
    below3 = scores < DIFFERENT_BELOW_SCORE

    def merged_by(dec: MergeDecision) -> np.ndarray:
        return np.array(
            [registry_merges(dec, a, vectors.get(a), b, vectors.get(b)) for a, b, _ in pairs], dtype=bool
        )

    per_threshold = {round(float(t), 4): merged_by(ThresholdDecision(float(t))) for t in thresholds}
    learned = merged_by(decision) if decision is not None else None

    def report(mask: np.ndarray) -> dict[str, Any]:
        rows: list[dict[str, float]] = []
        for t, merged in per_threshold.items():
            unguarded = exact | (embeddable & (sims >= t))
            row: dict[str, Any] = {"threshold": t, **_rates(merged[mask], scores[mask])}
            row.update(
                {
                    f"unguarded_{k}": v
                    for k, v in _rates(unguarded[mask], scores[mask]).items()
                    if not k.startswith("wrong_merges")
                }
            )
            rows.append(row)
        out: dict[str, Any] = {
            "pairs": int(mask.sum()),
            "paraphrase_pairs": int((para & mask).sum()),
            "pairs_below_3": int((below3 & mask).sum()),
            "pairs_below_4": int(((scores < NOT_SAME_BELOW_SCORE) & mask).sum()),
            "embeddable_share": float(embeddable[mask].mean()) if mask.any() else 0.0,
            "exact_match_rate_paraphrase": _rate(exact[mask], para[mask]),
            "guard_veto_rate_paraphrase": _rate(~allowed[mask], para[mask]),
            "guard_veto_rate_below_3": _rate(~allowed[mask], below3[mask]),
            "thresholds": rows,
        }
        if learned is not None:
            out["learned"] = _rates(learned[mask], scores[mask])
        return out

    result = report(np.ones(len(pairs), dtype=bool))
    result["multilingual"] = multilingual
    result["decision"] = decision.name if decision is not None else None
    result["by_language"] = {str(lang): report(langs == lang) for lang in sorted(set(langs.tolist()))}
    return result


def choose_threshold(result: dict[str, Any], max_wrong_below_3: float = 0.01) -> float:
    """The threshold with the highest paraphrase merge rate whose wrong-merge rate on pairs scored
    under 3 is at most ``max_wrong_below_3``; on a tie, the higher (safer) threshold."""
    rows = result["thresholds"]
    ok = [r for r in rows if r["wrong_merge_rate_below_3"] <= max_wrong_below_3]
    if not ok:
        lowest = min(rows, key=lambda r: (r["wrong_merge_rate_below_3"], -r["threshold"]))
        raise NoThresholdError(max_wrong_below_3, lowest["wrong_merge_rate_below_3"], lowest["threshold"])
    best = max(ok, key=lambda r: (r["merge_rate_paraphrase"], r["threshold"]))
    return float(best["threshold"])


def intent_wrong_merge_rate(
    rows: Sequence[tuple[str, str]],
    embed: EmbedFn,
    threshold: float,
    multilingual: bool = False,
    decision: MergeDecision | None = None,
) -> dict[str, Any]:
    """Wrong merges on intent-labelled ``(text, intent)`` rows at ``threshold``, or of ``decision``.

    Pairwise: over all pairs of rows that would merge (exact normalised match, or similarity >=
    threshold and the guard allows; or the decision allows), the share whose intents differ.
    Clustered: the rows fed to :func:`cluster` in order, the share of followers whose intent differs
    from their leader's.
    """
    texts = [t for t, _ in rows]
    intents = np.array([i for _, i in rows])
    by_text = _embed_unique(texts, embed)
    vecs = np.stack([by_text[t] for t in texts]) if texts else np.zeros((0, 1), np.float32)
    sims = vecs @ vecs.T
    n = len(texts)
    iu, ju = np.triu_indices(n, k=1)
    embeddable = np.array([is_embeddable(t, multilingual) for t in texts], dtype=bool)
    norms = [normalize(t) for t in texts]
    floor = decision.cosine_floor if decision is not None else threshold
    close = (sims[iu, ju] >= floor) & embeddable[iu] & embeddable[ju]
    exact = np.array([norms[i] == norms[j] for i, j in zip(iu, ju, strict=True)], dtype=bool)
    candidate = close | exact
    merged = 0
    wrong = 0
    vetoed = 0
    wrong_unguarded = 0
    for i, j in zip(iu[candidate], ju[candidate], strict=True):
        differ = intents[i] != intents[j]
        wrong_unguarded += int(differ)
        if decision is not None:
            ok = decision.decide(texts[i], texts[j], float(sims[i, j])).merge
        else:
            ok = norms[i] == norms[j] or guard_allows(texts[i], texts[j])[0]
        if ok:
            merged += 1
            wrong += int(differ)
        else:
            vetoed += 1
    assignments = cluster(vecs, texts, ["s"] * n, threshold, multilingual=multilingual, decision=decision)
    followers = [a for a in assignments if not a.is_leader]
    wrong_followers = sum(1 for a in followers if intents[a.index] != intents[int(a.leader_id)])
    unguarded_total = int(candidate.sum())
    return {
        "rows": n,
        "threshold": threshold,
        "merged_pairs": merged,
        "wrong_pairs": wrong,
        "wrong_pair_rate": wrong / merged if merged else 0.0,
        "guard_vetoed_pairs": vetoed,
        "unguarded_merged_pairs": unguarded_total,
        "unguarded_wrong_pair_rate": wrong_unguarded / unguarded_total if unguarded_total else 0.0,
        "followers": len(followers),
        "follower_share": len(followers) / n if n else 0.0,
        "wrong_followers": wrong_followers,
        "wrong_follower_rate": wrong_followers / len(followers) if followers else 0.0,
    }


def format_table(result: dict[str, Any]) -> str:
    """A small text table of :func:`evaluate_pairs`' result: per language, the learned decision
    (when evaluated) and each threshold."""
    lines: list[str] = []
    for lang, part in result.get("by_language", {"all": result}).items():
        lines.append(
            f"[{lang}] {part['pairs']} pairs: {part['paraphrase_pairs']} scored >= 4.5, "
            f"{part['pairs_below_3']} < 3, {part['pairs_below_4']} < 4; embeddable {part['embeddable_share']:.1%}"
        )
        if part["pairs"] < 20:  # a handful of pairs mixing languages: no table
            continue
        lines.append(
            "  rule              merge>=4.5  wrong<3  wrong<4  | no guard: merge>=4.5  wrong<3  wrong<4"
        )
        if "learned" in part:
            r = part["learned"]
            lines.append(
                f"  learned decision  {r['merge_rate_paraphrase']:10.1%}  {r['wrong_merge_rate_below_3']:7.2%}  "
                f"{r['wrong_merge_rate_below_4']:7.2%}  |"
            )
        for r in part["thresholds"]:
            lines.append(
                f"  cosine >= {r['threshold']:5.2f}   {r['merge_rate_paraphrase']:10.1%}  "
                f"{r['wrong_merge_rate_below_3']:7.2%}  {r['wrong_merge_rate_below_4']:7.2%}  |           "
                f"{r['unguarded_merge_rate_paraphrase']:10.1%}  {r['unguarded_wrong_merge_rate_below_3']:7.2%}  "
                f"{r['unguarded_wrong_merge_rate_below_4']:7.2%}"
            )
    return "\n".join(lines)


def decision_overhead(
    embed: EmbedFn, decision: MergeDecision, texts: Sequence[str], candidates: int = 8, rounds: int = 3
) -> dict[str, float]:
    """Per-request cost of the decision against the embedding stage's, in milliseconds.

    Embedding: batches of 32 of ``texts`` (best of ``rounds``), divided by 32. Decision: each of 32
    new texts (nothing about it cached yet, as for a new request) decided against ``candidates``
    leaders whose profiles are warm, with a cosine above the floor (the pairs that reach the
    classifier; those under the floor stop at one comparison).
    """
    import time

    batch = list(texts[:32])
    leaders = list(texts[32 : 32 + candidates])
    if len(batch) < 32 or len(leaders) < candidates:
        raise ValueError(f"decision_overhead needs {32 + candidates} texts, got {len(texts)}")
    embed(batch)  # warm up
    embed_s = min(_timed(time.perf_counter, lambda: embed(batch)) for _ in range(rounds))
    cos = max(decision.cosine_floor, 0.0) + 0.01
    for leader in leaders:
        decision.decide(leader, leaders[0], cos)
    from pipeline import guard

    fresh = getattr(decision, "profile", None)
    decide_s = []
    for _ in range(rounds):
        # a new request's text has not been read yet: its profile, guard features and normal form
        for cached in (fresh, guard.features, normalize):
            if cached is not None:
                cached.cache_clear()
        for leader in leaders:
            decision.decide(leader, leaders[0], cos)

        def run() -> None:
            for text in batch:
                for leader in leaders:
                    decision.decide(leader, text, cos)

        decide_s.append(_timed(time.perf_counter, run))
    embed_ms = embed_s * 1000 / 32
    decide_ms = min(decide_s) * 1000 / 32
    return {
        "embed_ms_per_request": round(embed_ms, 3),
        "decision_ms_per_request": round(decide_ms, 3),
        "candidates_per_request": candidates,
        "decision_ms_per_pair": round(decide_ms / candidates, 4),
        "overhead_share": round(decide_ms / embed_ms, 4) if embed_ms > 0 else 0.0,
    }


def _timed(clock: Callable[[], float], fn: Callable[[], object]) -> float:
    start = clock()
    fn()
    return clock() - start


def run_dedup_eval(
    csv_path: str | Path,
    thresholds: Sequence[float],
    json_out: str | Path | None = None,
    embedder_path: str | None = None,
    max_wrong_below_3: float = 0.01,
    decision: MergeDecision | None = None,
    overhead: bool = True,
) -> dict[str, Any]:
    """Evaluate a pairs file with the real embedder: the decision (default: the shipped learned one)
    beside each threshold, per language; print a table, choose a threshold, write JSON.

    Called by ``surge dedup eval --pairs CSV``. ``chosen_threshold`` is None when no threshold keeps
    the wrong-merge rate under ``max_wrong_below_3`` (``choose_error`` then says why). The pairs, the
    thresholds and the output path are checked before the embedder loads (it takes seconds):
    :class:`PairsFileError`, :class:`ThresholdsError`, :class:`OutputPathError`.
    """
    pairs = load_pairs(csv_path)
    if not thresholds:
        raise ThresholdsError("", "no threshold")
    outputs = _eval_outputs(json_out)
    from models.embedder import shared_embedder
    from pipeline.pairs import load_decision

    embedder = shared_embedder(embedder_path)
    if decision is None:
        decision = load_decision(None, min(thresholds) if embedder_path else None)
    result = evaluate_pairs(pairs, embedder.embed, thresholds, embedder.multilingual, decision)
    result["pairs_file"] = str(csv_path)
    result["embedder"] = embedder.path
    try:
        result["chosen_threshold"] = choose_threshold(result, max_wrong_below_3)
    except NoThresholdError as exc:
        result["chosen_threshold"] = None
        result["choose_error"] = exc.message
    result["max_wrong_below_3"] = max_wrong_below_3
    english = [t for a, b, _ in pairs for t in (a, b) if language(t) == "en"]
    if overhead and len(set(english)) >= 48:
        result["overhead"] = decision_overhead(embedder.embed, decision, list(dict.fromkeys(english)))
    print(format_table(result))
    print(
        f"chosen threshold: {result['chosen_threshold']} "
        f"(wrong-merge rate of pairs < 3 at most {max_wrong_below_3:.1%})"
    )
    if "overhead" in result:
        o = result["overhead"]
        print(
            f"decision cost: {o['decision_ms_per_request']:.3f} ms per request for {o['candidates_per_request']} "
            f"candidates vs embedding {o['embed_ms_per_request']:.3f} ms per request (batch 32): "
            f"{o['overhead_share']:.1%}"
        )
    if outputs is not None:
        json_path, png_path = outputs
        json_path.write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        plot_eval(result, png_path)
    return result


def _eval_outputs(json_out: str | Path | None) -> tuple[Path, Path] | None:
    """The JSON result's path and the plot's beside it, both checked as writable (and the JSON's
    folder made, as it will be needed)."""
    if json_out is None:
        return None
    json_path = writable_path(json_out)
    png_path = writable_path(json_path.with_suffix(".png"))
    try:
        json_path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise OutputPathError(json_path, f"its folder cannot be made: {exc.strerror or exc}") from exc
    return json_path, png_path


def plot_eval(result: dict[str, Any], path: Path) -> None:
    """Per language: paraphrases merged against pairs < 4 merged, each threshold and the decision."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    parts = {k: v for k, v in result.get("by_language", {}).items() if k in ("en", "zh")}
    fig, axes = plt.subplots(1, max(1, len(parts)), figsize=(6 * max(1, len(parts)), 4.5), squeeze=False)
    for ax, (lang, part) in zip(axes[0], parts.items(), strict=False):
        rows = part["thresholds"]
        ax.plot(
            [r["wrong_merge_rate_below_4"] * 100 for r in rows],
            [r["merge_rate_paraphrase"] * 100 for r in rows],
            marker=".",
            label="cosine threshold + guard",
        )
        if "learned" in part:
            r = part["learned"]
            ax.scatter(
                [r["wrong_merge_rate_below_4"] * 100],
                [r["merge_rate_paraphrase"] * 100],
                color="red",
                zorder=3,
                label="learned decision",
            )
        ax.set_title(f"{lang}: {part['pairs']} pairs ({Path(result.get('pairs_file', '')).name})")
        ax.set_xlabel("pairs scored < 4 merged, %")
        ax.set_ylabel("paraphrases (>= 4.5) merged, %")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


#: the most thresholds one evaluation measures (0-1 in steps of 0.001)
MAX_THRESHOLDS = 1001


def parse_thresholds(spec: str) -> list[float]:
    """``"0.80:0.95:0.01"`` (start:stop:step, stop included) or ``"0.85,0.9"``; each within 0-1.

    :class:`ThresholdsError` for anything else (a reversed range, a step of 0, a word, too many)."""
    if ":" in spec:
        parts = spec.split(":")
        if len(parts) != 3:
            raise ThresholdsError(spec, f"a range has 3 parts, not {len(parts)}")
        start, stop, step = (_number(spec, x) for x in parts)
        if step <= 0 or stop < start:
            raise ThresholdsError(spec, "a range needs start <= stop and step > 0")
        if not 0.0 <= start <= stop <= 1.0:
            raise ThresholdsError(spec, "a range lies within 0-1")
        count = round((stop - start) / step) + 1
        if count > MAX_THRESHOLDS:
            raise ThresholdsError(spec, f"{count} thresholds, more than {MAX_THRESHOLDS}")
        values = [round(start + i * step, 6) for i in range(count)]
    else:
        values = [_number(spec, x) for x in spec.split(",") if x.strip()]
    if not values:
        raise ThresholdsError(spec, "no threshold")
    outside = [v for v in values if not 0.0 <= v <= 1.0]
    if outside:
        raise ThresholdsError(spec, f"{outside[0]} is outside 0-1")
    return values


def _number(spec: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise ThresholdsError(spec, f"{text.strip()!r} is not a number")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pipeline.devtools.dedup_eval --pairs CSV`` (what ``surge dedup eval`` wraps)."""
    import argparse

    parser = argparse.ArgumentParser(description="Measure semantic dedup on STS-B style pairs.")
    parser.add_argument("--pairs", required=True, help="sentence1,sentence2,score CSV without a header")
    parser.add_argument("--thresholds", default="0.80:0.95:0.01", help="start:stop:step or a,b,c")
    parser.add_argument("--json", dest="json_out", default=None, help="write the result here")
    parser.add_argument("--embedder", default=None, help="sentence-transformers model folder")
    parser.add_argument("--max-wrong-below-3", type=float, default=0.01)
    args = parser.parse_args(argv)
    run_dedup_eval(
        args.pairs, parse_thresholds(args.thresholds), args.json_out, args.embedder, args.max_wrong_below_3
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
