"""What becomes of an admitted item once it is embedded (pure logic).

See docs/architecture.md, "The path of a request" and "Semantic dedup".

The inference agent takes the next embedding batch with :func:`take_arrivals` (sized by
:func:`embed_batch_limit`), embeds it, looks each item up in the cache, then asks :func:`route`
what becomes of each one. Exactly one of, in this order:

1. :class:`Cached`: the cache had an answer (only for an item that may use the cache);
2. :class:`Templated`: degradation sends it to the template answer, so it is neither merged nor
   queued;
3. :class:`Merged`: it joined an open leader in its scope, at least as urgent as itself;
4. :class:`Queued`: it is queued for a model call and, where merging is on, opened as a leader;
5. :class:`Refused`: its class's queue is full (the error carries the depth and the limit).

:func:`route` keeps the merge registry up to date (a follower joins its leader, a queued item
becomes one) and returns the decision; the agent turns it into replies and metrics.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar

import numpy as np

from pipeline.cache import CachedAnswer
from pipeline.exceptions import OverloadedError
from pipeline.merge import Leader, MergeRegistry
from pipeline.records import WorkItem
from pipeline.scheduler import QueuedItem
from pipeline.terms import PRIORITIES, RANK, Priority, Tier

#: an embedding batch is never cut below this many items, however slow embedding is measured to be
MIN_EMBED_BATCH = 4

T = TypeVar("T")


class HasText(Protocol):
    @property
    def text(self) -> str: ...


class Routable(Protocol):
    """What routing reads of an item (the agent's ``Pending`` is one)."""

    @property
    def work(self) -> WorkItem: ...

    @property
    def inp(self) -> HasText: ...

    @property
    def scope(self) -> str: ...

    @property
    def lead_id(self) -> str: ...

    @property
    def template(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class RoutingRules:
    """Which shortcuts are on: the semantic cache (switched on and present) and merging."""

    cache_on: bool
    dedup_on: bool

    def uses_cache(self, work: WorkItem) -> bool:
        """Whether this item is looked up in (and answered from) the cache."""
        return self.cache_on and work.request.cache

    def may_merge(self, work: WorkItem) -> bool:
        """Whether this item may join an open leader, or become one."""
        return self.dedup_on and work.request.cache


@dataclass(frozen=True, slots=True)
class Cached:
    """Answered from the cache, with the similarity of the cached question."""

    entry: CachedAnswer
    similarity: float


@dataclass(frozen=True, slots=True)
class Templated:
    """Sent to the template answer (degradation level 3)."""


@dataclass(frozen=True, slots=True)
class Merged:
    """Joined ``leader`` as a follower; it gets the leader's answer."""

    leader: Leader
    similarity: float


@dataclass(frozen=True, slots=True)
class Queued:
    """Queued for a model call as ``queued``."""

    queued: QueuedItem


@dataclass(frozen=True, slots=True)
class Refused:
    """Not queued: its class is full."""

    error: OverloadedError


Route = Cached | Templated | Merged | Queued | Refused


def route(
    item: Routable,
    found: tuple[CachedAnswer, float] | None,
    *,
    rules: RoutingRules,
    merges: MergeRegistry,
    enqueue: Callable[[QueuedItem], None],
    vector: np.ndarray | None,
    now_ms: float,
) -> Route:
    """Decide what becomes of ``item`` and apply it to ``merges`` and the queue.

    ``found`` is the cache lookup's answer and similarity (None for none); ``vector`` the item's
    embedding where semantic matching may use it (None: exact-text merging only). ``enqueue``
    queues a :class:`QueuedItem` (the agent's ``AsyncBatcher.put``) and raises
    :class:`OverloadedError` when the class is full. ``now_ms`` is the enqueue time.
    """
    work = item.work
    if rules.uses_cache(work) and found is not None:
        entry, similarity = found
        return Cached(entry, similarity)
    if item.template:
        return Templated()
    rank = RANK[work.priority]
    merging = rules.may_merge(work)
    if merging:
        joined = merges.find(item.scope, item.inp.text, vector, rank)
        if joined is not None:
            leader, similarity = joined
            leader.followers.append((item, similarity))
            return Merged(leader, similarity)
    queued = QueuedItem(
        item_id=item.lead_id,
        user_id=work.request.user_id,
        priority=Priority(work.priority),
        tier=Tier(work.tier),
        created_at_ms=work.created_at_ms,
        deadline_at_ms=work.deadline_at_ms,
        enqueued_at_ms=now_ms,
        payload=item,
    )
    try:
        enqueue(queued)
    except OverloadedError as exc:
        return Refused(exc)
    if merging:
        merges.open(item.lead_id, item.scope, item.inp.text, vector, rank)
    return Queued(queued)


def embed_batch_limit(max_batch_size: int, budget_ms: float, ms_per_item: float) -> int:
    """How many items the next embedding call takes: about ``budget_ms`` of measured embedding time
    (``ms_per_item``, 0 before any measurement), at most ``max_batch_size``, at least
    :data:`MIN_EMBED_BATCH`."""
    if ms_per_item <= 0:
        return max_batch_size
    return max(MIN_EMBED_BATCH, min(max_batch_size, int(budget_ms / ms_per_item)))


def take_arrivals(
    arrivals: Mapping[str, deque[T]], limit: int, expired: Callable[[T], bool]
) -> tuple[list[T], list[T]]:
    """Pop the next embedding batch from the per-class ``arrivals``: up to ``limit`` items, highest
    classes first, each class in arrival order. A batch holding real-time items holds nothing else,
    so they never wait for a long embedding call. Returns (the batch, the items ``expired`` says are
    past their deadline, met on the way). Expired items take no place in the batch: an expired
    request costs a reply, not an embedding, so a backlog of them (work read after a surge, its
    deadlines long gone) drains at the speed of replies rather than of MiniLM."""
    taken: list[T] = []
    late: list[T] = []
    for priority in PRIORITIES:
        waiting = arrivals[priority]
        while waiting and len(taken) < limit:
            item = waiting.popleft()
            (late if expired(item) else taken).append(item)
        if taken and priority == Priority.REALTIME:
            break
    return taken, late


def embed_slices(lengths: Sequence[int], chunk: int, yields: bool) -> list[list[int]]:
    """How one embedding batch is cut into calls: the indices of ``lengths`` (each text's length),
    shortest first, in slices of ``chunk`` (the embedder's forward pass) when the batch ``yields`` to
    real-time arrivals between its calls, else in one call. The embedder sorts each call by length
    itself; sorting the whole batch first keeps the slices as little padded as one call would be.
    A real-time request admitted while a 100 ms call of batch work runs then waits for one forward
    pass, not the whole call (docs/architecture.md, "Intake first")."""
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    if not yields or len(order) <= chunk:
        return [order] if order else []
    return [order[i : i + chunk] for i in range(0, len(order), chunk)]


def expired_before_embedding(deadline_at_ms: float | None, rejects_late: bool, now_ms: float) -> bool:
    """Whether an item leaves before its embedding with ``deadline_exceeded``: its deadline has passed
    (as the scheduler counts it: strictly before ``now_ms``) and its class rejects late work
    (``DeadlinePolicy.REJECT``; a class that moves late work to a lower one keeps it)."""
    return rejects_late and deadline_at_ms is not None and deadline_at_ms < now_ms
