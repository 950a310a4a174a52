"""The offset ledger: only the finished prefix of a partition is ever released for commit."""

from __future__ import annotations

import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.offsets import LedgerError, PartitionLedger, not_held


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


def test_a_gap_holds_the_run_until_the_broker_confirms_it() -> None:
    ledger: PartitionLedger[int] = PartitionLedger(start=10)
    for off in (10, 12, 15):  # 11, 13, 14: transaction markers, or records not delivered yet
        ledger.read(off, off)
    assert ledger.finish(15) == []
    assert ledger.finish(10) == [10]
    assert ledger.finish(12) == [] and ledger.hole() == 11
    with pytest.raises(LedgerError):
        ledger.skip_to(13)  # 12 was read: a skip never steps over a record that was read
    assert ledger.skip_to(12) == [12] and ledger.hole() == 13
    assert ledger.skip_to(15) == [15] and ledger.commit_point == 16 and ledger.hole() is None


def test_one_answer_of_the_broker_steps_over_every_marker_it_covers() -> None:
    """A producer writing a transaction per record leaves a marker after each: the broker's list of
    the records it holds from the hole on marks every other offset absent at once, and the run steps
    over each as it reaches it, finished records or not yet."""
    ledger: PartitionLedger[int] = PartitionLedger(start=10)
    for off in (10, 12, 14, 16):
        ledger.read(off, off)
    assert ledger.finish(10) == [10] and ledger.hole() == 11
    held = [12, 14, 16, 18]  # what the broker holds from 11 on (18: not read yet)
    assert not_held(11, held) == [11, 13, 15, 17]
    assert ledger.finish(12) == []
    assert ledger.mark_absent(not_held(11, held)) == [12] and ledger.commit_point == 14
    assert ledger.hole() is None, "14 is read and unfinished: the run waits for work, not the broker"
    assert ledger.finish(16) == [] and ledger.finish(14) == [14, 16] and ledger.commit_point == 18
    assert ledger.read(18, 18) and ledger.finish(18) == [18] and ledger.commit_point == 19
    assert ledger.mark_absent([5, 19]) == [] and ledger.commit_point == 20, "before the run: ignored"
    assert not_held(3, []) == [] and not_held(3, [3, 4]) == []


def test_records_arriving_ahead_of_the_committed_offset_wait_for_it() -> None:
    """After a rebalance the fetcher may hand over records from an older fetch position before
    those from the committed offset: nothing may be released until the start is read."""
    ledger: PartitionLedger[int] = PartitionLedger(start=5)
    for off in range(9, 17):  # ahead of the committed offset
        assert ledger.read(off, off)
    assert [ledger.finish(off) for off in range(9, 17)] == [[]] * 8
    assert ledger.hole() == 5 and ledger.commit_point is None
    for off in range(5, 17):  # then the fetch from the committed offset: 9.. are repeats
        assert ledger.read(off, off) == (off < 9)
    assert ledger.read(4, 4) is False, "before the start: already committed"
    assert ledger.finish(6) == [] and ledger.finish(5) == [5, 6]
    assert ledger.finish(7) == [7] and ledger.finish(8) == [8, *range(9, 17)]
    assert ledger.commit_point == 17


@given(st.integers(1, 40), st.integers(0, 3), st.randoms(use_true_random=False))
def test_whatever_the_arrival_order_only_the_finished_run_from_the_start_is_released(
    n: int, start: int, rnd: random.Random
) -> None:
    ledger: PartitionLedger[int] = PartitionLedger(start=start)
    arrivals = list(range(start, start + n)) * 2  # every record twice, in any order
    rnd.shuffle(arrivals)
    taken: list[int] = []
    for off in arrivals:
        if ledger.read(off, off):
            taken.append(off)
    assert sorted(taken) == list(range(start, start + n)), "each record taken on exactly once"
    rnd.shuffle(taken)
    released: list[int] = []
    finished: set[int] = set()
    for off in taken:
        finished.add(off)
        released += ledger.finish(off)
        head = next((o for o in range(start, start + n) if o not in finished), start + n)
        assert released == list(range(start, head))
    assert ledger.commit_point == start + n


def test_a_repeat_is_refused_and_unknown_offsets_are_errors() -> None:
    ledger: PartitionLedger[int] = PartitionLedger()  # no start known: the first read is the start
    assert ledger.read(5, 5) and ledger.read(7, 7)
    # a second delivery of a record in flight is not taken on again; one before the start neither
    assert not ledger.read(7, 7) and not ledger.read(5, 5) and not ledger.read(4, 4)
    with pytest.raises(LedgerError):
        ledger.finish(6)
    assert ledger.read(6, 6), "a record arriving late fills its place"
    assert ledger.finish(5) == [5]
    assert not ledger.read(5, 5), "a released offset read again stays released"
    assert ledger.finish(7) == [] and ledger.finish(6) == [6, 7] and len(ledger) == 0


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


