"""Unit tests of pipeline.routing: what becomes of an embedded item (cache, template, merge, queue or
refusal), and how the next embedding batch is taken. No Faust, no broker: the queue is the real
pure scheduler, items are small stand-ins for the agent's ``Pending``."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from itertools import count

import pytest

from pipeline.cache import CachedAnswer
from pipeline.exceptions import OverloadedError
from pipeline.merge import MergeRegistry
from pipeline.records import InferenceRequest, WorkItem
from pipeline.routing import (
    MIN_EMBED_BATCH,
    Cached,
    Merged,
    Queued,
    Refused,
    RoutingRules,
    Templated,
    embed_batch_limit,
    embed_slices,
    expired_before_embedding,
    route,
    take_arrivals,
)
from pipeline.scheduler import QueuedItem, Scheduler, SchedulerConfig
from pipeline.terms import PRIORITIES, Priority, Tier

NOW = 1_000_000.0
ALL_ON = RoutingRules(cache_on=True, dedup_on=True)
_ids = count()


@dataclass(frozen=True)
class Text:
    text: str


@dataclass
class Item:
    """What routing reads of the agent's Pending."""

    work: WorkItem
    inp: Text
    scope: str = "scope-a"
    lead_id: str = field(default_factory=lambda: f"work-0-{next(_ids)}")
    template: bool = False


def item(
    text: str = "how do I reset my password?",
    *,
    priority: Priority = Priority.INTERACTIVE,
    tier: Tier = Tier.STANDARD,
    scope: str = "scope-a",
    cache: bool = True,
    template: bool = False,
    deadline_at_ms: int | None = 2_000_000,
) -> Item:
    n = next(_ids)
    request = InferenceRequest(request_id=f"r{n}", user_id="u1", prompt=text, priority=priority, cache=cache)
    work = WorkItem(
        request=request,
        priority=priority,
        tier=tier,
        reply_to="surge.replies",
        created_at_ms=999_000,
        arrival_ms=999_500,
        deadline_at_ms=deadline_at_ms,
    )
    return Item(work, Text(text), scope=scope, template=template)


def hit(text: str = "how do I reset my password?") -> tuple[CachedAnswer, float]:
    entry = CachedAnswer("Use the reset link.", "stop", "v1", NOW - 10, "scope-a", text, "r-cached")
    return entry, 0.97


def queue(limit: int = 512) -> Scheduler:
    return Scheduler(SchedulerConfig(queue_limit={p: limit for p in Priority}))


def routed(
    it: Item,
    found: tuple[CachedAnswer, float] | None = None,
    *,
    merges: MergeRegistry,
    sched: Scheduler,
    rules: RoutingRules = ALL_ON,
) -> Cached | Templated | Merged | Queued | Refused:
    return route(it, found, rules=rules, merges=merges, enqueue=sched.offer, vector=None, now_ms=NOW)


@pytest.fixture
def merges() -> MergeRegistry:
    return MergeRegistry(0.92)


# ---- route -------------------------------------------------------------------------------------------


def test_an_item_with_nothing_to_join_is_queued_and_opens_a_leader(merges: MergeRegistry) -> None:
    sched = queue()
    it = item(priority=Priority.BATCH, tier=Tier.PREMIUM)
    decision = routed(it, merges=merges, sched=sched)
    assert isinstance(decision, Queued)
    assert decision.queued == QueuedItem(
        item_id=it.lead_id,
        user_id="u1",
        priority=Priority.BATCH,
        tier=Tier.PREMIUM,
        created_at_ms=999_000,
        deadline_at_ms=2_000_000,
        enqueued_at_ms=NOW,
        payload=it,
    )
    assert sched.depth(Priority.BATCH) == 1
    leader = merges.get(it.lead_id)
    assert leader is not None and leader.scope == "scope-a" and leader.rank == 2


def test_a_later_copy_merges_into_the_queued_leader(merges: MergeRegistry) -> None:
    sched = queue()
    first, second = item(), item()
    routed(first, merges=merges, sched=sched)
    decision = routed(second, merges=merges, sched=sched)
    assert isinstance(decision, Merged)
    assert decision.leader.leader_id == first.lead_id and decision.similarity == 1.0
    assert merges.close(first.lead_id) == [(second, 1.0)]
    assert sched.depth() == 1  # the follower makes no model call


