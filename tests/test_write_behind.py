"""The rate-limit buckets' write-behind (pipeline/write_behind.py): pure, no Kafka."""

from __future__ import annotations

from typing import Any

import pytest

from pipeline.ratelimit import RateLimitConfig, RateLimiter, TierLimits
from pipeline.write_behind import WriteBehind


class CountingStore(dict[str, Any]):
    """A dict that counts the writes it gets (the table and its changelog records)."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[tuple[str, Any]] = []

    def __setitem__(self, key: str, value: Any) -> None:
        self.writes.append((key, value))
        super().__setitem__(key, value)


class Clock:
    def __init__(self) -> None:
        self.ms = 0.0

    def __call__(self) -> float:
        return self.ms


def test_writes_stay_in_memory_until_their_partition_is_due_then_reach_the_store_once_each() -> None:
    store, clock = CountingStore(), Clock()
    wb = WriteBehind(store, flush_ms=500, clock=clock)
    wb.partition = 2
    for n in range(10):
        wb["user:a"] = {"tokens": 10 - n}
        clock.ms += 10
    wb["tenant:t#2"] = {"tokens": 99}
    assert store.writes == [] and wb.pending(2) == 2 and wb.coalesced == 9
    assert wb.get("user:a") == {"tokens": 1}, "reads see the newest state"
    assert not wb.due(2)
    clock.ms = 500
    assert wb.due(2) and not wb.due(1)
    assert wb.flush(2) == 2
    assert store.writes == [("user:a", {"tokens": 1}), ("tenant:t#2", {"tokens": 99})]
    assert wb.pending() == 0 and not wb.due(2)
    wb["user:a"] = {"tokens": 0}  # the interval starts again at the first write after a flush
    clock.ms = 999
    assert not wb.due(2)
    clock.ms = 1000
    assert wb.due(2)


def test_reads_and_writes_are_those_of_the_current_partition() -> None:
    """As a Faust table's: a key written under one partition is not what another partition reads."""
    store = CountingStore()
    store["k"] = "stored"
    wb = WriteBehind(store, flush_ms=1000, clock=Clock())
    wb.partition = 0
    wb["k"] = "p0"
    wb.partition = 1
    assert wb.get("k") == "stored" and wb["k"] == "stored" and not wb.unflushed("k")
    wb.partition = 0
    assert wb["k"] == "p0" and wb.unflushed("k")
    assert wb.get("missing", "default") == "default"
    with pytest.raises(KeyError):
        wb["missing"]


def test_dropped_partitions_lose_their_unflushed_writes_and_a_pop_removes_both() -> None:
    store = CountingStore()
    store["gone"] = 1
    store.writes.clear()
    wb = WriteBehind(store, flush_ms=1000, clock=Clock())
    wb.partition = 3
    wb["a"] = 1
    wb["gone"] = 2
    assert wb.pop("gone") == 1 and "gone" not in store and not wb.unflushed("gone")
    assert wb.pop("never", None) is None
    assert wb.drop({3}) == 1 and wb.pending() == 0 and wb.partitions() == []
    assert wb.flush(3) == 0 and store.writes == []


def test_a_store_that_fails_keeps_the_writes_it_did_not_take_for_the_next_flush() -> None:
    class Failing(CountingStore):
        fail = True

        def __setitem__(self, key: str, value: Any) -> None:
            if self.fail and key == "b":
                raise OSError("disk")
            super().__setitem__(key, value)

    store, clock = Failing(), Clock()
    wb = WriteBehind(store, flush_ms=0, clock=clock)
    wb["a"], wb["b"], wb["c"] = 1, 2, 3
    with pytest.raises(OSError):
        wb.flush(0)
    assert store.writes == [("a", 1)] and wb.pending(0) == 2 and wb.due(0)
    store.fail = False
    assert wb.flush(0) == 2 and dict(store) == {"a": 1, "b": 2, "c": 3}


def test_a_rate_limiter_over_it_admits_and_refuses_as_over_the_store_with_far_fewer_writes() -> None:
    """The same decisions as with every write going to the store; one write per bucket per flush."""
    config = RateLimitConfig(
        users={t: TierLimits(5.0, 5.0) for t in ("free", "standard", "premium")},
        tenant=TierLimits(1000.0, 1000.0),
    )
    direct_store, behind_store, clock = CountingStore(), CountingStore(), Clock()
    direct = RateLimiter(config, direct_store)
    wb = WriteBehind(behind_store, flush_ms=500, clock=clock)
    behind = RateLimiter(config, wb)
    outcomes: dict[str, list[bool]] = {"direct": [], "behind": []}
    for n in range(200):
        now = n * 20.0  # 50 requests/s from one user against 5/s
        clock.ms = now
        for name, limiter in (("direct", direct), ("behind", behind)):
            try:
                limiter.check("alice", "standard", "acme", now)
                outcomes[name].append(True)
            except Exception:
                outcomes[name].append(False)
        if wb.due(0):
            wb.flush(0)
    assert outcomes["behind"] == outcomes["direct"]
    assert 20 < sum(outcomes["direct"]) < 40
    wb.flush(0)
    assert dict(behind_store) == dict(direct_store), "the same bucket states in the end"
    assert len(direct_store.writes) == 2 * sum(outcomes["direct"])
    assert len(behind_store.writes) <= 2 * 9, len(behind_store.writes)


def test_a_negative_interval_is_refused() -> None:
    with pytest.raises(ValueError, match="flush_ms"):
        WriteBehind({}, flush_ms=-1)
