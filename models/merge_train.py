"""Training of the learned merge decision (``surge dedup train``); see docs/architecture.md.

Called by hand or by the CLI, never by a worker. The data (STS-B ``{en,zh}-{train,dev}.csv`` and the
banking77 ``train.csv``) are passed in as a folder and are not shipped: only the weights and a hashed
idf table (numbers, no text) derived from them are, in ``pipeline/merge_data`` (``.npz`` + ``.json``).

Per language, a logistic regression over the pair features of :mod:`pipeline.pairs`:

* English: STS-B ``en-train`` pairs (scored >= 4.5: same meaning; < 4: not; 4-4.5 left out), plus
  banking77 pairs from the training part of :func:`models.faq_train.split_banking77` (the held-out
  part is the merging benchmark's workload): each question with its 5 nearest neighbours by MiniLM
  cosine, same intent and cosine >= 0.9 as same meaning, different intent and cosine >= 0.75 as not,
  weighted 0.3 against an STS-B pair;
* Chinese: STS-B ``zh-train`` pairs, read by characters (MiniLM reads no Chinese).

The data must hold enough to choose an operating point on (docs/architecture.md, "Semantic dedup"):
each STS-B split at least :data:`MIN_SPLIT_PAIRS` pairs, :data:`MIN_BAND_PAIRS` of them scored >= 4.5
and as many < 3, and banking77 at least :data:`MIN_BANK_INTENTS` intents of
:data:`MIN_BANK_ROWS_PER_INTENT` questions. A folder with less, or a file missing, is refused
(:class:`models.exceptions.MergeDataError`, :class:`pipeline.devtools.dedup_eval.PairsFileError`) before
the embedder loads; so is an output folder that cannot be written. The weights are written to the
folder the caller names (``pipeline/merge_data`` only when named), atomically.

The logit is calibrated by Platt scaling on 5-fold out-of-fold logits of the training pairs. The
operating point (a probability) is chosen on the ``dev`` split: the highest paraphrase merge rate with
at most :data:`MAX_BELOW_3` of pairs scored < 3 and :data:`MAX_BELOW_4` of pairs < 4 merged (the
issue's limits with a margin). For comparison the report also gives the point the training folds
alone would choose, measured on dev.
"""

from __future__ import annotations

import argparse
import csv
import itertools
import json
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from models.exceptions import MergeDataError
from pipeline.dedup import normalize
from pipeline.devtools.dedup_eval import load_pairs, writable_path
from pipeline.pairs import (
    FEATURES,
    Head,
    IdfTable,
    LearnedDecision,
    idf_keys,
    read_decision,
)

#: Operating point limits on dev: merged share of pairs scored < 3 and < 4.
MAX_BELOW_3 = 0.004
MAX_BELOW_4 = 0.0125
PARAPHRASE_MIN = 4.5
DIFFERENT_BELOW = 4.0
BANK_NEIGHBOURS = 5
BANK_SAME_MIN_COSINE = 0.9
BANK_DIFFERENT_MIN_COSINE = 0.75
BANK_WEIGHT = 0.3
#: English pairs under this cosine never merge (a safety floor under the classifier, and the vector
#: search's prefilter); set under the lowest cosine of any training or dev pair the head merges.
MIN_COSINE_FLOOR = 0.5

#: The least a data folder must hold. Each STS-B split: this many pairs, with at least
#: MIN_BAND_PAIRS scored >= 4.5 and as many < 3, since the training split's 5 folds need both labels
#: and the dev split's operating point is a share of paraphrases merged with at most 0.4 % of pairs
#: < 3 merged (with 30 paraphrases one pair moves it by 3 %). The real splits hold 1,500-5,749 pairs,
#: 128-628 scored >= 4.5 and 871-2,755 < 3; 40-pair files trained and wrote weights.
MIN_SPLIT_PAIRS = 300
MIN_BAND_PAIRS = 30
#: banking77: intents, each with this many questions in the file: a question is paired with its
#: BANK_NEIGHBOURS nearest neighbours in the training part (85 % of the file), so an intent needs more
#: than BANK_NEIGHBOURS + 1 there for same-intent pairs to exist. The real file: 77 intents of 35-187.
MIN_BANK_INTENTS = 2
MIN_BANK_ROWS_PER_INTENT = 10

