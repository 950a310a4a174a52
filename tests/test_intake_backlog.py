"""The intake's backlog as the low-class readers see it (pipeline/intake_backlog.py)."""

from __future__ import annotations

from collections.abc import Hashable

import pytest

from pipeline.intake_backlog import IntakeBacklog


class Watermarks(dict[Hashable, int]):
    """High watermarks as a consumer's fetcher would hold them; a missing partition is unknown."""

    def __call__(self, partition: Hashable) -> int | None:
        return self.get(partition)


def test_more_than_the_limit_behind_in_any_partition_is_behind() -> None:
    hw = Watermarks({"requests-0": 120, "requests-1": 40})
    b = IntakeBacklog(limit_records=24, stale_ms=1_000, highwater=hw)
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
    b = IntakeBacklog(limit_records=0, stale_ms=1_000, highwater=hw)
    b.record("p", offset=1, now_ms=0)
    assert b.behind(0)
    b.record("p", offset=2, now_ms=1)
    assert not b.behind(1)


def test_records_fetched_after_the_last_take_count() -> None:
    """An intake starved of the event loop takes records seldom: what the consumer fetched since its
    last take is waiting too, and a lag measured at the take would miss it."""
    hw = Watermarks({"p": 11})
    b = IntakeBacklog(limit_records=0, stale_ms=1_000, highwater=hw)
    b.record("p", offset=10, now_ms=0)
    assert not b.behind(1)  # caught up: its last take was the partition's last record
    hw["p"] = 14  # three more fetched, none taken yet
    assert b.behind(2)


def test_a_stale_take_holds_nobody_back() -> None:
    """A partition the intake stopped reading (revoked, or the worker stopping) must not block the
    batch and offline readers for ever."""
    b = IntakeBacklog(limit_records=8, stale_ms=500, highwater=Watermarks({("requests", 3): 1_000}))
    b.record(("requests", 3), offset=0, now_ms=1_000)
    assert b.behind(1_400)
    assert not b.behind(1_600)  # behind, then stale: no longer


def test_an_unknown_high_watermark_counts_nothing() -> None:
    b = IntakeBacklog(limit_records=0, stale_ms=500, highwater=Watermarks({"q": -1}))
    b.record("p", offset=5, now_ms=0)
    b.record("q", offset=5, now_ms=0)
    assert not b.behind(0)
    with pytest.raises(ValueError, match="limit_records"):
        IntakeBacklog(limit_records=-1, stale_ms=500, highwater=Watermarks())
