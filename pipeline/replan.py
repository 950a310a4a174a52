"""Degradation applied to one request, at admission and again when its batch is popped (pure logic;
docs/architecture.md, "Degradation").

:func:`request_plan` is what the level in force (:func:`level_in_force`) changes for a work item.
While an item waits in the queue the level may rise; :func:`split_popped` re-plans a popped batch
and takes out the items that the rise sends to the template answer.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import cache
from typing import Protocol, TypeVar

from pipeline.degrade import DegradePlan, plan
from pipeline.records import WorkItem
from pipeline.scheduler import QueuedItem
from pipeline.terms import TIERS


class Planned(Protocol):
    """An item that carries the level it was last planned at (the agent's ``Pending`` is one)."""

    @property
    def level(self) -> int: ...


P = TypeVar("P", bound=Planned)


def level_in_force(controller_level: int, degrade_enabled: bool) -> int:
    """The level requests are planned at: the controller's, or 0 with degradation switched off."""
    return controller_level if degrade_enabled else 0


def request_plan(work: WorkItem, level: int, max_tokens_cap: int) -> DegradePlan:
    """What ``level`` changes for ``work``: its level applied, ``max_tokens``, logprobs and whether
    it gets the template answer."""
    request = work.request
    return plan(
        level, work.priority, work.tier, request.max_tokens, request.logprobs, max_tokens_cap=max_tokens_cap
    )


def templated_at_once(new_plan: DegradePlan, template_available: bool, template_needs_vectors: bool) -> bool:
    """Whether a request is answered with the template as soon as it is read, by the intake or at
    admission, rather than after the embedding stage: its plan at the level in force sends it to the
    template, the worker has one, and the template reads no vector (so the path it skips would have
    added nothing first: no embedding, no semantic match). Under level 3 a batch or offline request
    then gets its answer at once instead of waiting behind the higher classes until its deadline has
    passed (docs/architecture.md, "Degradation")."""
    return new_plan.use_template and template_available and not template_needs_vectors


@cache
def templates_whole_class(level: int, priority: str) -> bool:
    """Whether ``level`` sends every request of ``priority`` to the template, whatever its tier (at
    level 3: batch and offline). Such a class's reader is not held back by strict priority: its
    records are answered at admission and take no place in the embedding stage or the queue.
    Cached: asked before each read of a work topic, and the levels' rules never change."""
    return all(plan(level, priority, tier, 1, False).use_template for tier in TIERS)


def moves_to_template(level_before: int, new_plan: DegradePlan, template_available: bool) -> bool:
    """Whether a queued item re-planned to ``new_plan`` now gets the template answer: only when its
    applied level rose and the new plan uses the template (and there is a template model)."""
    return new_plan.level_applied > level_before and new_plan.use_template and template_available


def split_popped(
    popped: Sequence[QueuedItem],
    *,
    level: int,
    template_available: bool,
    replan: Callable[[P, int], DegradePlan],
) -> tuple[list[QueuedItem], list[P]]:
    """Re-plan a popped batch at ``level`` (the level in force): returns the items still to run and
    the payloads that now get the template answer.

    ``replan(payload, level)`` applies the plan at ``level`` to a payload (its level, parameters,
    scope and cache key) and returns it; every popped payload is re-planned, so the items kept run with the new
    parameters. At level 0 nothing is re-planned: the items run as they were planned.
    """
    if level == 0:
        return list(popped), []
    keep: list[QueuedItem] = []
    templated: list[P] = []
    for queued in popped:
        payload: P = queued.payload
        level_before = payload.level
        if moves_to_template(level_before, replan(payload, level), template_available):
            templated.append(payload)
        else:
            keep.append(queued)
    return keep, templated
