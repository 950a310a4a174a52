"""The intake's triage queue (pipeline/triage.py): highest class first, in order within a class,
bounded in records and bytes, and records of revoked partitions taken out."""

from __future__ import annotations

import pytest

from pipeline.terms import Priority
from pipeline.triage import TriageQueue


def drain(q: TriageQueue[str]) -> list[str]:
    out = []
    while q:
        out.append(q.pop())
    return out


def test_the_highest_class_leaves_first_and_each_class_keeps_its_order() -> None:
    q: TriageQueue[str] = TriageQueue(len(Priority) + 1, 100, 1 << 20)
    undecodable = len(Priority)  # the agent's rank for a record that is no request
    arrivals = [
        (Priority.BATCH.rank, "b1"),
        (Priority.OFFLINE.rank, "o1"),
        (Priority.INTERACTIVE.rank, "i1"),
        (Priority.BATCH.rank, "b2"),
        (Priority.REALTIME.rank, "r1"),
        (undecodable, "bad1"),
        (Priority.INTERACTIVE.rank, "i2"),
        (Priority.REALTIME.rank, "r2"),
    ]
    for rank, item in arrivals:
        q.put(rank, item, 10)
    assert drain(q) == ["r1", "r2", "i1", "i2", "b1", "b2", "o1", "bad1"]
    assert len(q) == 0 and q.queued_bytes == 0


def test_overtakes_count_only_items_served_ahead_of_an_older_one() -> None:
    q: TriageQueue[str] = TriageQueue(4, 100, 1 << 20)
    q.put(0, "r1", 1)
    q.put(2, "b1", 1)
    assert q.pop() == "r1" and q.overtakes == 0  # queued before b1: no one overtaken
    q.put(0, "r2", 1)
    assert q.pop() == "r2" and q.overtakes == 1  # b1 was older
    assert q.pop() == "b1" and q.overtakes == 1


def test_the_queue_is_bounded_in_records_and_bytes_but_always_lets_one_in() -> None:
    q: TriageQueue[str] = TriageQueue(4, 3, 100)
    assert q.has_room(5_000)  # empty: one record passes however large
    q.put(1, "huge", 5_000)
    assert not q.has_room(1)
    q.pop()
    for i in range(3):
        assert q.has_room(30)
        q.put(1, f"i{i}", 30)
    assert not q.has_room(1)  # three records: full by count
    q.pop()
    assert q.has_room(40) and not q.has_room(41)  # 60 of 100 bytes queued
    assert q.queued_bytes == 60


def test_records_of_revoked_partitions_are_taken_out_and_the_rest_keep_their_order() -> None:
    q: TriageQueue[tuple[int, str]] = TriageQueue(4, 100, 1 << 20)
    for part, rank, name in [(0, 2, "a"), (1, 2, "b"), (0, 0, "c"), (1, 0, "d"), (0, 2, "e")]:
        q.put(rank, (part, name), 7)
    gone = q.remove_if(lambda item: item[0] == 1)
    assert sorted(name for _, name in gone) == ["b", "d"]
    assert len(q) == 3 and q.queued_bytes == 21
    assert [q.pop()[1] for _ in range(3)] == ["c", "a", "e"]


def test_pop_from_an_empty_queue_and_bad_bounds_fail_loudly() -> None:
    with pytest.raises(IndexError):
        TriageQueue[str](4, 1, 1).pop()
    with pytest.raises(ValueError):
        TriageQueue[str](4, 0, 1)


def test_a_queue_of_one_handles_records_in_the_order_read() -> None:
    """``max_records`` 1: the reader waits for each record to be handled before it takes the next,
    so nothing is ever reordered."""
    q: TriageQueue[str] = TriageQueue(4, 1, 1 << 20)
    order = []
    for rank, name in [(3, "o"), (0, "r"), (2, "b")]:
        assert q.has_room(1)
        q.put(rank, name, 1)
        assert not q.has_room(1)
        order.append(q.pop())
    assert order == ["o", "r", "b"] and q.overtakes == 0
