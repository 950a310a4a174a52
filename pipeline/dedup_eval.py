"""Measure semantic dedup on labelled pairs and choose its threshold.

``surge dedup eval --pairs CSV`` calls :func:`run_dedup_eval`. The pairs are STS-B style (no header:
``sentence1,sentence2,score`` with a score of 0-5): pairs scored 4.5 or more are paraphrases that
should merge, pairs under 3 are different requests that must not. A pair "merges" under exactly the
rule :func:`pipeline.dedup.cluster` applies (:func:`pipeline.dedup.would_merge`).

:func:`intent_wrong_merge_rate` measures wrong merges on intent-labelled rows (banking77 style):
merged pairs whose intents differ.

Data sets are read only from paths given by the caller; nothing here ships their sentences.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.dedup import cluster, is_embeddable, normalize
from pipeline.exceptions import SurgeError
from pipeline.guard import guard_allows

EmbedFn = Callable[[Sequence[str]], np.ndarray]

#: Score bands of STS-B used by the report.
PARAPHRASE_MIN_SCORE = 4.5
DIFFERENT_BELOW_SCORE = 3.0
NOT_SAME_BELOW_SCORE = 4.0


class PairsFormatError(SurgeError):
    """A pairs file row is not ``sentence1,sentence2,score``."""

    def __init__(self, path: str, line: int, detail: str) -> None:
        super().__init__(f"{path}, line {line}: {detail}; expected sentence1,sentence2,score (0-5)")
        self.path = path
        self.line = line


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
    """Read an STS-B style pairs file (no header); sentences may contain quoted commas."""
    pairs: list[tuple[str, str, float]] = []
    with open(csv_path, newline="", encoding="utf-8") as fh:
        for line, row in enumerate(csv.reader(fh), start=1):
            if not row or all(not cell.strip() for cell in row):
                continue
            if len(row) != 3:
                raise PairsFormatError(str(csv_path), line, f"{len(row)} fields")
            try:
                score = float(row[2])
            except ValueError:
                raise PairsFormatError(str(csv_path), line, f"score {row[2]!r} is not a number") from None
            if not 0.0 <= score <= 5.0:
                raise PairsFormatError(str(csv_path), line, f"score {score} outside 0-5")
            pairs.append((row[0], row[1], score))
    return pairs


def _embed_unique(texts: Sequence[str], embed: EmbedFn) -> dict[str, np.ndarray]:
    unique = list(dict.fromkeys(texts))
    vectors = np.asarray(embed(unique), dtype=np.float32) if unique else np.zeros((0, 1), np.float32)
    norms = np.linalg.norm(vectors, axis=1, keepdims=True)
    vectors = vectors / np.where(norms > 0, norms, 1.0)
    return dict(zip(unique, vectors, strict=True))


def _rate(hits: np.ndarray, mask: np.ndarray) -> float:
    total = int(mask.sum())
    return float(hits[mask].sum()) / total if total else 0.0


def evaluate_pairs(
    pairs: Sequence[tuple[str, str, float]],
    embed: EmbedFn,
    thresholds: Sequence[float],
    multilingual: bool = False,
) -> dict[str, Any]:
    """Merge and wrong-merge rates per threshold, with and without the lexical guard.

    ``merge_rate_paraphrase``: share of pairs scored >= 4.5 that merge; ``wrong_merge_rate_below_3``
    and ``wrong_merge_rate_below_4``: share of pairs scored < 3 (< 4) that merge.
    """
    vectors = _embed_unique([t for a, b, _ in pairs for t in (a, b)], embed)
    scores = np.array([s for _, _, s in pairs], dtype=np.float64)
    sims = np.array([float(vectors[a] @ vectors[b]) for a, b, _ in pairs], dtype=np.float64)
    exact = np.array([normalize(a) == normalize(b) for a, b, _ in pairs], dtype=bool)
    embeddable = np.array(
        [is_embeddable(a, multilingual) and is_embeddable(b, multilingual) for a, b, _ in pairs], dtype=bool
    )
    allowed = np.array([guard_allows(a, b)[0] for a, b, _ in pairs], dtype=bool)
    para = scores >= PARAPHRASE_MIN_SCORE
    below3 = scores < DIFFERENT_BELOW_SCORE
    below4 = scores < NOT_SAME_BELOW_SCORE

    rows: list[dict[str, float]] = []
    for t in thresholds:
        close = embeddable & (sims >= t)
        merged = exact | (close & allowed)
        unguarded = exact | close
        rows.append(
            {
                "threshold": round(float(t), 4),
                "merge_rate_paraphrase": _rate(merged, para),
                "wrong_merge_rate_below_3": _rate(merged, below3),
                "wrong_merge_rate_below_4": _rate(merged, below4),
                "wrong_merges_below_3": int(merged[below3].sum()),
                "unguarded_merge_rate_paraphrase": _rate(unguarded, para),
                "unguarded_wrong_merge_rate_below_3": _rate(unguarded, below3),
                "unguarded_wrong_merge_rate_below_4": _rate(unguarded, below4),
            }
        )
    return {
        "pairs": len(pairs),
        "paraphrase_pairs": int(para.sum()),
        "pairs_below_3": int(below3.sum()),
        "pairs_below_4": int(below4.sum()),
        "multilingual": multilingual,
        "embeddable_share": float(embeddable.mean()) if len(pairs) else 0.0,
        "exact_match_rate_paraphrase": _rate(exact, para),
        "guard_veto_rate_paraphrase": _rate(~allowed, para),
        "guard_veto_rate_below_3": _rate(~allowed, below3),
        "thresholds": rows,
    }


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
) -> dict[str, Any]:
    """Wrong merges on intent-labelled ``(text, intent)`` rows at ``threshold``.

    Pairwise: over all pairs of rows that would merge (exact normalised match, or similarity >=
    threshold and the guard allows), the share whose intents differ. Clustered: the rows fed to
    :func:`cluster` in order, the share of followers whose intent differs from their leader's.
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
    close = (sims[iu, ju] >= threshold) & embeddable[iu] & embeddable[ju]
    exact = np.array([norms[i] == norms[j] for i, j in zip(iu, ju, strict=True)], dtype=bool)
    candidate = close | exact
    merged = 0
    wrong = 0
    vetoed = 0
    wrong_unguarded = 0
    for i, j in zip(iu[candidate], ju[candidate], strict=True):
        differ = intents[i] != intents[j]
        wrong_unguarded += int(differ)
        if norms[i] == norms[j] or guard_allows(texts[i], texts[j])[0]:
            merged += 1
            wrong += int(differ)
        else:
            vetoed += 1
    assignments = cluster(vecs, texts, ["s"] * n, threshold, multilingual=multilingual)
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
    """A small text table of :func:`evaluate_pairs`' result."""
    lines = [
        f"{result['pairs']} pairs: {result['paraphrase_pairs']} scored >= 4.5, "
        f"{result['pairs_below_3']} < 3, {result['pairs_below_4']} < 4; "
        f"embeddable {result['embeddable_share']:.1%}, multilingual={result['multilingual']}",
        "threshold  merge>=4.5  wrong<3  wrong<4  | no guard: merge>=4.5  wrong<3  wrong<4",
    ]
    for r in result["thresholds"]:
        lines.append(
            f"{r['threshold']:9.2f}  {r['merge_rate_paraphrase']:10.1%}  "
            f"{r['wrong_merge_rate_below_3']:7.2%}  {r['wrong_merge_rate_below_4']:7.2%}  |           "
            f"{r['unguarded_merge_rate_paraphrase']:10.1%}  {r['unguarded_wrong_merge_rate_below_3']:7.2%}  "
            f"{r['unguarded_wrong_merge_rate_below_4']:7.2%}"
        )
    return "\n".join(lines)


