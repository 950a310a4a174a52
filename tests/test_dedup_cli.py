"""``surge dedup eval`` and ``surge dedup train`` on input they cannot use, and the atomic save of the
merge decision's weights (docs/architecture.md, "Semantic dedup").

Every refusal here comes before the embedder loads (a test fails if it is asked for) and before a file
is written; the inputs are small files made in ``tmp_path``."""

from __future__ import annotations

import csv
import dataclasses
import random
import re
from pathlib import Path

import numpy as np
import pytest

from pipeline.cli import main
from pipeline.devtools.dedup_eval import ThresholdsError, parse_thresholds
from pipeline.pairs import MODEL_FILE, WEIGHTS_FILE, LearnedDecision, default_data_dir, read_decision

WORDS = "card pin top up transfer fee account limit cash refund app phone euro exchange rate".split()
HAN = "卡密码转账费用账户限额现金退款汇率手机"


class _Embedder:
    """A bag of hashed words, enough to run the pipeline; stands in for MiniLM."""

    path = "hashed-words"
    multilingual = False

    def embed(self, texts: list[str]) -> np.ndarray:
        out = np.zeros((len(texts), 32), np.float32)
        for i, t in enumerate(texts):
            for word in t.split():
                out[i, hash(word) % 32] += 1.0
        return out + 1e-3


@pytest.fixture
def no_embedder(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fail the test if the command got as far as loading the embedder."""

    def refuse(*args: object, **kwargs: object) -> object:
        raise AssertionError("the embedder was loaded before the input was checked")

    monkeypatch.setattr("models.embedder.shared_embedder", refuse)


def write_pairs(path: Path, count: int, rng: random.Random, chinese: bool = False) -> None:
    """``count`` STS-B style pairs: every other one a paraphrase (5.0), the rest scored 0.5-3.5."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        for i in range(count):
            if chinese:
                a = "".join(rng.sample(HAN, 6))
                b = a + "吗" if i % 2 else "".join(rng.sample(HAN, 6))
            else:
                a = " ".join(rng.sample(WORDS, 5))
                b = a + " please" if i % 2 else " ".join(rng.sample(WORDS, 5))
            w.writerow([a, b, 5.0 if i % 2 else rng.choice([0.5, 2.0, 3.5])])


def write_banking(path: Path, intents: int, rows_per_intent: int, rng: random.Random) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as fh:
        w = csv.writer(fh)
        w.writerow(["text", "category"])
        for intent in range(intents):
            for _ in range(rows_per_intent):
                w.writerow([f"{WORDS[intent]} " + " ".join(rng.sample(WORDS, 4)), f"intent{intent}"])


def write_training_data(folder: Path, pairs: int = 320, intents: int = 6, rows_per_intent: int = 12) -> Path:
    """A data folder ``surge dedup train`` accepts (just over its minimums): ``stsb/{en,zh}-{train,dev}.csv``
    and ``banking77/train.csv``."""
    rng = random.Random(3)
    for split in ("en-train", "en-dev", "zh-train", "zh-dev"):
        write_pairs(folder / "stsb" / f"{split}.csv", pairs, rng, chinese=split.startswith("zh"))
    write_banking(folder / "banking77" / "train.csv", intents, rows_per_intent, rng)
    return folder


# ---- surge dedup eval ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (None, "cannot be read"),
        (b"", "holds no pairs"),
        (b"\n , , \n\n", "holds no pairs"),
        ("caf\u00e9,cafe,5.0\n".encode("latin-1"), "is not UTF-8"),
        (b"sentence1,sentence2,score\na,b,5\n", "line 1: score 'score' is not a number"),
        (b"a,b,5\nc,d\n", "line 2: 2 fields"),
    ],
)
def test_eval_refuses_a_pairs_file_before_the_embedder_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_embedder: None, content: bytes | None, problem: str
) -> None:
    """An empty file printed "chosen threshold: 0.92" from zero pairs and exited 0; a missing or
    Latin-1 file ended in a traceback after the embedder had loaded (13 s)."""
    path = tmp_path / "pairs.csv"
    if content is not None:
        path.write_bytes(content)
    assert main(["dedup", "eval", "--pairs", str(path)]) == 2
    err = capsys.readouterr().err
    assert "PairsFileError" in err or "PairsFormatError" in err
    assert f"{path}: {problem}" in err


