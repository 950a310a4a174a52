"""The offset ledger: only the finished prefix of a partition is ever released for commit."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.offsets import LedgerError, PartitionLedger


def test_out_of_order_finish_holds_back_until_the_head_is_done() -> None:
    ledger: PartitionLedger[str] = PartitionLedger()
    for off in (31, 32, 33):
        ledger.read(off, f"r{off}")
    # Faust would commit 34 here (its off-by-one): 31 is unfinished, so nothing may be released
    assert ledger.finish(32) == []
    assert ledger.finish(33) == []
    assert ledger.oldest_unfinished() == 31
    assert ledger.finish(31) == ["r31", "r32", "r33"]
    assert len(ledger) == 0 and ledger.oldest_unfinished() is None


def test_offset_zero_head_is_respected() -> None:
    ledger: PartitionLedger[int] = PartitionLedger()
    for off in range(5):
        ledger.read(off, off)
    assert ledger.finish(4) == []
    assert ledger.finish(0) == [0]
    assert ledger.finish(1) == [1]


def test_gaps_in_offsets_are_fine() -> None:
    ledger: PartitionLedger[int] = PartitionLedger()
    for off in (10, 12, 15):  # compaction or transaction markers
        ledger.read(off, off)
    assert ledger.finish(15) == []
    assert ledger.finish(10) == [10]
    assert ledger.finish(12) == [12, 15]


def test_rereading_and_unknown_offsets_are_errors() -> None:
    ledger: PartitionLedger[int] = PartitionLedger()
    ledger.read(5, 5)
    with pytest.raises(LedgerError):
        ledger.read(5, 5)
    with pytest.raises(LedgerError):
        ledger.finish(6)
    assert 5 in ledger and 6 not in ledger


@given(st.integers(1, 60), st.randoms(use_true_random=False))
def test_released_is_always_a_prefix_in_order(n: int, rnd: random.Random) -> None:
    ledger: PartitionLedger[int] = PartitionLedger()
    for off in range(n):
        ledger.read(off, off)
    order = list(range(n))
    rnd.shuffle(order)
    released: list[int] = []
    finished: set[int] = set()
    for off in order:
        finished.add(off)
        released += ledger.finish(off)
        # everything released is finished, in order, and is exactly the finished prefix
        assert released == list(range(len(released)))
        assert len(released) == next((i for i in range(n) if i not in finished), n)
    assert released == list(range(n))