def run_dedup_eval(
    csv_path: str | Path,
    thresholds: Sequence[float],
    json_out: str | Path | None = None,
    embedder_path: str | None = None,
    max_wrong_below_3: float = 0.01,
) -> dict[str, Any]:
    """Evaluate a pairs file with the real embedder, print a table, choose a threshold, write JSON.

    Called by ``surge dedup eval --pairs CSV``. ``chosen_threshold`` is None when no threshold keeps
    the wrong-merge rate under ``max_wrong_below_3`` (``choose_error`` then says why).
    """
    from models.embedder import shared_embedder

    embedder = shared_embedder(embedder_path)
    pairs = load_pairs(csv_path)
    result = evaluate_pairs(pairs, embedder.embed, thresholds, multilingual=embedder.multilingual)
    result["pairs_file"] = str(csv_path)
    result["embedder"] = embedder.path
    try:
        result["chosen_threshold"] = choose_threshold(result, max_wrong_below_3)
    except NoThresholdError as exc:
        result["chosen_threshold"] = None
        result["choose_error"] = exc.message
    result["max_wrong_below_3"] = max_wrong_below_3
    print(format_table(result))
    print(
        f"chosen threshold: {result['chosen_threshold']} "
        f"(wrong-merge rate of pairs < 3 at most {max_wrong_below_3:.1%})"
    )
    if json_out is not None:
        Path(json_out).write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    return result


def parse_thresholds(spec: str) -> list[float]:
    """``"0.80:0.95:0.01"`` (start:stop:step, stop included) or ``"0.85,0.9"``."""
    if ":" in spec:
        start, stop, step = (float(x) for x in spec.split(":"))
        if step <= 0 or stop < start:
            raise ValueError(f"thresholds {spec!r}: need start <= stop and step > 0")
        count = round((stop - start) / step) + 1
        return [round(start + i * step, 6) for i in range(count)]
    return [float(x) for x in spec.split(",") if x.strip()]


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m pipeline.dedup_eval --pairs CSV`` (what ``surge dedup eval`` wraps)."""
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