STS_SPLITS = ("en-train", "en-dev", "zh-train", "zh-dev")
BANKING_FILE = "banking77/train.csv"

Pair = tuple[str, str, float]


def read_pairs(path: Path) -> list[Pair]:
    """STS-B style ``sentence1,sentence2,score`` rows (no header)."""
    return load_pairs(path)


def read_training_data(data_dir: str | Path) -> tuple[dict[str, list[Pair]], list[tuple[str, str]]]:
    """The STS-B splits by name and the banking77 training part, each checked against the minimums
    above; :class:`MergeDataError` (or the pairs' and rows' own errors) for a folder it cannot use."""
    from models.faq_train import split_banking77

    data = Path(data_dir)
    wanted = [f"stsb/{name}.csv" for name in STS_SPLITS] + [BANKING_FILE]
    if not data.is_dir():
        raise MergeDataError(data, f"is not a folder; expected one with {', '.join(wanted)}")
    missing = [name for name in wanted if not (data / name).is_file()]
    if missing:
        raise MergeDataError(data, f"lacks {', '.join(missing)}")
    sts = {name: check_split(data / "stsb" / f"{name}.csv") for name in STS_SPLITS}
    check_banking(data / BANKING_FILE)
    bank_train, _ = split_banking77(data / BANKING_FILE, 0.15, 77)
    return sts, bank_train


def check_split(path: Path) -> list[Pair]:
    """The pairs of one STS-B split, if they are enough to train or choose on."""
    pairs = read_pairs(path)
    paraphrases = sum(1 for _, _, s in pairs if s >= PARAPHRASE_MIN)
    different = sum(1 for _, _, s in pairs if s < 3.0)
    if len(pairs) < MIN_SPLIT_PAIRS or min(paraphrases, different) < MIN_BAND_PAIRS:
        raise MergeDataError(
            path,
            f"{len(pairs)} pairs, {paraphrases} scored >= 4.5 and {different} < 3; training needs at least "
            f"{MIN_SPLIT_PAIRS} pairs per split, at least {MIN_BAND_PAIRS} of them >= 4.5 and {MIN_BAND_PAIRS} < 3",
        )
    return pairs


def check_banking(path: Path) -> None:
    """:class:`MergeDataError` unless the banking77 file holds :data:`MIN_BANK_INTENTS` intents of at
    least :data:`MIN_BANK_ROWS_PER_INTENT` questions each."""
    from models.faq_train import check_trainable, read_rows

    check_trainable(path, read_rows(path), MIN_BANK_INTENTS, MIN_BANK_ROWS_PER_INTENT, MergeDataError)


def read_banking(csv_path: Path) -> list[tuple[str, str]]:
    with open(csv_path, newline="", encoding="utf-8") as fh:
        return [(r["text"], r["category"]) for r in csv.DictReader(fh)]


def embed_texts(texts: Sequence[str], embed: Callable[[Sequence[str]], np.ndarray]) -> dict[str, np.ndarray]:
    """Embed unique ``texts`` in chunks of 256 with a progress bar; unit vectors by text."""
    unique = list(dict.fromkeys(texts))
    parts = []
    with tqdm(total=len(unique), desc="embedding", unit="sent", file=sys.stderr) as bar:
        for start in range(0, len(unique), 256):
            chunk = unique[start : start + 256]
            parts.append(np.asarray(embed(chunk), dtype=np.float32))
            bar.update(len(chunk))
    vecs = np.concatenate(parts) if parts else np.zeros((0, 1), np.float32)
    vecs /= np.maximum(np.linalg.norm(vecs, axis=1, keepdims=True), 1e-12)
    return dict(zip(unique, vecs, strict=True))


