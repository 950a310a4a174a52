"""Training and evaluation of the FAQ answerer's intent classifier (``surge faq train``).

Called by hand or by the CLI, never by a worker. The training data (banking77, ``text,category`` CSV)
is passed in as a path and is not shipped: only the weights and n-gram vocabularies derived from it are.

The classifier is a multinomial logistic regression over ``[MiniLM embedding | word 1-2-gram TF-IDF |
char 1-4-gram TF-IDF]``, blended with a k-nearest-neighbour vote over the training questions'
embeddings. A validation split carved from the training split picks the regularisation and the blend
among a few candidates; the held-out split (reused by other benchmarks) is only used for the final,
reported accuracy. A second regression over the n-gram blocks alone (same regularisation) is the
level-3 template's classifier, which needs no embedding; its held-out accuracy is reported too.
"""

from __future__ import annotations

import argparse
import csv
import json
import random
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from itertools import product
from pathlib import Path

import numpy as np
from tqdm import tqdm

from models.embedder import Embedder, shared_embedder
from models.exceptions import FAQDataError
from models.faq import DATA_DIR, INTENTS_FILE, Blend, FAQAnswerer, FAQModel, TfidfBlock, load_model

Row = tuple[str, str]


@dataclass(frozen=True)
class Candidate:
    """One classifier setting tried on the validation split."""

    c: float  # inverse L2 regularisation strength of the logistic regression
    emb_scale: float = 1.0  # weight of the embedding block relative to the unit-norm TF-IDF blocks


DEFAULT_CANDIDATES: tuple[Candidate, ...] = (Candidate(10.0), Candidate(30.0))
#: nearest-neighbour blends tried on top of each candidate (cheap: no refit); weight 0 is "linear only"
DEFAULT_BLENDS: tuple[Blend, ...] = tuple(
    Blend(k, t, w) for k, t, w in product((5, 10), (0.02, 0.05), (0.0, 0.2, 0.3, 0.5))
)
#: probability thresholds whose effect on the held-out split the training report lists
FLOOR_GRID: tuple[float, ...] = (0.2, 0.25, 0.3, 0.35, 0.4, 0.45, 0.5)


#: the least a training file must hold: this many intents, each with this many questions (one in
#: seven is held out to report accuracy on, and model selection holds out as many again)
MIN_INTENTS = 2
MIN_ROWS_PER_INTENT = 8


def read_rows(csv_path: str | Path) -> list[Row]:
    """``(text, category)`` pairs of a ``text,category`` CSV, in file order; :class:`FAQDataError`
    for a file that is missing, not UTF-8, without those columns, or with an empty text or category
    (its line), or with no rows."""
    try:
        with open(csv_path, newline="", encoding="utf-8") as f:
            reader = csv.DictReader(f)
            missing = {"text", "category"} - set(reader.fieldnames or ())
            if missing:
                raise FAQDataError(csv_path, f"needs the columns text,category; missing {sorted(missing)}")
            rows = []
            for r in reader:
                text, category = r.get("text") or "", r.get("category") or ""
                if not text.strip() or not category.strip():
                    raise FAQDataError(csv_path, f"line {reader.line_num}: empty text or category")
                rows.append((text, category))
    except OSError as exc:
        raise FAQDataError(csv_path, f"cannot be read: {exc.strerror or exc}") from exc
    except UnicodeDecodeError as exc:
        raise FAQDataError(csv_path, f"is not UTF-8 ({exc.reason} at byte {exc.start})") from exc
    except csv.Error as exc:
        raise FAQDataError(csv_path, f"is not a CSV file: {exc}") from exc
    if not rows:
        raise FAQDataError(csv_path, "holds no rows")
    return rows


def check_trainable(
    csv_path: str | Path,
    rows: Sequence[Row],
    min_intents: int = MIN_INTENTS,
    min_rows: int = MIN_ROWS_PER_INTENT,
    error: Callable[[object, str], Exception] = FAQDataError,
) -> None:
    """``error`` (:class:`FAQDataError`) unless ``rows`` hold ``min_intents`` intents of at least
    ``min_rows`` questions each: a file of a dozen rows trained and wrote weights whose accuracy on
    real questions fell from 0.99 to 0.29, reporting 1.0 on its two held-out rows. The merge
    decision's trainer checks its banking77 file with it too."""
    counts: dict[str, int] = defaultdict(int)
    for _, category in rows:
        counts[category] += 1
    small = sorted(c for c, n in counts.items() if n < min_rows)
    if len(counts) < min_intents or small:
        shown = ", ".join(small[:5]) + (f" and {len(small) - 5} more" if len(small) > 5 else "")
        raise error(
            csv_path,
            f"{len(rows)} rows in {len(counts)} intents; training needs at least {min_intents} intents "
            f"of at least {min_rows} questions each" + (f" (too few: {shown})" if small else ""),
        )