@pytest.mark.parametrize(
    ("spec", "problem"),
    [
        ("0.95:0.8:0.01", "start <= stop and step > 0"),
        ("0.8:0.9:0", "start <= stop and step > 0"),
        ("0.8:0.9", "3 parts"),
        ("0.8,high", "'high' is not a number"),
        ("nan", "'nan' is not a number"),
        (",", "no threshold"),
        ("1.5", "1.5 is outside 0-1"),
        ("-1:0.5:0.1", "within 0-1"),
        ("0:1:0.00001", "more than 1001"),
    ],
)
def test_eval_refuses_thresholds_it_cannot_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_embedder: None, spec: str, problem: str
) -> None:
    """A reversed range ended in a ValueError traceback."""
    pairs = tmp_path / "pairs.csv"
    pairs.write_text("a card,the card,5.0\n", encoding="utf-8")
    assert main(["dedup", "eval", "--pairs", str(pairs), f"--thresholds={spec}"]) == 2
    err = capsys.readouterr().err
    assert "ThresholdsError" in err and problem in err
    with pytest.raises(ThresholdsError, match=re.escape(problem)):
        parse_thresholds(spec)


def test_parse_thresholds_reads_ranges_and_lists() -> None:
    assert parse_thresholds("0.80:0.83:0.01") == [0.8, 0.81, 0.82, 0.83]
    assert parse_thresholds("0.85, 0.9,") == [0.85, 0.9]
    assert parse_thresholds("0.92:0.92:0.01") == [0.92]


@pytest.mark.parametrize("where", ["under a file", "a folder"])
def test_eval_refuses_an_output_it_cannot_write_before_the_embedder_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_embedder: None, where: str
) -> None:
    """A --json path in a missing folder failed with a traceback after the whole evaluation."""
    pairs = tmp_path / "pairs.csv"
    pairs.write_text("a card,the card,5.0\n", encoding="utf-8")
    (tmp_path / "file.txt").write_text("x", encoding="utf-8")
    (tmp_path / "out.json").mkdir()
    out = tmp_path / "file.txt" / "out.json" if where == "under a file" else tmp_path / "out.json"
    assert main(["dedup", "eval", "--pairs", str(pairs), "--json", str(out)]) == 2
    assert "OutputPathError" in capsys.readouterr().err


def test_eval_makes_the_json_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("matplotlib")
    monkeypatch.setattr("models.embedder.shared_embedder", lambda path=None: _Embedder())
    pairs = tmp_path / "pairs.csv"
    pairs.write_text("a card,the card,5.0\nlock my card,unlock my card,0.5\n", encoding="utf-8")
    out = tmp_path / "new" / "deeper" / "out.json"
    assert main(["dedup", "eval", "--pairs", str(pairs), "--json", str(out), "--thresholds", "0.9"]) == 0
    assert out.stat().st_size > 0 and out.with_suffix(".png").stat().st_size > 0


# ---- surge dedup train -----------------------------------------------------------------------------
def test_train_requires_out_dir_and_leaves_the_shipped_weights(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_embedder: None
) -> None:
    """Without --out-dir it trained into pipeline/merge_data, the weights every worker loads."""
    shipped = default_data_dir()
    before = {p.name: p.stat().st_mtime_ns for p in shipped.iterdir()}
    data = write_training_data(tmp_path / "data")
    assert main(["dedup", "train", "--data", str(data)]) == 2
    assert "--out-dir is required" in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in shipped.iterdir()} == before


def _break_data(data: Path, how: str) -> Path:
    rng = random.Random(5)
    if how == "no folder":
        return data / "missing"
    if how == "no zh-dev":
        (data / "stsb" / "zh-dev.csv").unlink()
    elif how == "40 pairs":
        write_pairs(data / "stsb" / "en-train.csv", 40, rng)
    elif how == "no pair < 3":
        (data / "stsb" / "en-dev.csv").write_text("a card,the card,5.0\n" * 400, encoding="utf-8")
    elif how == "latin-1":
        (data / "stsb" / "zh-train.csv").write_bytes("caf\u00e9,cafe,5.0\n".encode("latin-1"))
    elif how == "one intent":
        write_banking(data / "banking77" / "train.csv", 1, 60, rng)
    elif how == "small intents":
        write_banking(data / "banking77" / "train.csv", 3, 9, rng)
    return data