def banking_pairs(rows: Sequence[tuple[str, str]], vectors: dict[str, np.ndarray]) -> list[Pair]:
    """Nearest-neighbour pairs of banking77 questions, labelled 1 (same intent, close) or 0."""
    texts = list(dict.fromkeys(t for t, _ in rows))
    intent = dict(rows)
    matrix = np.stack([vectors[t] for t in texts])
    seen: set[tuple[int, int]] = set()
    out: list[Pair] = []
    for start in tqdm(range(0, len(texts), 512), desc="banking77 neighbours", unit="block", file=sys.stderr):
        sims = matrix[start : start + 512] @ matrix.T
        for r, row in enumerate(sims):
            i = start + r
            row[i] = -1.0
            for j in np.argpartition(-row, BANK_NEIGHBOURS)[:BANK_NEIGHBOURS]:
                key = (min(i, int(j)), max(i, int(j)))
                if key in seen:
                    continue
                seen.add(key)
                same = intent[texts[i]] == intent[texts[int(j)]]
                cos = float(row[j])
                if (same and cos >= BANK_SAME_MIN_COSINE) or (not same and cos >= BANK_DIFFERENT_MIN_COSINE):
                    out.append((texts[i], texts[int(j)], 1.0 if same else 0.0))
    return out


@dataclass
class PairSet:
    """Features of labelled pairs, with the facts the rates need."""

    x: np.ndarray
    scores: np.ndarray
    exact: np.ndarray
    conflict: np.ndarray  # the guard's hard veto

    @property
    def cosine(self) -> np.ndarray:
        return self.x[:, 0]


def featurize(
    pairs: Sequence[Pair], decision: LearnedDecision, vectors: dict[str, np.ndarray] | None, desc: str
) -> PairSet:
    from pipeline.guard import hard_conflict

    rows, exact, conflict = [], [], []
    for a, b, _ in tqdm(pairs, desc=f"features {desc}", unit="pair", file=sys.stderr):
        cos = float(vectors[a] @ vectors[b]) if vectors is not None else None
        rows.append(decision.features(a, b, cos))
        exact.append(normalize(a) == normalize(b))
        conflict.append(hard_conflict(a, b) is not None)
    return PairSet(
        np.asarray(rows, dtype=np.float32).reshape(-1, len(FEATURES)),
        np.asarray([s for _, _, s in pairs], dtype=np.float64),
        np.asarray(exact, dtype=bool),
        np.asarray(conflict, dtype=bool),
    )


def rates(merged: np.ndarray, scores: np.ndarray) -> dict[str, float]:
    """Shares merged of pairs scored >= 4.5, < 3 and < 4."""

    def share(mask: np.ndarray) -> float:
        return float(merged[mask].mean()) if mask.any() else 0.0

    return {
        "paraphrase": share(scores >= PARAPHRASE_MIN),
        "below_3": share(scores < 3.0),
        "below_4": share(scores < 4.0),
    }


def merged_at(ps: PairSet, probs: np.ndarray, threshold: float, floor: float = 0.0) -> np.ndarray:
    return ps.exact | (~ps.conflict & (probs >= threshold) & (ps.cosine >= floor))


def choose_operating_point(
    ps: PairSet, probs: np.ndarray, floor: float = 0.0, max3: float = MAX_BELOW_3, max4: float = MAX_BELOW_4
) -> tuple[float, dict[str, float]]:
    """The probability with the highest paraphrase merge rate within the limits (ties: the higher)."""
    best: tuple[float, dict[str, float]] | None = None
    for t in np.round(np.arange(0.05, 0.996, 0.005), 3):
        r = rates(merged_at(ps, probs, float(t), floor), ps.scores)
        if (
            r["below_3"] <= max3
            and r["below_4"] <= max4
            and (best is None or r["paraphrase"] > best[1]["paraphrase"])
        ):
            best = (float(t), r)
    if best is None:
        return 1.0, rates(merged_at(ps, probs, 1.01, floor), ps.scores)
    return best


