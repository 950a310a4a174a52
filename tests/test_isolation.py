"""Failure isolation: poisoned items fail alone, transient errors are retried, OOM splits."""

from __future__ import annotations

import math
from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from models.exceptions import ModelError, ModelOutOfMemoryError, PartialBatchError, TransientModelError
from pipeline.exceptions import SettingsError
from pipeline.isolation import RetryPolicy, run_isolated

POLICY = RetryPolicy(attempts=3, initial_backoff_ms=100.0, max_backoff_ms=250.0, multiplier=2.0)


class Recorder:
    """Counts model calls and the sleeps between retries."""

    def __init__(self) -> None:
        self.calls: list[int] = []
        self.sleeps: list[float] = []

    def on_call(self, size: int) -> None:
        self.calls.append(size)

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)


def upper_unless_poisoned(poison: set[str]):
    def infer(batch: Sequence[str]) -> list[str]:
        if poison.intersection(batch):
            raise ValueError("tokenizer choked on input")
        return [s.upper() for s in batch]

    return infer


def test_poisoned_item_fails_alone_in_a_batch_of_16() -> None:
    batch = [f"q{i}" for i in range(16)]
    rec = Recorder()
    out = run_isolated(batch, upper_unless_poisoned({"q11"}), POLICY, sleep=rec.sleep, on_call=rec.on_call)
    assert len(out) == 16
    assert isinstance(out[11], ModelError) and "ValueError" in str(out[11])
    assert [o for i, o in enumerate(out) if i != 11] == [f"Q{i}" for i in range(16) if i != 11]
    assert len(rec.calls) <= 2 * math.ceil(math.log2(16)) + 1
    assert rec.calls[0] == 16 and rec.sleeps == []  # a permanent error is not retried


@settings(max_examples=100, deadline=None)
@given(n=st.integers(min_value=1, max_value=64), data=st.data())
def test_any_poisoned_subset_fails_exactly(n: int, data: st.DataObject) -> None:
    poisoned = data.draw(st.sets(st.integers(min_value=0, max_value=n - 1), max_size=3))
    batch = [f"q{i}" for i in range(n)]
    rec = Recorder()
    out = run_isolated(
        batch,
        upper_unless_poisoned({f"q{i}" for i in poisoned}),
        POLICY,
        sleep=rec.sleep,
        on_call=rec.on_call,
    )
    assert [isinstance(o, ModelError) for o in out] == [i in poisoned for i in range(n)]
    assert all(o == f"Q{i}" for i, o in enumerate(out) if i not in poisoned)
    depth = math.ceil(math.log2(n)) if n > 1 else 0
    assert len(rec.calls) <= 1 + 2 * depth * max(1, len(poisoned))


def test_transient_errors_are_retried_with_backoff_then_succeed() -> None:
    failures = [TransientModelError("endpoint returned 503"), TransientModelError("timeout")]

    def flaky(batch: Sequence[int]) -> list[int]:
        if failures:
            raise failures.pop(0)
        return [x * 2 for x in batch]

    rec = Recorder()
    assert run_isolated([1, 2, 3], flaky, POLICY, sleep=rec.sleep, on_call=rec.on_call) == [2, 4, 6]
    assert rec.calls == [3, 3, 3]
    assert rec.sleeps == pytest.approx([0.1, 0.2])


def test_retries_exhausted_gives_every_item_model_error() -> None:
    def down(batch: Sequence[int]) -> list[int]:
        raise TransientModelError("connection refused")

    rec = Recorder()
    policy = RetryPolicy(attempts=4, initial_backoff_ms=100.0, max_backoff_ms=250.0)
    out = run_isolated(list(range(8)), down, policy, sleep=rec.sleep, on_call=rec.on_call)
    assert len(out) == 8 and all(isinstance(o, ModelError) for o in out)
    assert not isinstance(out[0], TransientModelError)
    assert "after 4 attempts" in str(out[0]) and "connection refused" in str(out[0])
    assert out[0].code == "model_error"
    assert rec.calls == [8, 8, 8, 8]  # not split: smaller calls would not help
    assert rec.sleeps == pytest.approx([0.1, 0.2, 0.25])  # capped at max_backoff_ms