def test_a_cache_hit_wins_over_merging(merges: MergeRegistry) -> None:
    sched = queue()
    leader = item()
    routed(leader, merges=merges, sched=sched)
    follower = item()
    entry, similarity = hit()
    decision = routed(follower, (entry, similarity), merges=merges, sched=sched)
    assert decision == Cached(entry, similarity)
    assert merges.close(leader.lead_id) == []  # it did not join the leader
    assert sched.depth() == 1


def test_a_cache_hit_wins_over_the_template(merges: MergeRegistry) -> None:
    entry, similarity = hit()
    decision = routed(item(template=True), (entry, similarity), merges=merges, sched=queue())
    assert decision == Cached(entry, similarity)


def test_a_templated_item_is_neither_merged_nor_queued(merges: MergeRegistry) -> None:
    sched = queue()
    leader = item()
    routed(leader, merges=merges, sched=sched)
    decision = routed(item(template=True), merges=merges, sched=sched)
    assert decision == Templated()
    assert merges.close(leader.lead_id) == []
    assert sched.depth() == 1 and len(merges) == 0


def test_a_merge_joins_only_within_a_scope(merges: MergeRegistry) -> None:
    sched = queue()
    routed(item(scope="tenant-a"), merges=merges, sched=sched)
    other = item(scope="tenant-b")
    decision = routed(other, merges=merges, sched=sched)
    assert isinstance(decision, Queued)
    assert len(merges) == 2 and sched.depth() == 2


def test_a_merge_never_joins_a_less_urgent_leader(merges: MergeRegistry) -> None:
    sched = queue()
    routed(item(priority=Priority.BATCH), merges=merges, sched=sched)
    decision = routed(item(priority=Priority.REALTIME), merges=merges, sched=sched)
    assert isinstance(decision, Queued)  # a real-time request never waits behind a batch one


def test_a_less_urgent_item_joins_a_more_urgent_leader(merges: MergeRegistry) -> None:
    sched = queue()
    leader = item(priority=Priority.REALTIME)
    routed(leader, merges=merges, sched=sched)
    decision = routed(item(priority=Priority.OFFLINE), merges=merges, sched=sched)
    assert isinstance(decision, Merged) and decision.leader.leader_id == leader.lead_id


def test_without_dedup_nothing_merges_and_no_leader_opens(merges: MergeRegistry) -> None:
    sched = queue()
    rules = RoutingRules(cache_on=True, dedup_on=False)
    assert isinstance(routed(item(), merges=merges, sched=sched, rules=rules), Queued)
    assert isinstance(routed(item(), merges=merges, sched=sched, rules=rules), Queued)
    assert len(merges) == 0 and sched.depth() == 2


def test_an_item_that_opts_out_of_the_cache_is_not_answered_from_it_nor_merged(
    merges: MergeRegistry,
) -> None:
    sched = queue()
    routed(item(), merges=merges, sched=sched)
    decision = routed(item(cache=False), hit(), merges=merges, sched=sched)
    assert isinstance(decision, Queued)
    assert len(merges) == 1  # it did not open a leader either


def test_with_the_cache_off_a_lookup_answer_is_not_used(merges: MergeRegistry) -> None:
    rules = RoutingRules(cache_on=False, dedup_on=True)
    decision = routed(item(), hit(), merges=merges, sched=queue(), rules=rules)
    assert isinstance(decision, Queued)


def test_a_full_queue_refuses_with_depth_and_limit_and_opens_no_leader(merges: MergeRegistry) -> None:
    sched = queue(limit=1)
    routed(item("first question"), merges=merges, sched=sched)
    refused = item("second question")
    decision = routed(refused, merges=merges, sched=sched)
    assert isinstance(decision, Refused)
    assert isinstance(decision.error, OverloadedError)
    assert (decision.error.priority, decision.error.depth, decision.error.limit) == ("interactive", 1, 1)
    assert "depth 1, limit 1" in decision.error.message
    assert merges.get(refused.lead_id) is None  # nobody may join a request that will not run
    # a later copy of the refused question, with room in the queue, is queued, not merged into it
    assert isinstance(routed(item("second question"), merges=merges, sched=queue()), Queued)


def test_a_failing_queue_is_not_taken_for_a_full_one(merges: MergeRegistry) -> None:
    def broken(queued: QueuedItem) -> None:
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        route(item(), None, rules=ALL_ON, merges=merges, enqueue=broken, vector=None, now_ms=NOW)
    assert len(merges) == 0


# ---- the embedding batch -------------------------------------------------------------------------------