def fit_head(
    x: np.ndarray, y: np.ndarray, weight: np.ndarray, folds: int = 5, seed: int = 0
) -> tuple[Head, np.ndarray]:
    """Logistic regression on standardised features, Platt-calibrated on out-of-fold logits.

    Returns the head (threshold 0.5 until chosen) and the calibrated out-of-fold probabilities."""
    from sklearn.linear_model import LogisticRegression
    from sklearn.model_selection import StratifiedKFold

    def fit(
        xs: np.ndarray, ys: np.ndarray, ws: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, LogisticRegression]:
        mean = xs.mean(axis=0)
        scale = xs.std(axis=0)
        scale[scale < 1e-6] = 1.0
        clf = LogisticRegression(C=1.0, max_iter=5000)
        clf.fit((xs - mean) / scale, ys, sample_weight=ws)
        return mean, scale, clf

    oof = np.zeros(len(y))
    for tr, te in StratifiedKFold(folds, shuffle=True, random_state=seed).split(x, y):
        mean, scale, clf = fit(x[tr], y[tr], weight[tr])
        oof[te] = clf.decision_function((x[te] - mean) / scale)
    platt = LogisticRegression(C=1e6, max_iter=5000).fit(oof[:, None], y, sample_weight=weight)
    a, b = float(platt.coef_[0, 0]), float(platt.intercept_[0])
    mean, scale, clf = fit(x, y, weight)
    head = Head(
        mean=mean.astype(np.float32),
        scale=scale.astype(np.float32),
        layers=((clf.coef_.T.astype(np.float32), clf.intercept_.astype(np.float32)),),
        calibration=(a, b),
        threshold=0.5,
    )
    oof_p = 1.0 / (1.0 + np.exp(-np.clip(a * oof + b, -40, 40)))
    return head, oof_p


def calibration_table(probs: np.ndarray, y: np.ndarray, bins: int = 10) -> list[dict[str, float]]:
    """Mean predicted probability against the observed share, per probability decile."""
    out = []
    edges = np.linspace(0, 1, bins + 1)
    for lo, hi in itertools.pairwise(edges):
        m = (probs >= lo) & (probs < hi if hi < 1 else probs <= hi)
        if m.any():
            out.append(
                {
                    "bin": round(float(lo), 1),
                    "n": int(m.sum()),
                    "predicted": round(float(probs[m].mean()), 4),
                    "observed": round(float(y[m].mean()), 4),
                }
            )
    return out


def _with(head: Head, **changes: Any) -> Head:
    from dataclasses import replace

    return replace(head, **changes)


