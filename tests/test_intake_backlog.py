"""The intake's backlog as the low-class readers see it (pipeline/intake_backlog.py)."""

from __future__ import annotations

from collections.abc import Hashable

import pytest

from pipeline.intake_backlog import HOLD_RELEASE_FILL, IntakeBacklog, holding_would_block


class Watermarks(dict[Hashable, int]):
    """High watermarks as a consumer's fetcher would hold them; a missing partition is unknown."""

    def __call__(self, partition: Hashable) -> int | None:
        return self.get(partition)


def backlog(hw: Watermarks, limit_records: int = 0, stall_ms: float = 2_000) -> IntakeBacklog:
    return IntakeBacklog(limit_records=limit_records, stall_ms=stall_ms, highwater=hw)


def test_more_than_the_limit_behind_in_any_partition_is_behind() -> None:
    hw = Watermarks({"requests-0": 120, "requests-1": 40})
    b = backlog(hw, limit_records=24)
    b.record("requests-0", offset=100, now_ms=0)  # 19 waiting
    b.record("requests-1", offset=10, now_ms=0)  # 29 waiting
    assert b.behind(0)
    b.record("requests-1", offset=20, now_ms=5)  # 19 waiting: still behind until none waits
    assert b.behind(10)
    b.record("requests-0", offset=119, now_ms=6)
    b.record("requests-1", offset=39, now_ms=6)
    assert not b.behind(10)
    hw["requests-0"] = 140  # 20 arrive: under the limit, not behind again
    assert not b.behind(11)


def test_zero_lets_nothing_wait() -> None:
    hw = Watermarks({"p": 3})
    b = backlog(hw)
    b.record("p", offset=1, now_ms=0)
    assert b.behind(0)
    b.record("p", offset=2, now_ms=1)
    assert not b.behind(1)


def test_records_fetched_after_the_last_take_count() -> None:
    """An intake starved of the event loop takes records seldom: what the consumer fetched since its
    last take is waiting too, and a lag measured at the take would miss it."""
    hw = Watermarks({"p": 11})
    b = backlog(hw)
    b.record("p", offset=10, now_ms=0)
    assert not b.behind(1)  # caught up: its last take was the partition's last record
    hw["p"] = 14  # three more fetched, none taken yet
    assert b.behind(2)


def test_a_partition_quiet_for_a_while_still_holds_the_low_classes_back() -> None:
    """An intake slowed down (the event loop, Faust's producer buffer) is the one the batch and
    offline readers must yield to: a partition it took nothing from for a second still counts (an
    earlier version ignored it after one second, and batch reading resumed just then)."""
    hw = Watermarks({("requests", 3): 1_000, ("requests", 4): 10})
    b = backlog(hw, limit_records=8)
    b.record(("requests", 3), offset=0, now_ms=0)
    b.record(("requests", 4), offset=9, now_ms=1_500)  # the intake reads another partition meanwhile
    assert b.behind(1_600)
    assert b.behind(3_400)


def test_the_hold_gives_way_to_an_intake_that_takes_nothing_and_comes_back_with_it() -> None:
    """A hold must never stop the worker: when the intake takes nothing at all for ``stall_ms``
    although records wait, what holds it up is not the held readers, and they go on; once the intake
    takes a record again, the hold is back."""
    hw = Watermarks({"p": 500})
    b = backlog(hw, limit_records=8, stall_ms=2_000)
    b.record("p", offset=0, now_ms=1_000)
    assert b.behind(3_000) and b.gave_way == 0
    assert not b.behind(3_001) and b.gave_way == 1
    assert not b.behind(9_000) and b.gave_way == 1, "one stall, counted once"
    b.record("p", offset=1, now_ms=9_100)
    assert b.behind(9_100)
    assert not b.behind(11_200) and b.gave_way == 2


def test_a_partition_given_up_holds_nobody_back() -> None:
    """A revoked partition is forgotten, and one the consumer no longer has counts nothing: its next
    owner reads it, and an offset left from before must not count records this worker never takes."""
    hw = Watermarks({"p": 500, "q": 500})
    b = backlog(hw, limit_records=8)
    b.record("p", offset=0, now_ms=0)
    b.record("q", offset=499, now_ms=0)
    assert b.behind(0)
    b.forget(["p"])
    assert not b.behind(0)
    b.record("q", offset=100, now_ms=1)
    assert b.behind(1)
    del hw["q"]  # the consumer no longer has it (the rebalance not heard of yet): unknown
    assert not b.behind(1)


def test_an_unknown_high_watermark_counts_nothing() -> None:
    b = backlog(Watermarks({"q": -1}))
    b.record("p", offset=5, now_ms=0)
    b.record("q", offset=5, now_ms=0)
    assert not b.behind(0)
    with pytest.raises(ValueError, match="limit_records"):
        IntakeBacklog(limit_records=-1, stall_ms=1, highwater=Watermarks())
    with pytest.raises(ValueError, match="stall_ms"):
        IntakeBacklog(limit_records=0, stall_ms=0, highwater=Watermarks())


def test_a_reader_stops_holding_before_its_stream_buffer_can_fill() -> None:
    """Faust pauses a partition's fetch at 80 % of the stream buffer and one poll (at most a tenth of
    it) may follow: holding on stays allowed up to 90 %, beyond that a full buffer could block every
    stream of the worker."""
    assert not holding_would_block(1_638, 2_048)  # where Faust pauses
    assert not holding_would_block(1_638 + 200, 2_048)  # plus one poll of max_poll_records
    assert holding_would_block(int(HOLD_RELEASE_FILL * 2_048) + 1, 2_048)
    assert holding_would_block(2_048, 2_048)
    assert not holding_would_block(10**6, 0), "an unbounded buffer never fills"