def stratified_split(rows: Sequence[Row], fraction: float, seed: int) -> tuple[list[Row], list[Row]]:
    """Split ``rows`` into (rest, part) with ``round(fraction * n)`` rows of each label in ``part``.

    Deterministic for a given ``seed``; both parts keep the input order.
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"split fraction must be in (0, 1), got {fraction}")
    by_label: dict[str, list[int]] = defaultdict(list)
    for i, (_, label) in enumerate(rows):
        by_label[label].append(i)
    rng = random.Random(seed)
    picked: set[int] = set()
    for label in sorted(by_label):
        idx = list(by_label[label])
        rng.shuffle(idx)
        picked.update(idx[: round(fraction * len(idx))])
    rest = [r for i, r in enumerate(rows) if i not in picked]
    part = [r for i, r in enumerate(rows) if i in picked]
    return rest, part


def split_banking77(
    csv_path: str | Path, holdout_fraction: float = 0.15, seed: int = 77
) -> tuple[list[Row], list[Row]]:
    """(train rows, held-out rows) of a banking77 CSV, stratified by intent and deterministic.

    The held-out rows are what the FAQ accuracy is reported on, and what other benchmarks reuse.
    """
    rows = read_rows(csv_path)
    check_trainable(csv_path, rows)
    return stratified_split(rows, holdout_fraction, seed)


def intent_examples(path: Path = DATA_DIR / INTENTS_FILE) -> list[Row]:
    """The example questions written for this project, as extra training rows."""
    entries = json.loads(path.read_text(encoding="utf-8"))
    return [(q, str(e["intent"])) for e in entries for q in e["examples"]]


def embed_with_progress(embedder: Embedder, texts: Sequence[str], chunk: int = 256) -> np.ndarray:
    """Embed ``texts`` in chunks, with a tqdm progress bar (sentences/s) on stderr."""
    parts = []
    with tqdm(total=len(texts), desc="embedding", unit="sent", file=sys.stderr) as bar:
        for start in range(0, len(texts), chunk):
            batch = texts[start : start + chunk]
            parts.append(embedder.embed(batch))
            bar.update(len(batch))
    return np.concatenate(parts) if parts else np.zeros((0, embedder.dim), dtype=np.float32)


def fit_model(
    texts: Sequence[str], labels: Sequence[str], embeddings: np.ndarray, candidate: Candidate
) -> FAQModel:
    """Fit the TF-IDF vocabularies and the logistic regression on one training set; the training
    embeddings become the neighbour table (blend weight 0 until selection sets it)."""
    from sklearn.linear_model import LogisticRegression

    word = TfidfBlock.fit("word", texts, min_df=2)
    char = TfidfBlock.fit("char", texts, min_df=2)
    empty = np.zeros((0, 0), np.float32)
    shell = FAQModel([], word, char, candidate.emb_scale, empty, np.zeros(0), empty, np.zeros(0, np.int64))
    clf = LogisticRegression(C=candidate.c, max_iter=3000)
    clf.fit(shell.features(texts, embeddings), np.asarray(labels))
    classes = [str(c) for c in clf.classes_]
    column = {label: i for i, label in enumerate(classes)}
    # the level-3 template's layer: the same n-grams without the embedding (docs/architecture.md, "Degradation")
    lexical = LogisticRegression(C=candidate.c, max_iter=3000)
    lexical.fit(shell.lexical_features(texts), np.asarray(labels))
    if [str(c) for c in lexical.classes_] != classes:
        raise ValueError("the lexical layer's intents differ from the model's")
    return FAQModel(
        labels=classes,
        word=word,
        char=char,
        emb_scale=candidate.emb_scale,
        weight=np.ascontiguousarray(clf.coef_.T, dtype=np.float32),
        bias=clf.intercept_.astype(np.float32),
        knn_vectors=np.asarray(embeddings, dtype=np.float32),
        knn_labels=np.asarray([column[label] for label in labels], dtype=np.int64),
        lexical_weight=np.ascontiguousarray(lexical.coef_.T, dtype=np.float32),
        lexical_bias=lexical.intercept_.astype(np.float32),
    )


def blend_accuracies(
    model: FAQModel,
    texts: Sequence[str],
    labels: Sequence[str],
    embeddings: np.ndarray,
    blends: Sequence[Blend],
) -> list[float]:
    """For each blend: the share of ``texts`` whose most likely intent is the given label."""
    names = np.asarray(model.labels)
    truth = np.asarray(labels)
    linear = model.linear_probabilities(texts, embeddings)
    knn_cache: dict[tuple[int, float], np.ndarray] = {}
    out = []
    for blend in blends:
        key = (blend.k, blend.temperature)
        if key not in knn_cache:
            knn_cache[key] = model.knn_probabilities(embeddings, blend.k, blend.temperature)
        probs = FAQModel.blended(linear, knn_cache[key], blend.weight)
        out.append(float(np.mean(names[probs.argmax(axis=1)] == truth)))
    return out


def floor_table(probs: np.ndarray, correct: np.ndarray) -> list[dict[str, float]]:
    """For each threshold of :data:`FLOOR_GRID`: the share of answers below it, and accuracy above it."""
    conf = probs.max(axis=1)
    table = []
    for floor in FLOOR_GRID:
        above = conf >= floor
        table.append(
            {
                "floor": floor,
                "below_fraction": round(float(np.mean(~above)), 4),
                "accuracy_above": round(float(np.mean(correct[above])) if above.any() else 0.0, 4),
            }
        )
    return table


def train(
    csv_path: str | Path,
    out_dir: str | Path,
    holdout_fraction: float = 0.15,
    seed: int = 77,
    embedder: Embedder | None = None,
    candidates: Sequence[Candidate] = DEFAULT_CANDIDATES,
    blends: Sequence[Blend] = DEFAULT_BLENDS,
    val_fraction: float = 0.15,
) -> dict[str, object]:
    """Train on the train split (plus the project's own example questions), pick the candidate with
    the best validation accuracy, refit on the whole train split, write the weights to ``out_dir`` and
    report the accuracy of the written weights on the held-out split."""
    started = time.perf_counter()
    out = Path(out_dir)
    if out.exists() and not out.is_dir():
        raise FAQDataError(out, "is a file, not a folder to write the weights into")
    train_rows, holdout_rows = split_banking77(csv_path, holdout_fraction, seed)
    train_rows = train_rows + intent_examples()
    emb = embedder or shared_embedder()
    all_texts = [t for t, _ in train_rows] + [t for t, _ in holdout_rows]
    vectors = embed_with_progress(emb, all_texts)
    train_vecs = dict(zip([t for t, _ in train_rows], vectors[: len(train_rows)], strict=True))
    holdout_vecs = vectors[len(train_rows) :]

    def unpack(rows: Sequence[Row]) -> tuple[list[str], list[str], np.ndarray]:
        texts = [t for t, _ in rows]
        return texts, [c for _, c in rows], np.stack([train_vecs[t] for t in texts])

    fit_rows, val_rows = stratified_split(train_rows, val_fraction, seed + 1)
    fit_x, fit_y, fit_e = unpack(fit_rows)
    val_x, val_y, val_e = unpack(val_rows)
    validation: list[dict[str, float]] = []
    scored: list[tuple[float, Candidate, Blend]] = []
    for cand in tqdm(candidates, desc="model selection", unit="fit", file=sys.stderr):
        t0 = time.perf_counter()
        accs = blend_accuracies(fit_model(fit_x, fit_y, fit_e, cand), val_x, val_y, val_e, blends)
        for blend, acc in zip(blends, accs, strict=True):
            scored.append((acc, cand, blend))
            row = {"c": cand.c, "emb_scale": cand.emb_scale, "knn_k": blend.k}
            row |= {
                "knn_temperature": blend.temperature,
                "knn_weight": blend.weight,
                "val_accuracy": round(acc, 4),
            }
            validation.append(row)
        linear_only = max(a for a, b in zip(accs, blends, strict=True) if b.weight == 0) if accs else 0.0
        print(
            f"candidate C={cand.c:g} emb_scale={cand.emb_scale:g}: validation accuracy {linear_only:.4f} "
            f"linear, {max(accs):.4f} best blend ({time.perf_counter() - t0:.1f}s)",
            file=sys.stderr,
        )
    # first best wins: candidates and blends are listed from simplest to most elaborate
    _, chosen, chosen_blend = max(scored, key=lambda s: s[0])

    tr_x, tr_y, tr_e = unpack(train_rows)
    replace(fit_model(tr_x, tr_y, tr_e, chosen), blend=chosen_blend).save(out)
    shipped = load_model(out)  # evaluate what was written (float16 weights), not what was fitted
    ho_x = [t for t, _ in holdout_rows]
    ho_y = np.asarray([c for _, c in holdout_rows])
    probs = shipped.probabilities(ho_x, holdout_vecs)
    correct = np.asarray(shipped.labels)[probs.argmax(axis=1)] == ho_y
    lexical = shipped.lexical_probabilities(ho_x)
    lexical_correct = np.asarray(shipped.labels)[lexical.argmax(axis=1)] == ho_y
    report: dict[str, object] = {
        "accuracy": round(float(correct.mean()), 4),
        # the level-3 template (n-grams only, no embedding) on the same held-out rows
        "template_accuracy": round(float(lexical_correct.mean()), 4),
        "template_floors": floor_table(lexical, lexical_correct),
        "n_train": len(train_rows),
        "n_holdout": len(holdout_rows),
        "chosen": {"c": chosen.c, "emb_scale": chosen.emb_scale, "blend": asdict(chosen_blend)},
        "validation_best": sorted(validation, key=lambda r: -r["val_accuracy"])[:5],
        "floors": floor_table(probs, correct),
        "weights_bytes": sum(p.stat().st_size for p in out.glob("faq_*")),
        "seconds": round(time.perf_counter() - started, 1),
    }
    print(
        f"held-out accuracy {report['accuracy']:.4f} on {len(holdout_rows)} rows "
        f"(the level-3 template, n-grams only: {report['template_accuracy']:.4f})",
        file=sys.stderr,
    )
    return report


def evaluate(csv_path: str | Path, answerer: FAQAnswerer | None = None) -> dict[str, object]:
    """Intent accuracy of ``answerer`` (default: the shipped weights) on any ``text,category`` CSV."""
    started = time.perf_counter()
    rows = read_rows(csv_path)  # a bad file is refused before the model loads
    faq = answerer or FAQAnswerer()
    faq.load()
    labels = np.asarray([c for _, c in rows])
    chunks = []
    for start in tqdm(
        range(0, len(rows), faq.max_batch_size), desc="evaluating", unit="batch", file=sys.stderr
    ):
        chunks.append(faq.probabilities([t for t, _ in rows[start : start + faq.max_batch_size]]))
    probs = np.concatenate(chunks) if chunks else np.zeros((0, len(faq.labels)))
    predicted = np.asarray(faq.labels)[probs.argmax(axis=1)] if len(rows) else np.asarray([])
    correct = predicted == labels
    below = probs.max(axis=1) < faq.confidence_floor if len(rows) else np.asarray([], dtype=bool)
    return {
        "accuracy": round(float(correct.mean()), 4) if len(rows) else 0.0,
        "n": len(rows),
        "n_correct": int(correct.sum()),
        "confidence_floor": faq.confidence_floor,
        "below_floor_fraction": round(float(below.mean()), 4) if len(rows) else 0.0,
        "seconds": round(time.perf_counter() - started, 1),
    }


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m models.faq_train {train,evaluate} CSV``; the ``surge faq`` CLI can call this."""
    parser = argparse.ArgumentParser(prog="surge faq", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["train", "evaluate"])
    parser.add_argument("csv", help="a text,category CSV (banking77 train.csv for training)")
    parser.add_argument(
        "--out-dir",
        default=str(DATA_DIR),
        help="where train writes the weights and evaluate reads them (default: the shipped folder)",
    )
    args = parser.parse_args(argv)
    if args.command == "train":
        result = train(args.csv, args.out_dir)
    else:
        result = evaluate(args.csv, FAQAnswerer(args.out_dir))
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
