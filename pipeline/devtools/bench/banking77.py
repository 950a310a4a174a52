"""The banking77 questions the workloads of ``merging``, ``surge`` and ``failover`` ask.

The data is the banking77 ``train.csv`` (``text,category``), read only by the benchmarks: given,
``SURGE_BENCH_BANKING77_CSV``, or ``shared/data`` beside the repository. The workloads ask its
held-out rows (:func:`models.faq_train.split_banking77`, 15 %, seed 77) and copies of them: exact
repeats and :func:`light_edit` s of an earlier question (:func:`copy_source` picks which).
"""

from __future__ import annotations

import os
import random
from collections.abc import Sequence
from pathlib import Path

from pipeline.dedup import normalize
from pipeline.devtools.bench.common import BenchError

POLITE_BEFORE = ("Hi, ", "Hello, ", "Please, ", "Hey there, ", "Excuse me, ")
POLITE_AFTER = (" please", " thanks", " thank you", " please help", " if you can")


def _default_csv() -> Path:
    here = Path(__file__).resolve().parents[3]  # the repository root
    for base in (here.parent / "shared" / "data", Path("../shared/data")):
        p = base / "banking77" / "train.csv"
        if p.is_file():
            return p
    return here.parent / "shared" / "data" / "banking77" / "train.csv"


def resolve_csv(banking77_csv: str | Path | None, scenario: str) -> Path:
    """The banking77 ``train.csv``: given, ``SURGE_BENCH_BANKING77_CSV``, or ``../shared/data``."""
    path = Path(banking77_csv or os.environ.get("SURGE_BENCH_BANKING77_CSV") or _default_csv())
    if not path.is_file():
        raise BenchError(
            f"banking77 CSV not found at {str(path)!r} (absolute {path.absolute()}); the {scenario} "
            "benchmark asks held-out banking77 questions (train.csv: text,category): pass --data PATH "
            "(banking77_csv= to run_bench) or set SURGE_BENCH_BANKING77_CSV"
        )
    return path


def unseen_questions(csv_path: Path) -> tuple[list[tuple[str, str]], set[str]]:
    """The held-out banking77 rows (the answerer's training split left them out) and the normalised
    texts it was trained on (the training split and the project's own example questions)."""
    from models.faq_train import intent_examples, split_banking77

    train, holdout = split_banking77(csv_path, 0.15, 77)
    return holdout, {normalize(t) for t, _ in [*train, *intent_examples()]}


def copy_source(rng: random.Random, unique_idx: Sequence[int]) -> int:
    """The unique question a repeat or an edit copies: 70 % of the time one of the last 300 (so that
    some copies meet their original in flight), else any earlier one."""
    return rng.choice(unique_idx[-300:]) if rng.random() < 0.7 else rng.choice(unique_idx)


def light_edit(text: str, rng: random.Random) -> str:
    """One or two meaning-preserving edits: case, punctuation, white space, a polite word."""
    ops = rng.sample(("case", "punct", "space", "polite"), k=rng.choice((1, 2)))
    out = text
    for op in ops:
        if op == "case":
            out = rng.choice((str.lower, str.upper, str.capitalize, str.title))(out)
        elif op == "punct":
            stripped = out.rstrip("?!. ")
            out = stripped + rng.choice(("", "?", "??", "!", ".", " ?")) if stripped else out
        elif op == "space":
            words = out.split(" ")
            i = rng.randrange(len(words))
            words[i] = words[i] + " "
            out = rng.choice(("  ", " ", "")) + " ".join(words) + rng.choice(("", " ", "\t"))
        else:
            out = (
                rng.choice(POLITE_BEFORE) + out[:1].lower() + out[1:]
                if rng.random() < 0.5
                else (out.rstrip("?!. ") + rng.choice(POLITE_AFTER) + "?")
            )
    return out if out.strip() else text
