"""The intake's backlog as the low-class readers see it (pipeline/intake_backlog.py)."""

from __future__ import annotations

import time
from collections.abc import Hashable

import pytest

from pipeline.intake_backlog import IntakeBacklog


class Watermarks(dict[Hashable, int]):
    """High watermarks as a consumer's fetcher would hold them; a missing partition is unknown."""

    def __call__(self, partition: Hashable) -> int | None:
        return self.get(partition)


def test_more_than_the_limit_behind_in_any_partition_is_behind() -> None:
    hw = Watermarks({"requests-0": 120, "requests-1": 40})
    b = IntakeBacklog(limit_records=24, highwater=hw)
    b.record("requests-0", offset=100)  # 19 waiting
    b.record("requests-1", offset=10)  # 29 waiting
    assert b.behind()
    b.record("requests-1", offset=20)  # 19 waiting: still behind until none waits
    assert b.behind()
    b.record("requests-0", offset=119)
    b.record("requests-1", offset=39)
    assert not b.behind()
    hw["requests-0"] = 140  # 20 arrive: under the limit, not behind again
    assert not b.behind()


def test_zero_lets_nothing_wait() -> None:
    hw = Watermarks({"p": 3})
    b = IntakeBacklog(limit_records=0, highwater=hw)
    b.record("p", offset=1)
    assert b.behind()
    b.record("p", offset=2)
    assert not b.behind()


def test_records_fetched_after_the_last_take_count() -> None:
    """An intake starved of the event loop takes records seldom: what the consumer fetched since its
    last take is waiting too, and a lag measured at the take would miss it."""
    hw = Watermarks({"p": 11})
    b = IntakeBacklog(limit_records=0, highwater=hw)
    b.record("p", offset=10)
    assert not b.behind()  # caught up: its last take was the partition's last record
    hw["p"] = 14  # three more fetched, none taken yet
    assert b.behind()


def test_an_intake_quiet_for_long_still_holds_the_low_classes_back() -> None:
    """An intake held up for seconds (the event loop, Faust's producer buffer) is the one the batch
    and offline readers must yield to: how long ago it last took a record does not hide its backlog."""
    hw = Watermarks({("requests", 3): 1_000})
    b = IntakeBacklog(limit_records=8, highwater=hw)
    b.record(("requests", 3), offset=0)
    assert b.behind()
    time.sleep(1.2)  # longer than the old one-second staleness that ignored such a partition
    assert b.behind()


def test_a_partition_given_up_holds_nobody_back() -> None:
    """A revoked partition is forgotten, and one the consumer no longer has counts nothing: its next
    owner reads it, and an offset left from before must not count records this worker never takes."""
    hw = Watermarks({"p": 500, "q": 500})
    b = IntakeBacklog(limit_records=8, highwater=hw)
    b.record("p", offset=0)
    b.record("q", offset=499)
    assert b.behind()
    b.forget(["p"])
    assert not b.behind()
    b.record("q", offset=100)
    assert b.behind()
    del hw["q"]  # the consumer no longer has it (the rebalance not heard of yet): unknown
    assert not b.behind()


def test_an_unknown_high_watermark_counts_nothing() -> None:
    b = IntakeBacklog(limit_records=0, highwater=Watermarks({"q": -1}))
    b.record("p", offset=5)
    b.record("q", offset=5)
    assert not b.behind()
    with pytest.raises(ValueError, match="limit_records"):
        IntakeBacklog(limit_records=-1, highwater=Watermarks())