def train(
    data_dir: str | Path,
    out_dir: str | Path,
    embed: Callable[[Sequence[str]], np.ndarray] | None = None,
    plot_path: str | Path | None = None,
    report_path: str | Path | None = None,
) -> dict[str, Any]:
    """Train both heads, choose their operating points, write the weights to ``out_dir`` (the shipped
    ones only when it names ``pipeline/merge_data``) and return the report (also written to
    ``report_path``). The data and every output path are checked before anything is embedded."""
    started = time.perf_counter()
    out = writable_path(out_dir, folder=True)
    report_file = writable_path(report_path) if report_path is not None else None
    plot_file = writable_path(plot_path) if plot_path is not None else None
    sts, bank_train = read_training_data(data_dir)

    corpus = list(
        dict.fromkeys(
            [t for name in ("en-train", "zh-train") for a, b, _ in sts[name] for t in (a, b)]
            + [t for t, _ in bank_train]
        )
    )
    idf = IdfTable.fit(idf_keys(t) for t in tqdm(corpus, desc="idf", unit="text", file=sys.stderr))
    blank = LearnedDecision({}, idf, profile_cache=200_000)

    if embed is None:
        from models.embedder import shared_embedder

        embed = shared_embedder().embed
    english = [t for name in ("en-train", "en-dev") for a, b, _ in sts[name] for t in (a, b)]
    vectors = embed_texts(english + [t for t, _ in bank_train], embed)
    bank = banking_pairs(bank_train, vectors)

    sets = {
        "en-train": featurize(sts["en-train"], blank, vectors, "en-train"),
        "en-dev": featurize(sts["en-dev"], blank, vectors, "en-dev"),
        "zh-train": featurize(sts["zh-train"], blank, None, "zh-train"),
        "zh-dev": featurize(sts["zh-dev"], blank, None, "zh-dev"),
        "banking77": featurize(bank, blank, vectors, "banking77"),
    }
    report: dict[str, Any] = {"heads": {}, "data": {k: len(v.scores) for k, v in sets.items()}}
    heads: dict[str, Head] = {}
    for lang in ("en", "zh"):
        tr, dev = sets[f"{lang}-train"], sets[f"{lang}-dev"]
        keep = (tr.scores >= PARAPHRASE_MIN) | (tr.scores < DIFFERENT_BELOW)
        x, y = tr.x[keep], (tr.scores[keep] >= PARAPHRASE_MIN).astype(int)
        w = np.ones(len(y))
        if lang == "en":
            bk = sets["banking77"]
            x, y = np.vstack([x, bk.x]), np.concatenate([y, bk.scores.astype(int)])
            w = np.concatenate([w, np.full(len(bk.scores), BANK_WEIGHT)])
        head, oof = fit_head(x, y, w)
        floor = 0.0
        dev_p = head.probabilities(dev.x)
        threshold, dev_rates = choose_operating_point(dev, dev_p)
        if lang == "en":
            merged = merged_at(dev, dev_p, threshold) & ~dev.exact
            train_merged = merged_at(tr, head.probabilities(tr.x), threshold) & ~tr.exact
            lowest = min(
                [float(c) for c in dev.cosine[merged]] + [float(c) for c in tr.cosine[train_merged]] + [1.0]
            )
            floor = max(MIN_COSINE_FLOOR, float(np.floor((lowest - 0.02) * 100) / 100))
        heads[lang] = _with(head, threshold=threshold, cosine_floor=floor)
        # the point the training folds alone would choose, for comparison
        n_sts = int(keep.sum())
        oof_sts = np.zeros(len(tr.scores))
        oof_sts[np.flatnonzero(keep)] = oof[:n_sts]
        oof_sts[~keep] = heads[lang].probabilities(tr.x[~keep])  # not in any fold: in-sample, neutral pairs
        train_t, train_rates = choose_operating_point(tr, oof_sts)
        report["heads"][lang] = {
            "pairs": len(y),
            "threshold": threshold,
            "cosine_floor": floor,
            "dev": {k: round(v, 4) for k, v in dev_rates.items()},
            "train_folds_threshold": train_t,
            "train_folds": {k: round(v, 4) for k, v in train_rates.items()},
            "dev_at_train_folds_threshold": {
                k: round(v, 4) for k, v in rates(merged_at(dev, dev_p, train_t, floor), dev.scores).items()
            },
            "calibration_dev": calibration_table(
                dev_p[(dev.scores >= PARAPHRASE_MIN) | (dev.scores < DIFFERENT_BELOW)],
                (
                    dev.scores[(dev.scores >= PARAPHRASE_MIN) | (dev.scores < DIFFERENT_BELOW)]
                    >= PARAPHRASE_MIN
                ).astype(float),
            ),
            "weights": dict(
                zip(FEATURES, [round(float(v), 4) for v in heads[lang].layers[0][0][:, 0]], strict=True)
            ),
        }
        print(
            f"{lang}: operating point {threshold:.3f} (cosine floor {floor:.2f}); dev paraphrases merged "
            f"{dev_rates['paraphrase']:.1%}, < 3 {dev_rates['below_3']:.2%}, < 4 {dev_rates['below_4']:.2%}",
            file=sys.stderr,
        )
    meta = {
        "embedder": "all-MiniLM-L6-v2",
        "trained_on": "STS-B en/zh train, banking77 train part (split 15%, seed 77); operating points on dev",
        "limits": {"below_3": MAX_BELOW_3, "below_4": MAX_BELOW_4},
    }
    LearnedDecision(heads, idf, meta).save(out)
    # what ships (float16 idf), measured again on dev: the numbers to quote
    shipped = read_decision(out)
    for lang in ("en", "zh"):
        dev_pairs = sts[f"{lang}-dev"]
        dev = featurize(dev_pairs, shipped, vectors if lang == "en" else None, f"{lang}-dev (shipped)")
        h = shipped.heads[lang]
        merged = merged_at(dev, h.probabilities(dev.x), h.threshold, h.cosine_floor)
        report["heads"][lang]["dev_shipped"] = {k: round(v, 4) for k, v in rates(merged, dev.scores).items()}
    report["out_dir"] = str(out)
    report["weights_bytes"] = sum(p.stat().st_size for p in out.glob("merge_*"))
    report["seconds"] = round(time.perf_counter() - started, 1)
    if plot_file is not None:
        plot_training(report, sets, heads, plot_file)
    if report_file is not None:
        report_file.parent.mkdir(parents=True, exist_ok=True)
        report_file.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return report