def arrivals(**waiting: list[str]) -> dict[str, deque[str]]:
    return {priority: deque(waiting.get(priority, [])) for priority in PRIORITIES}


def take(waiting: dict[str, deque[str]], limit: int) -> list[str]:
    """The next embedding batch when nothing has expired."""
    taken, late = take_arrivals(waiting, limit, lambda _: False)
    assert late == []
    return taken


def test_the_arrivals_take_stops_at_real_time_items() -> None:
    waiting = arrivals(realtime=["r1", "r2"], interactive=["i1"], batch=["b1"])
    assert take(waiting, 10) == ["r1", "r2"]
    assert list(waiting["interactive"]) == ["i1"] and list(waiting["batch"]) == ["b1"]


def test_the_arrivals_take_fills_from_the_highest_class_down_in_order() -> None:
    waiting = arrivals(interactive=["i1", "i2"], batch=["b1", "b2"], offline=["o1"])
    assert take(waiting, 3) == ["i1", "i2", "b1"]
    assert list(waiting["batch"]) == ["b2"] and list(waiting["offline"]) == ["o1"]
    assert take(waiting, 3) == ["b2", "o1"]
    assert take(waiting, 3) == []


def test_expired_arrivals_leave_without_taking_a_place_in_the_embedding_batch() -> None:
    waiting = arrivals(realtime=["r1-late"], interactive=["i1-late", "i2", "i3-late", "i4"], batch=["b1"])
    taken, late = take_arrivals(waiting, 2, lambda item: item.endswith("-late"))
    # the expired real-time item does not make this a real-time batch; expired ones cost no place
    assert taken == ["i2", "i4"]
    assert late == ["r1-late", "i1-late", "i3-late"]
    assert list(waiting["batch"]) == ["b1"]
    assert take_arrivals(waiting, 2, lambda item: True) == ([], ["b1"])


@pytest.mark.parametrize(
    ("deadline_at_ms", "rejects_late", "now_ms", "expired"),
    [
        (1_000, True, 1_001, True),  # past
        (1_000, True, 1_000, False),  # exactly now: still in time, as the scheduler counts it
        (1_000, False, 5_000, False),  # a class that moves late work down keeps it
        (None, True, 10**12, False),  # offline: no deadline
    ],
)
def test_an_item_leaves_before_embedding_only_past_a_deadline_its_class_rejects_at(
    deadline_at_ms: int | None, rejects_late: bool, now_ms: float, expired: bool
) -> None:
    assert expired_before_embedding(deadline_at_ms, rejects_late, now_ms) is expired


def test_the_arrivals_take_keeps_to_the_limit_within_real_time() -> None:
    waiting = arrivals(realtime=["r1", "r2", "r3"], interactive=["i1"])
    assert take(waiting, 2) == ["r1", "r2"]
    assert take(waiting, 2) == ["r3"]
    assert take(waiting, 2) == ["i1"]


@pytest.mark.parametrize(
    ("ms_per_item", "expected"),
    [
        (0.0, 64),  # nothing measured yet: the largest call
        (10.0, 10),  # 100 ms of budget at 10 ms an item
        (0.5, 64),  # fast embedding: capped at the largest call
        (200.0, MIN_EMBED_BATCH),  # slow embedding: never below the floor
    ],
)
def test_the_embedding_batch_is_sized_by_measured_time(ms_per_item: float, expected: int) -> None:
    assert embed_batch_limit(64, 100.0, ms_per_item) == expected


def test_a_batch_that_yields_is_cut_into_forward_passes_shortest_first() -> None:
    lengths = [30, 5, 12, 40, 7, 22, 9, 18, 3, 50]
    slices = embed_slices(lengths, 4, yields=True)
    assert slices == [[8, 1, 4, 6], [2, 7, 5, 0], [3, 9]]
    assert sorted(i for part in slices for i in part) == list(range(len(lengths))), "each item once"
    assert [len(part) for part in slices] == [4, 4, 2]


def test_a_batch_that_does_not_yield_or_fits_one_pass_is_one_call() -> None:
    lengths = [30, 5, 12, 40, 7]
    assert embed_slices(lengths, 4, yields=False) == [[1, 4, 2, 0, 3]]
    assert embed_slices(lengths[:4], 4, yields=True) == [[1, 2, 0, 3]]
    assert embed_slices([], 4, yields=True) == []
    with pytest.raises(ValueError, match="chunk must be >= 1"):
        embed_slices(lengths, 0, yields=True)