def test_a_backend_that_knows_which_items_failed_fails_only_those() -> None:
    """A remote endpoint's items are calls of their own: one that timed out (after its own retries)
    fails alone, and its batch-mates keep the answers they got, in one call, with no batch retry."""
    slow = ModelError("request 2 of 4 timed out after 3 attempts")

    def per_item(batch: Sequence[str]) -> list[str]:
        raise PartialBatchError([s.upper() if s != "slow" else slow for s in batch])

    rec = Recorder()
    out = run_isolated(["a", "b", "slow", "c"], per_item, POLICY, sleep=rec.sleep, on_call=rec.on_call)
    assert out == ["A", "B", slow, "C"]
    assert rec.calls == [4] and rec.sleeps == []
    # results that do not match the batch fail it whole, as a wrong output count does
    wrong = run_isolated(["a", "b"], lambda b: (_ for _ in ()).throw(PartialBatchError(["A"])), POLICY)
    assert all(isinstance(o, ModelError) for o in wrong) and "1 results for a batch of 2" in str(wrong[0])


def test_jitter_stays_within_bounds() -> None:
    def down(batch: Sequence[int]) -> list[int]:
        raise TransientModelError("busy")

    rec = Recorder()
    policy = RetryPolicy(attempts=3, initial_backoff_ms=100.0, max_backoff_ms=1000.0, jitter_ms=50.0)
    run_isolated([1], down, policy, sleep=rec.sleep)
    assert len(rec.sleeps) == 2
    for slept, base in zip(rec.sleeps, (0.1, 0.2), strict=True):
        assert base <= slept <= base + 0.05


def test_oom_splits_until_halves_fit() -> None:
    def fits_four(batch: Sequence[int]) -> list[int]:
        if len(batch) > 4:
            raise ModelOutOfMemoryError(len(batch), "CUDA out of memory")
        return [x + 100 for x in batch]

    rec = Recorder()
    out = run_isolated(list(range(16)), fits_four, POLICY, sleep=rec.sleep, on_call=rec.on_call)
    assert out == [x + 100 for x in range(16)]
    assert rec.calls == [16, 8, 4, 4, 8, 4, 4]


def test_wrong_output_count_is_a_model_error() -> None:
    def drops_one(batch: Sequence[int]) -> list[int]:
        return [x for x in batch][:-1] if len(batch) > 1 else list(batch)

    out = run_isolated([1, 2, 3, 4], drops_one, POLICY, sleep=Recorder().sleep)
    assert out == [1, 2, 3, 4]  # split down to single items, which the model answers

    def always_empty(batch: Sequence[int]) -> list[int]:
        return []

    out = run_isolated([1, 2], always_empty, POLICY, sleep=Recorder().sleep)
    assert all(isinstance(o, ModelError) and "0 outputs for a batch of 1" in str(o) for o in out)


def test_transient_then_poisoned_mix() -> None:
    state = {"transient_left": 1}

    def infer(batch: Sequence[str]) -> list[str]:
        if state["transient_left"]:
            state["transient_left"] -= 1
            raise TransientModelError("warming up")
        if "bad" in batch:
            raise ModelError("cannot answer 'bad'")
        return [s + "!" for s in batch]

    rec = Recorder()
    out = run_isolated(["a", "bad", "c", "d"], infer, POLICY, sleep=rec.sleep, on_call=rec.on_call)
    assert out[0] == "a!" and out[2:] == ["c!", "d!"]
    assert isinstance(out[1], ModelError) and "cannot answer" in str(out[1])
    assert rec.sleeps == pytest.approx([0.1])


def test_empty_batch_makes_no_call() -> None:
    rec = Recorder()
    assert run_isolated([], upper_unless_poisoned(set()), POLICY, on_call=rec.on_call) == []
    assert rec.calls == []


def test_policy_validation() -> None:
    with pytest.raises(SettingsError, match="attempts"):
        RetryPolicy(attempts=0)
    with pytest.raises(
        SettingsError, match=r"max_backoff_ms 10\.0 must be at least initial_backoff_ms 50\.0"
    ):
        RetryPolicy(max_backoff_ms=10.0)
    assert RetryPolicy(initial_backoff_ms=10, max_backoff_ms=50, multiplier=3).backoff_ms(3) == 50
