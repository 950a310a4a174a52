"""The lexical guard under hostile input (docs/architecture.md, "Security"): its patterns stay linear
on long runs of what they repeat, it reads a bounded prefix of a text, and its features cache is
bounded by bytes. Times are measured inside the tests: the failure they guard against is tens of
seconds where the code takes milliseconds."""

from __future__ import annotations

import re
import time
import tracemalloc
from collections.abc import Iterator

import pytest

from pipeline import guard
from pipeline.guard import GUARD_TEXT_CHARS, features, guard_allows, hard_conflict
from pipeline.merge import MergeRegistry
from pipeline.pairs import decision_from_settings
from pipeline.settings import Settings

#: the content limit: the longest message a client can send
CONTENT = 32 * 1024

#: runs that made a pattern backtrack quadratically (39 s on the 'x' run, 42 s on the digits)
LONG_RUNS = {
    "x": "x" * CONTENT,
    "stars": "*" * CONTENT,
    "digits": "1" * CONTENT,
    "x then digit": ("x" * 127 + "1") * (CONTENT // 128),
    "stars and x": ("*x" * (CONTENT // 2)),
    "digits and dots": ("1" * 63 + ".") * (CONTENT // 64),
    "digits and slashes": "1/" + "1" * (CONTENT - 2),
}


@pytest.fixture(autouse=True)
def _fresh_features() -> Iterator[None]:
    features.cache_clear()
    yield
    features.cache_clear()


def _seconds(call: object, *args: object) -> float:
    assert callable(call)
    start = time.perf_counter()
    call(*args)
    return time.perf_counter() - start


@pytest.mark.parametrize("name", sorted(LONG_RUNS))
@pytest.mark.parametrize(
    "pattern", ["_DATE_RE", "_MASKED_RE", "_NUMBER_RE", "_TIMES_RE", "_WORD_RE", "_TOKEN_RE"]
)
def test_guard_patterns_are_linear_on_long_runs(pattern: str, name: str) -> None:
    """Each pattern, on the whole 32 KiB run (not only the part :func:`features` reads)."""
    regex: re.Pattern[str] = getattr(guard, pattern)
    text = LONG_RUNS[name]
    assert _seconds(regex.findall, text) < 0.5
    assert _seconds(regex.sub, " ", text) < 0.5


@pytest.mark.parametrize("name", sorted(LONG_RUNS))
def test_features_of_a_long_run_take_milliseconds(name: str) -> None:
    assert _seconds(features, LONG_RUNS[name]) < 0.5


def test_features_read_the_first_guard_text_chars_characters() -> None:
    """Words, numbers and references past the bound are not read; the rest of the text is compared whole."""
    head = " ".join(f"word{chr(97 + i % 26)}{chr(97 + i // 26 % 26)}" for i in range(GUARD_TEXT_CHARS))
    head = head[: GUARD_TEXT_CHARS - 1] + " "
    long = features(head + "not 42 " * 4000)
    assert long.negations == 0 and long.numbers == ()
    assert len(long.words) < GUARD_TEXT_CHARS // 4
    assert long.rest and features(head).rest == ""


def test_texts_that_differ_past_the_bound_never_merge() -> None:
    """What the guard does not read must be the same: a long prompt that ends differently is another
    question (the embedder reads a prefix too)."""
    prefix = "here is the statement of my account for the last month. " * 40
    assert len(prefix) > GUARD_TEXT_CHARS
    # no word of the guard's lists tells these apart: read whole, they were allowed
    a, b = prefix + "summarise it in French", prefix + "translate it into French"
    assert guard_allows(a, b) == (False, f"texts differ past the first {GUARD_TEXT_CHARS} characters")
    assert hard_conflict(a, b) is not None
    assert guard_allows(prefix + "lock my card", prefix + "unlock my card")[0] is False
    assert guard_allows(a, a.upper()) == (True, None)
    assert hard_conflict(prefix + "thanks", prefix + "Thanks") is None


def test_the_pair_features_read_what_the_guard_reads_and_the_guard_keeps_the_rest_apart() -> None:
    """The learned decision's profile reads the first PROFILE_TEXT_CHARS of a normalised text (it
    read all 32 KiB: half a second of the event loop per new long request); two texts alike there
    and different past it still never merge, and alike throughout they do."""
    from pipeline.pairs import PROFILE_TEXT_CHARS, IdfTable, build_profile

    assert PROFILE_TEXT_CHARS == GUARD_TEXT_CHARS
    prefix = "my card payment was declined at the shop and i was charged twice for it. " * 40
    a, b = prefix + "refund the first charge", prefix + "keep both charges and close my account"
    idf = IdfTable.uniform()
    pa, pb = build_profile(a, idf), build_profile(b, idf)
    assert pa.normalized != pb.normalized  # exact matches still compare whole texts
    assert pa.content == pb.content and pa.n_units == pb.n_units
    assert pa.gram_keys.tolist() == pb.gram_keys.tolist()
    assert pa.gram_weights.tolist() == pb.gram_weights.tolist()
    decision = decision_from_settings(Settings())
    verdict = decision.decide(a, b, 0.99)
    assert not verdict.merge and "differ past the first" in verdict.reason, verdict
    assert decision.decide(a, a + " ", 0.99).merge


def test_merge_find_on_two_long_runs_takes_milliseconds() -> None:
    """The merge check runs on the worker's event loop: two requests of one scope, each 32 KiB."""
    registry = MergeRegistry(decision=decision_from_settings(Settings()))
    for name, run in LONG_RUNS.items():
        a = "我的卡被锁了怎么办" + run[: CONTENT - 27]
        b = "我的卡被冻结了怎么办" + run[: CONTENT - 30]
        registry.open(f"t/{name}@1", name, a, None, 1)
        assert _seconds(registry.find, name, b, None, 1) < 0.5, name


def test_features_cache_is_bounded_by_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """8,192 long texts would keep 32 KiB each as keys alone: the cache counts bytes, not only entries."""
    budget = 1 << 20
    monkeypatch.setattr(features, "max_bytes", budget, raising=False)
    tracemalloc.start()
    try:
        for i in range(200):
            features(f"{i} " + "x" * (CONTENT - 8))  # the text is dropped unless the cache keeps it
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held < budget * 3 // 2, held  # 6.6 MiB when the count (8,192) was the only bound
    # a question is still cached
    features("how do i lock my card")
    hits = features.cache_info().hits
    features("how do i lock my card")
    assert features.cache_info().hits == hits + 1