@pytest.mark.parametrize(
    ("how", "problem"),
    [
        ("no folder", "missing: is not a folder"),
        ("no zh-dev", "data: lacks stsb/zh-dev.csv"),
        ("40 pairs", "en-train.csv: 40 pairs, 20 scored >= 4.5"),
        ("no pair < 3", "en-dev.csv: 400 pairs, 400 scored >= 4.5 and 0 < 3"),
        ("latin-1", "zh-train.csv: is not UTF-8"),
        ("one intent", "1 intents"),
        ("small intents", "too few: intent0, intent1, intent2"),
    ],
)
def test_train_refuses_data_it_cannot_learn_from_before_the_embedder_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_embedder: None, how: str, problem: str
) -> None:
    """40 pairs per STS-B file and one banking77 intent trained and wrote weights; a missing folder
    ended in a FileNotFoundError traceback."""
    data = _break_data(write_training_data(tmp_path / "data"), how)
    out = tmp_path / "weights"
    assert main(["dedup", "train", "--data", str(data), "--out-dir", str(out)]) == 2
    assert problem in capsys.readouterr().err
    assert not out.exists(), "nothing is written for data that was refused"


@pytest.mark.parametrize(
    ("flag", "where"),
    [
        ("--out-dir", "file.txt/sub"),
        ("--out-dir", "file.txt"),
        ("--json", "file.txt/report.json"),
        ("--plot", "folder"),
    ],
)
def test_train_refuses_an_output_it_cannot_write_before_the_embedder_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], no_embedder: None, flag: str, where: str
) -> None:
    """An --out-dir under a file failed with NotADirectoryError only after training."""
    data = write_training_data(tmp_path / "data")
    (tmp_path / "file.txt").write_text("x", encoding="utf-8")
    (tmp_path / "folder").mkdir()
    paths = {"--out-dir": str(tmp_path / "weights"), flag: str(tmp_path / where)}
    argv = ["dedup", "train", "--data", str(data)] + [x for kv in paths.items() for x in kv]
    assert main(argv) == 2
    assert "OutputPathError" in capsys.readouterr().err
    assert not (tmp_path / "weights").exists()


# ---- the atomic save -------------------------------------------------------------------------------
def _saved(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def test_a_failed_save_leaves_the_old_weights_whole(tmp_path: Path) -> None:
    """The arrays were written over the old ones before the JSON was made: a failure there left new
    arrays beside the old JSON."""
    from tests.test_pairs import _toy_decision

    old = _toy_decision()
    old.save(tmp_path)
    before = _saved(tmp_path)
    heads = {k: dataclasses.replace(h, mean=h.mean + 1.0) for k, h in old.heads.items()}
    with pytest.raises(TypeError):
        LearnedDecision(heads, old.idf, {"not json": object()}).save(tmp_path)
    assert _saved(tmp_path) == before


def test_save_renames_temporary_files_the_model_file_last(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os

    from tests.test_pairs import _toy_decision

    renames: list[tuple[Path, Path]] = []
    real_replace = os.replace

    def replace(src: str | Path, dst: str | Path) -> None:
        renames.append((Path(src), Path(dst)))
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    dec = _toy_decision()
    dec.save(tmp_path / "out")
    assert [dst.name for _, dst in renames] == [WEIGHTS_FILE, MODEL_FILE]
    assert all(src.parent == tmp_path / "out" and not src.exists() for src, _ in renames)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted([WEIGHTS_FILE, MODEL_FILE])
    assert all((tmp_path / "out" / name).stat().st_mode & 0o044 for name in (WEIGHTS_FILE, MODEL_FILE))
    assert read_decision(tmp_path / "out").heads.keys() == dec.heads.keys()

    def fail_on_the_model_file(src: str | Path, dst: str | Path) -> None:
        if Path(dst).name == MODEL_FILE:
            raise OSError("disk full")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", fail_on_the_model_file)
    with pytest.raises(OSError, match="disk full"):
        dec.save(tmp_path / "out")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted([WEIGHTS_FILE, MODEL_FILE])
