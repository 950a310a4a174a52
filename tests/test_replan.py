"""Unit tests of pipeline.replan: degradation applied at admission and again when a batch is popped
(a level rise sends to the template only the items whose new plan uses it). No Faust, no broker."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pipeline.degrade import DegradePlan
from pipeline.records import InferenceRequest, WorkItem
from pipeline.replan import (
    level_in_force,
    moves_to_template,
    request_plan,
    split_popped,
    templated_at_once,
    templates_whole_class,
)
from pipeline.scheduler import QueuedItem
from pipeline.terms import Priority, Tier

CAP = 64


@dataclass
class Item:
    """What re-planning reads and writes of the agent's Pending."""

    work: WorkItem
    level: int = 0
    max_tokens: int = 0
    replanned: int = 0


def work(priority: Priority, tier: Tier = Tier.STANDARD, *, max_tokens: int = 512) -> WorkItem:
    request = InferenceRequest(
        request_id=f"r-{priority}-{tier}", user_id="u1", prompt="hello", max_tokens=max_tokens, logprobs=True
    )
    return WorkItem(
        request=request, priority=priority, tier=tier, reply_to="r", created_at_ms=0, arrival_ms=0
    )


def replan(it: Item, level: int) -> DegradePlan:
    """What the agent's _plan does to a Pending, as far as re-planning can see."""
    new_plan = request_plan(it.work, level, CAP)
    it.level = new_plan.level_applied
    it.max_tokens = new_plan.max_tokens
    it.replanned += 1
    return new_plan


def queued(it: Item) -> QueuedItem:
    return QueuedItem(
        item_id=f"id-{id(it)}",
        user_id="u1",
        priority=it.work.priority,
        tier=it.work.tier,
        created_at_ms=0,
        deadline_at_ms=None,
        enqueued_at_ms=0,
        payload=it,
    )


def admitted(priority: Priority, tier: Tier = Tier.STANDARD, level: int = 0) -> Item:
    it = Item(work(priority, tier))
    replan(it, level)
    it.replanned = 0
    return it


def test_the_level_in_force_is_zero_with_degradation_off() -> None:
    assert level_in_force(3, degrade_enabled=True) == 3
    assert level_in_force(3, degrade_enabled=False) == 0


def test_a_request_plan_reads_the_work_item() -> None:
    realtime = request_plan(work(Priority.REALTIME), 3, CAP)
    assert realtime == DegradePlan(level_applied=2, max_tokens=CAP, logprobs=False, use_template=False)
    offline = request_plan(work(Priority.OFFLINE), 1, CAP)
    assert offline == DegradePlan(level_applied=1, max_tokens=512, logprobs=False, use_template=False)


def test_at_level_zero_nothing_is_replanned() -> None:
    items = [admitted(Priority.BATCH), admitted(Priority.REALTIME)]
    popped = [queued(it) for it in items]
    keep, templated = split_popped(popped, level=0, template_available=True, replan=replan)
    assert keep == popped and templated == []
    assert [it.replanned for it in items] == [0, 0]


def test_a_level_rise_moves_only_items_whose_new_plan_uses_the_template() -> None:
    batch = admitted(Priority.BATCH)
    offline = admitted(Priority.OFFLINE)
    free = admitted(Priority.INTERACTIVE, Tier.FREE)
    premium = admitted(Priority.INTERACTIVE, Tier.PREMIUM)
    realtime = admitted(Priority.REALTIME)
    popped = [queued(it) for it in (batch, realtime, free, premium, offline)]
    keep, templated = split_popped(popped, level=3, template_available=True, replan=replan)
    assert templated == [batch, free, offline]
    assert [q.payload for q in keep] == [realtime, premium]
    # the items kept run with the new plan: level 2, max_tokens capped
    assert (realtime.level, realtime.max_tokens) == (2, CAP)
    assert (premium.level, premium.max_tokens) == (2, CAP)


def test_a_rise_below_the_template_level_moves_nothing_but_replans_all() -> None:
    items = [admitted(Priority.BATCH), admitted(Priority.REALTIME)]
    popped = [queued(it) for it in items]
    keep, templated = split_popped(popped, level=2, template_available=True, replan=replan)
    assert keep == popped and templated == []
    assert [(it.level, it.max_tokens, it.replanned) for it in items] == [(2, CAP, 1), (2, CAP, 1)]


def test_without_a_template_model_every_item_runs() -> None:
    batch = admitted(Priority.BATCH)
    keep, templated = split_popped([queued(batch)], level=3, template_available=False, replan=replan)
    assert [q.payload for q in keep] == [batch] and templated == []
    assert batch.level == 3  # re-planned all the same


def test_an_item_already_planned_at_the_template_level_is_not_moved_again() -> None:
    # the level did not rise since it was planned: nothing changes for it, it stays in the batch
    batch = admitted(Priority.BATCH, level=3)
    keep, templated = split_popped([queued(batch)], level=3, template_available=True, replan=replan)
    assert [q.payload for q in keep] == [batch] and templated == []


@pytest.mark.parametrize(
    ("before", "level_applied", "use_template", "available", "moves"),
    [
        (0, 3, True, True, True),
        (3, 3, True, True, False),  # no rise
        (0, 2, False, True, False),  # rose, but no template in the new plan
        (0, 3, True, False, False),  # no template model
    ],
)
def test_moves_to_template(
    before: int, level_applied: int, use_template: bool, available: bool, moves: bool
) -> None:
    new_plan = DegradePlan(level_applied, 16, False, use_template)
    assert moves_to_template(before, new_plan, available) is moves


@pytest.mark.parametrize(
    ("priority", "tier", "level", "available", "needs_vectors", "sheds"),
    [
        (Priority.BATCH, Tier.STANDARD, 3, True, False, True),
        (Priority.OFFLINE, Tier.PREMIUM, 3, True, False, True),
        (Priority.INTERACTIVE, Tier.FREE, 3, True, False, True),
        (Priority.INTERACTIVE, Tier.STANDARD, 3, True, False, False),  # level 3 caps it at 2
        (Priority.REALTIME, Tier.FREE, 3, True, False, False),  # never templated
        (Priority.BATCH, Tier.STANDARD, 2, True, False, False),  # below the template level
        (Priority.BATCH, Tier.STANDARD, 3, False, False, False),  # no template to answer with
        (Priority.BATCH, Tier.STANDARD, 3, True, True, False),  # the inference path embeds it first
    ],
)
def test_only_what_the_inference_path_would_template_unembedded_is_templated_at_once(
    priority: Priority, tier: Tier, level: int, available: bool, needs_vectors: bool, sheds: bool
) -> None:
    new_plan = request_plan(work(priority, tier), level, CAP)
    assert templated_at_once(new_plan, available, needs_vectors) is sheds
    # whatever the intake sheds, the inference path would have sent to the template
    assert not sheds or (new_plan.use_template and new_plan.level_applied == 3)


@pytest.mark.parametrize("level", [0, 1, 2, 3])
@pytest.mark.parametrize("priority", list(Priority))
def test_a_whole_class_is_templated_only_at_level_3_and_only_below_interactive(
    level: int, priority: Priority
) -> None:
    whole = templates_whole_class(level, priority)
    assert whole is (level == 3 and priority in (Priority.BATCH, Priority.OFFLINE))
    # never claimed for a class where some tier would not get the template
    tiers_templated = [request_plan(work(priority, tier), level, CAP).use_template for tier in Tier]
    assert not whole or all(tiers_templated)