def test_the_commit_point_follows_the_released_prefix() -> None:
    ledger: PartitionLedger[int] = PartitionLedger(start=40)
    assert ledger.commit_point is None
    for off in (40, 41, 42):
        ledger.read(off, off)
    ledger.finish(41)
    assert ledger.commit_point is None, "nothing released while the head is unfinished"
    ledger.finish(40)
    assert ledger.commit_point == 42
    ledger.finish(42)
    assert ledger.commit_point == 43


@given(
    st.lists(st.tuples(st.integers(0, 30), st.booleans()), max_size=80),
    st.one_of(st.none(), st.integers(0, 10)),
)
def test_is_repeat_tells_beforehand_what_read_refuses(
    deliveries: list[tuple[int, bool]], start: int | None
) -> None:
    """A reader drops repeat deliveries before it waits for admission room (agents/inference.py):
    ``is_repeat`` must say exactly what ``read`` would refuse, whatever was delivered, finished and
    released before (redeliveries after seeks, records ahead of the start, late arrivals)."""
    ledger: PartitionLedger[int] = PartitionLedger(start)
    for off, finish_it in deliveries:
        predicted = ledger.is_repeat(off)
        assert predicted is (not ledger.read(off, off))
        if not predicted and finish_it:
            ledger.finish(off)


def test_resume_point_is_the_first_offset_not_taken_on_from_the_next_release() -> None:
    assert PartitionLedger[None]().resume_point() is None, "no start and nothing read: unknown"
    ledger: PartitionLedger[str] = PartitionLedger(10)
    assert ledger.resume_point() == 10, "nothing read: the start"
    for offset in (10, 11, 13):  # 12 was delivered but thrown away before it was taken
        ledger.read(offset, str(offset))
    assert ledger.resume_point() == 12
    ledger.finish(10)
    ledger.finish(11)
    assert ledger.resume_point() == 12, "released offsets are behind it"
    ledger.read(12, "12")
    assert ledger.resume_point() == 14
    assert not ledger.read(13, "13 again"), "what comes again after the seek is a repeat"


def test_a_given_back_record_is_never_passed_and_no_longer_counts_as_in_flight() -> None:
    """A rebalance's drain gives back work that has not reached the model: the run stops at it (its
    next owner reads it again from the commit point), the drain no longer waits for it, and what was
    finished after it is what the same worker need not do again."""
    ledger: PartitionLedger[int] = PartitionLedger(start=100)
    for off in range(100, 105):
        ledger.read(off, off)
    assert ledger.finish(100) == [100]
    ledger.put_back(101)
    ledger.put_back(103)
    assert ledger.in_flight == 2 and ledger.given_back == 2  # 102 and 104 still in flight
    assert ledger.finish(102) == [] and ledger.finish(104) == []
    assert ledger.in_flight == 0, "nothing left for a drain to wait for"
    assert ledger.commit_point == 101, "never committed past a given-back record"
    assert len(ledger) == 2 and ledger.finished_unreleased() == {102, 104}
    assert ledger.oldest_unfinished() == 101
    assert ledger.hole() is None, "a given-back offset is not a hole to seek back to"
    assert ledger.resume_point() == 105
    assert ledger.is_repeat(101) and not ledger.read(101, 101), "delivered again: a repeat here"
    with pytest.raises(LedgerError):
        ledger.put_back(102)  # finished: nothing to give back
    with pytest.raises(LedgerError):
        ledger.put_back(107)  # never read


def test_finished_offsets_travel_in_commit_metadata_as_ranges_and_anything_else_reads_as_none() -> None:
    from pipeline.offsets import DONE_PREFIX, decode_done, encode_done

    done = {102, 103, 104, 107, 110, 111, 99, 100}  # 99 and 100 are not after the commit: left out
    meta = encode_done(done, committed=100)
    assert meta == DONE_PREFIX + "2-4,7,10-11"
    assert decode_done(meta, committed=100) == {102, 103, 104, 107, 110, 111}
    assert encode_done(set(), 5) == "" and decode_done("", 5) == set()
    for hostile in (
        "",
        "x",
        DONE_PREFIX + "a-b",
        DONE_PREFIX + "5-2",
        DONE_PREFIX + "0",
        DONE_PREFIX + "1-999999999",
    ):
        assert decode_done(hostile, 100) == set(), hostile
    many = encode_done(range(101, 100_000, 2), committed=100, max_chars=200)
    assert len(many) <= 200
    assert min(decode_done(many, 100)) == 101, "a long list keeps its lowest offsets"


@given(st.sets(st.integers(min_value=0, max_value=400)), st.integers(min_value=0, max_value=200))
def test_encode_then_decode_gives_back_the_offsets_after_the_commit(done: set[int], committed: int) -> None:
    from pipeline.offsets import decode_done, encode_done

    assert decode_done(encode_done(done, committed), committed) == {o for o in done if o > committed}