def plot_training(
    report: dict[str, Any], sets: dict[str, PairSet], heads: dict[str, Head], path: Path
) -> None:
    """Dev trade-off (paraphrases merged against pairs < 4 merged) of the learned heads and of plain
    cosine thresholds, and the calibration of each head on dev."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, lang in zip(axes[:2], ("en", "zh"), strict=True):
        dev = sets[f"{lang}-dev"]
        p = heads[lang].probabilities(dev.x)
        pts = [
            rates(merged_at(dev, p, float(t), heads[lang].cosine_floor), dev.scores)
            for t in np.linspace(0.05, 0.99, 60)
        ]
        ax.plot(
            [r["below_4"] * 100 for r in pts], [r["paraphrase"] * 100 for r in pts], label="learned decision"
        )
        if lang == "en":
            cos = [
                rates(dev.exact | (~dev.conflict & (dev.cosine >= t)), dev.scores)
                for t in np.linspace(0.7, 0.99, 40)
            ]
            ax.plot(
                [r["below_4"] * 100 for r in cos],
                [r["paraphrase"] * 100 for r in cos],
                label="cosine threshold",
            )
        op = report["heads"][lang]["dev"]
        ax.scatter(
            [op["below_4"] * 100], [op["paraphrase"] * 100], color="red", zorder=3, label="operating point"
        )
        ax.axvline(1.5, color="grey", ls=":")
        ax.set_xlim(0, 6)
        ax.set_title(f"STS-B {lang}-dev")
        ax.set_xlabel("pairs scored < 4 merged, %")
        ax.set_ylabel("paraphrases (>= 4.5) merged, %")
        ax.legend()
    ax = axes[2]
    for lang in ("en", "zh"):
        table = report["heads"][lang]["calibration_dev"]
        ax.plot([r["predicted"] for r in table], [r["observed"] for r in table], marker="o", label=lang)
    ax.plot([0, 1], [0, 1], color="grey", ls=":")
    ax.set_title("calibration on dev")
    ax.set_xlabel("predicted probability")
    ax.set_ylabel("observed share of paraphrases")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m models.merge_train --data ../shared/data --out-dir DIR`` (what ``surge dedup train``
    wraps)."""
    parser = argparse.ArgumentParser(prog="surge dedup train", description=__doc__.splitlines()[0])
    parser.add_argument("--data", default="../shared/data", help="folder with stsb/ and banking77/")
    parser.add_argument(
        "--out-dir", required=True, help="the folder to write the weights into (SURGE_MERGE_DATA_DIR)"
    )
    parser.add_argument("--json", default=None, help="write the report here")
    parser.add_argument("--plot", default=None, help="write the trade-off and calibration plot here")
    args = parser.parse_args(argv)
    report = train(args.data, args.out_dir, plot_path=args.plot, report_path=args.json)
    print(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
