"""The inference queue: strict priority across classes, earliest deadline first within a class,
premium ahead of others, one user's items in the order they came, and the adaptive batch window.

Pure logic: no Faust, no Kafka, no asyncio (``pipeline.batcher`` wraps it for the event loop).
Single-threaded: every method is called from the event loop that runs the inference agent. Time is
epoch milliseconds from an injectable clock, so tests drive it with a fake one.

The life of an item (modelled on vLLM v1's scheduler: the engine loop calls in, the scheduler never
calls out):

1. a reader asks ``can_admit(priority)`` before it takes more of that class (the inference agent
   applies the same rule over its whole worker, its embedding backlog included);
2. ``offer(item)`` when a work item arrives (raises ``OverloadedError`` when its class is full);
3. the batch loop asks ``ready(now)`` / ``flush_at_ms()`` to know when the window closes;
4. ``pop_batch(now)`` takes the batch (and hands back items whose deadline passed);
5. ``record_batch(size, seconds)`` after the model call, so the next window knows what a batch costs.

Steps 2-5 go through :class:`pipeline.batcher.AsyncBatcher`, which puts the scheduler on the event
loop. See docs/architecture.md, "The path of a request".

Ordering within a class is a queue policy behind :func:`make_queue_policy`: ``"edf"`` (the
default) or ``"fifo"`` (one FIFO queue over all classes, ignoring class and deadline: the baseline
the priority benchmark compares against).
"""

from __future__ import annotations

import heapq
import math
import time
from abc import ABC, abstractmethod
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from types import MappingProxyType
from typing import Any

from pipeline.batch_estimator import BatchTimeEstimator
from pipeline.exceptions import OverloadedError, SettingsError
from pipeline.terms import Priority, Tier  # defined there; still importable from here

Clock = Callable[[], float]
"""Returns the current time in epoch milliseconds."""


def wall_clock_ms() -> float:
    """The default clock: wall time in epoch milliseconds (deadlines count from ``created_at``)."""
    return time.time() * 1000.0


_PRIORITY_ORDER: tuple[Priority, ...] = tuple(Priority)

#: Defaults of :class:`SchedulerConfig`, defined here once; the matching ``Settings`` fields
#: (``deadline_<class>_ms``, ``queue_limit_per_class``, ``max_batch_size``, ``base_batch_size``,
#: ``max_wait_ms``) take their defaults from these.
DEFAULT_DEADLINE_MS: Mapping[Priority, int | None] = MappingProxyType(
    {Priority.REALTIME: 200, Priority.INTERACTIVE: 500, Priority.BATCH: 5000, Priority.OFFLINE: None}
)
DEFAULT_QUEUE_LIMIT = 512
DEFAULT_MAX_BATCH_SIZE = 32
DEFAULT_BASE_BATCH_SIZE = 8
DEFAULT_MAX_WAIT_MS = 10.0


class DeadlinePolicy(StrEnum):
    """What happens to an item whose deadline passes while it waits.

    ``REJECT``: it leaves the queue and the caller replies ``deadline_exceeded``.
    ``DELAY``: it moves to the next lower class with a fresh deadline, that class's ``deadline_ms``
    counted from the moment of the move (no deadline when that class has none). It keeps its
    ``created_at_ms`` and ``enqueued_at_ms``, and joins the lower class as a new arrival (behind that
    user's items already there). Where the lower class is full it is rejected instead.
    """

    REJECT = "reject"
    DELAY = "delay"


def _default_deadlines() -> dict[Priority, int | None]:
    return dict(DEFAULT_DEADLINE_MS)


def _default_limits() -> dict[Priority, int]:
    return {p: DEFAULT_QUEUE_LIMIT for p in Priority}


def _default_policies() -> dict[Priority, DeadlinePolicy]:
    return {p: DeadlinePolicy.REJECT for p in Priority}


@dataclass(frozen=True)
class SchedulerConfig:
    """Scheduler settings. Keys may be given as ``Priority`` or as their string values; classes left
    out keep their defaults. An invalid combination raises ``SettingsError`` naming the values."""

    deadline_ms: dict[Priority, int | None] = field(default_factory=_default_deadlines)
    queue_limit: dict[Priority, int] = field(default_factory=_default_limits)
    deadline_policy: dict[Priority, DeadlinePolicy] = field(default_factory=_default_policies)
    max_batch_size: int = DEFAULT_MAX_BATCH_SIZE
    base_batch_size: int = DEFAULT_BASE_BATCH_SIZE
    max_wait_ms: float = DEFAULT_MAX_WAIT_MS
    #: the window of a batch that would take a real-time item, counted from that item's arrival in the
    #: queue (None: ``max_wait_ms``); 0 runs a real-time item as soon as the model is free
    realtime_max_wait_ms: float | None = None
    safety_margin_ms: float = 5.0

    def __post_init__(self) -> None:
        deadlines = {**_default_deadlines(), **{Priority(k): v for k, v in self.deadline_ms.items()}}
        limits = {**_default_limits(), **{Priority(k): v for k, v in self.queue_limit.items()}}
        policies = {
            **_default_policies(),
            **{Priority(k): DeadlinePolicy(v) for k, v in self.deadline_policy.items()},
        }
        object.__setattr__(self, "deadline_ms", deadlines)
        object.__setattr__(self, "queue_limit", limits)
        object.__setattr__(self, "deadline_policy", policies)
        for p, d in deadlines.items():
            if d is not None and d <= 0:
                raise SettingsError(f"deadline_ms[{p.value}] must be > 0 ms or None, got {d}")
        for p, n in limits.items():
            if n < 1:
                raise SettingsError(f"queue_limit[{p.value}] must be at least 1, got {n}")
        lowest = _PRIORITY_ORDER[-1]
        if policies[lowest] is DeadlinePolicy.DELAY:
            raise SettingsError(
                f"deadline_policy[{lowest.value}]=delay has no lower class to move to; use reject"
            )
        if self.max_batch_size < 1:
            raise SettingsError(f"max_batch_size must be at least 1, got {self.max_batch_size}")
        if self.base_batch_size < 1:
            raise SettingsError(f"base_batch_size must be at least 1, got {self.base_batch_size}")
        if self.base_batch_size > self.max_batch_size:
            raise SettingsError(
                f"base_batch_size={self.base_batch_size} must not exceed max_batch_size={self.max_batch_size}"
            )
        if self.max_wait_ms < 0:
            raise SettingsError(f"max_wait_ms must be >= 0, got {self.max_wait_ms}")
        if self.realtime_max_wait_ms is not None and self.realtime_max_wait_ms < 0:
            raise SettingsError(f"realtime_max_wait_ms must be >= 0, got {self.realtime_max_wait_ms}")
        if self.safety_margin_ms < 0:
            raise SettingsError(f"safety_margin_ms must be >= 0, got {self.safety_margin_ms}")


@dataclass
class QueuedItem:
    """One unit of inference work as the scheduler sees it; ``payload`` is opaque to it."""

    item_id: str
    user_id: str
    priority: Priority
    tier: Tier
    created_at_ms: float
    deadline_at_ms: float | None
    """Absolute epoch ms by which inference must begin; None: no deadline."""
    enqueued_at_ms: float
    payload: Any = None


@dataclass
class PoppedBatch:
    """What ``pop_batch`` hands back.

    ``items``: the batch to run, in service order. ``expired``: items whose deadline passed (reply
    ``deadline_exceeded``). ``demoted``: items moved to a lower class under ``DeadlinePolicy.DELAY``
    (copies with the new priority and deadline; they are queued again, possibly in ``items`` already).
    ``limit``: the batch limit the batch was cut to (for the fill ratio).
    """

    items: list[QueuedItem]
    expired: list[QueuedItem] = field(default_factory=list)
    demoted: list[QueuedItem] = field(default_factory=list)
    limit: int = 1


@dataclass(eq=False)
class QueueEntry:
    """A queued item with its arrival sequence number (unique, increasing) and its sort key."""

    seq: int
    item: QueuedItem
    key: tuple[int, float]


def _own_key(item: QueuedItem) -> tuple[int, float]:
    deadline = item.deadline_at_ms if item.deadline_at_ms is not None else math.inf
    return (item.tier.rank, deadline)


class QueuePolicy(ABC):
    """The order in which queued items are taken. The scheduler owns limits, deadlines and the batch
    window; a policy only stores entries and hands them out in its order."""

    name: str = ""

    @abstractmethod
    def push(self, entry: QueueEntry) -> None:
        """Add an entry (called by ``Scheduler.offer`` and when an item is demoted)."""

    @abstractmethod
    def take(self, n: int) -> list[QueueEntry]:
        """Remove and return up to ``n`` entries in service order (called by ``pop_batch``)."""

    @abstractmethod
    def peek(self, n: int) -> list[QueueEntry]:
        """The entries ``take(n)`` would return, without removing them (called by ``flush_at_ms``)."""

    @abstractmethod
    def discard(self, entries: Iterable[QueueEntry]) -> None:
        """Remove these entries (expired ones), wherever they sit."""

    @abstractmethod
    def depth(self, priority: Priority | None = None) -> int:
        """Entries waiting in one class, or in all of them."""

    @abstractmethod
    def blocks(self, priority: Priority) -> bool:
        """True when an entry that this policy serves before any of ``priority``'s is waiting."""


class _ClassQueue:
    """One class under EDF: a FIFO per user, and a heap of each user's head keyed by (key, seq).

    Only a user's oldest item competes; the next one competes with its own key once the previous
    has left. This keeps one user's items in arrival order (a later item with an earlier deadline
    waits for its predecessor, i.e. its effective key is never below its predecessor's) without
    making the later item inherit the predecessor's deadline after the predecessor is gone.
    """

    def __init__(self) -> None:
        self.users: dict[str, deque[QueueEntry]] = {}
        self.heap: list[tuple[tuple[int, float], int, str]] = []
        self.count = 0

    def push(self, entry: QueueEntry) -> None:
        uid = entry.item.user_id
        q = self.users.get(uid)
        if q is None:
            q = self.users[uid] = deque()
        q.append(entry)
        if len(q) == 1:
            heapq.heappush(self.heap, (entry.key, entry.seq, uid))
        self.count += 1

    def take(self, n: int) -> list[QueueEntry]:
        out: list[QueueEntry] = []
        while self.heap and len(out) < n:
            _, _, uid = heapq.heappop(self.heap)
            q = self.users[uid]
            out.append(q.popleft())
            if q:
                heapq.heappush(self.heap, (q[0].key, q[0].seq, uid))
            else:
                del self.users[uid]
        self.count -= len(out)
        return out

    def peek(self, n: int) -> list[QueueEntry]:
        heap = list(self.heap)
        pos: dict[str, int] = {}
        out: list[QueueEntry] = []
        while heap and len(out) < n:
            _, _, uid = heapq.heappop(heap)
            q = self.users[uid]
            i = pos.get(uid, 0)
            out.append(q[i])
            i += 1
            pos[uid] = i
            if i < len(q):
                heapq.heappush(heap, (q[i].key, q[i].seq, uid))
        return out

    def discard(self, entries: set[int]) -> None:
        removed = 0
        for uid in list(self.users):
            q = self.users[uid]
            kept = deque(e for e in q if e.seq not in entries)
            removed += len(q) - len(kept)
            if kept:
                self.users[uid] = kept
            else:
                del self.users[uid]
        if removed:
            self.heap = [(q[0].key, q[0].seq, uid) for uid, q in self.users.items()]
            heapq.heapify(self.heap)
            self.count -= removed


class EdfPolicy(QueuePolicy):
    """Strict priority across classes; within a class (tier rank, deadline, arrival), one user's
    items in arrival order.

    With ``realtime_alone`` (the default) a batch that holds real-time items holds nothing else: a
    smaller batch finishes sooner, and real-time deadlines are the tight ones.
    """

    name = "edf"

    def __init__(self, realtime_alone: bool = True) -> None:
        self._classes: dict[Priority, _ClassQueue] = {p: _ClassQueue() for p in Priority}
        self.realtime_alone = realtime_alone

    def push(self, entry: QueueEntry) -> None:
        self._classes[entry.item.priority].push(entry)

    def _classes_for_batch(self) -> tuple[Priority, ...]:
        if self.realtime_alone and self._classes[Priority.REALTIME].count:
            return (Priority.REALTIME,)
        return _PRIORITY_ORDER

    def take(self, n: int) -> list[QueueEntry]:
        out: list[QueueEntry] = []
        for p in self._classes_for_batch():
            if len(out) >= n:
                break
            out.extend(self._classes[p].take(n - len(out)))
        return out

    def peek(self, n: int) -> list[QueueEntry]:
        out: list[QueueEntry] = []
        for p in self._classes_for_batch():
            if len(out) >= n:
                break
            out.extend(self._classes[p].peek(n - len(out)))
        return out

    def discard(self, entries: Iterable[QueueEntry]) -> None:
        by_class: dict[Priority, set[int]] = {}
        for e in entries:
            by_class.setdefault(e.item.priority, set()).add(e.seq)
        for p, seqs in by_class.items():
            self._classes[p].discard(seqs)

    def depth(self, priority: Priority | None = None) -> int:
        if priority is not None:
            return self._classes[priority].count
        return sum(c.count for c in self._classes.values())

    def blocks(self, priority: Priority) -> bool:
        return any(self._classes[p].count for p in _PRIORITY_ORDER[: priority.rank])


class FifoPolicy(QueuePolicy):
    """One FIFO queue over all classes: arrival order only, class and deadline ignored (the baseline).
    Expired items are still taken out and rejected by the scheduler, so deadline misses compare."""

    name = "fifo"

    def __init__(self) -> None:
        self._queue: deque[QueueEntry] = deque()
        self._counts: dict[Priority, int] = {p: 0 for p in Priority}

    def push(self, entry: QueueEntry) -> None:
        self._queue.append(entry)
        self._counts[entry.item.priority] += 1

    def take(self, n: int) -> list[QueueEntry]:
        out = [self._queue.popleft() for _ in range(min(n, len(self._queue)))]
        for e in out:
            self._counts[e.item.priority] -= 1
        return out

    def peek(self, n: int) -> list[QueueEntry]:
        return [self._queue[i] for i in range(min(n, len(self._queue)))]

    def discard(self, entries: Iterable[QueueEntry]) -> None:
        seqs = {e.seq for e in entries}
        if not seqs:
            return
        kept: deque[QueueEntry] = deque()
        for e in self._queue:
            if e.seq in seqs:
                self._counts[e.item.priority] -= 1
            else:
                kept.append(e)
        self._queue = kept

    def depth(self, priority: Priority | None = None) -> int:
        return len(self._queue) if priority is None else self._counts[priority]

    def blocks(self, priority: Priority) -> bool:
        return False


_POLICIES: dict[str, Callable[[], QueuePolicy]] = {"edf": EdfPolicy, "fifo": FifoPolicy}


def make_queue_policy(name: str = "edf") -> QueuePolicy:
    """A fresh queue policy by name: ``"edf"`` (default) or ``"fifo"``."""
    try:
        factory = _POLICIES[name.lower()]
    except KeyError:
        raise SettingsError(f"queue_policy={name!r} is not one of {sorted(_POLICIES)}") from None
    return factory()


class _LazyMin:
    """Min-heap of (value, seq) whose entries die when their seq leaves ``live``."""

    def __init__(self, live: Mapping[int, QueueEntry]) -> None:
        self._heap: list[tuple[float, int]] = []
        self._live = live

    def add(self, value: float, seq: int) -> None:
        heapq.heappush(self._heap, (value, seq))

    def min(self) -> tuple[float, int] | None:
        while self._heap and self._heap[0][1] not in self._live:
            heapq.heappop(self._heap)
        return self._heap[0] if self._heap else None

    def pop(self) -> tuple[float, int]:
        return heapq.heappop(self._heap)


#: how far a request's ``created_at`` may lie after its record's timestamp (clocks disagree a little)
CLOCK_SLACK_MS = 1000


def request_created_ms(
    created_at_ms: int | None, record_ms: int, now_ms: int, slack_ms: int = CLOCK_SLACK_MS
) -> int:
    """When a request's deadlines count from: its ``created_at``, else its record's timestamp, but
    never more than ``slack_ms`` after the record's timestamp or after ``now_ms`` (the worker's clock
    when it reads the record; the producer chooses the record's timestamp too). A date in the
    future would lengthen every deadline of the request (which ``deadline_ms`` may only shorten) and
    keep it from ever expiring."""
    created = record_ms if created_at_ms is None else created_at_ms
    return min(created, min(record_ms, now_ms) + slack_ms)


def client_dated(
    created_ms: int, record_ms: int, class_ms: int | None, slack_ms: int = CLOCK_SLACK_MS
) -> bool:
    """Whether a request was dated early by its client: its ``created_ms`` (``created_at``) lies
    before its record's timestamp (the broker's, on the request topic) by more than the clock slack,
    or a quarter of its class deadline when that is less. A miss of such a request says nothing of
    the pipeline's load and stays out of the degradation controller's miss rate. With the slack alone
    (1 s) a real-time request dated 190 ms early passed as on time, missed its 200 ms inside the
    worker and counted: a few dozen of them raised the level for every tenant
    (docs/architecture.md, "Degradation")."""
    allowed = slack_ms if class_ms is None else min(slack_ms, class_ms // 4)
    return created_ms < record_ms - allowed


def absolute_deadline_ms(created_at_ms: float, class_ms: int | None, request_ms: int | None) -> float | None:
    """The class deadline counted from ``created_at_ms``, shortened (never lengthened) by the
    request's own ``deadline_ms``; None when neither sets one."""
    budgets = [d for d in (class_ms, request_ms) if d is not None]
    return created_at_ms + min(budgets) if budgets else None


class Scheduler:
    """The inference queue and its batch window. Not thread-safe; call it from one event loop."""

    def __init__(
        self,
        config: SchedulerConfig | None = None,
        *,
        policy: str | QueuePolicy = "edf",
        estimator: BatchTimeEstimator | None = None,
        clock: Clock = wall_clock_ms,
    ) -> None:
        self.config = config or SchedulerConfig()
        self.policy: QueuePolicy = make_queue_policy(policy) if isinstance(policy, str) else policy
        self.estimator = estimator or BatchTimeEstimator()
        self.clock = clock
        self._seq = 0
        self._live: dict[int, QueueEntry] = {}
        self._by_deadline = _LazyMin(self._live)
        self._by_enqueue = _LazyMin(self._live)

    # -- building items -------------------------------------------------------------------------

    def make_item(
        self,
        *,
        item_id: str,
        user_id: str,
        priority: Priority | str,
        tier: Tier | str = Tier.STANDARD,
        created_at_ms: float | None = None,
        deadline_ms: int | None = None,
        payload: Any = None,
    ) -> QueuedItem:
        """Build a ``QueuedItem`` with this scheduler's class deadline (a convenience for tests and
        tools; the inference agent builds its items from the WorkItem, whose absolute deadline intake
        already computed with :func:`absolute_deadline_ms`). The deadline is the class deadline counted
        from ``created_at_ms``, shortened (never lengthened) by the request's own ``deadline_ms``;
        ``enqueued_at_ms`` is now."""
        prio = Priority(priority)
        now = self.clock()
        created = now if created_at_ms is None else created_at_ms
        deadline_at = absolute_deadline_ms(created, self.config.deadline_ms[prio], deadline_ms)
        return QueuedItem(
            item_id=item_id,
            user_id=user_id,
            priority=prio,
            tier=Tier(tier),
            created_at_ms=created,
            deadline_at_ms=deadline_at,
            enqueued_at_ms=now,
            payload=payload,
        )

    # -- admission --------------------------------------------------------------------------------

    def offer(self, item: QueuedItem) -> None:
        """Queue an item; called (through ``AsyncBatcher.put``) when it arrives from its work topic.

        Raises ``OverloadedError(priority, depth, limit)`` when its class is at ``queue_limit``.
        """
        limit = self.config.queue_limit[item.priority]
        depth = self.policy.depth(item.priority)
        if depth >= limit:
            raise OverloadedError(item.priority.value, depth, limit)
        self._push(item)

    def can_admit(self, priority: Priority) -> bool:
        """Whether a reader may take more of ``priority``, as far as this queue can tell.

        True only when that class is below its limit and (under EDF) no higher class has items
        waiting: a lower class is read only while the higher ones are empty.
        """
        if self.policy.depth(priority) >= self.config.queue_limit[priority]:
            return False
        return not self.policy.blocks(priority)

    def depth(self, priority: Priority | None = None) -> int:
        """Items waiting in one class, or in all classes."""
        return self.policy.depth(priority)

    def depths(self) -> dict[Priority, int]:
        """Items waiting per class (for the ``requests_queue_depth`` gauge)."""
        return {p: self.policy.depth(p) for p in Priority}

    # -- the window -------------------------------------------------------------------------------

    def batch_limit(self) -> int:
        """``min(max_batch_size, ceil(base_batch_size * ln(depth + 1)))``, at least 1."""
        cfg = self.config
        n = math.ceil(cfg.base_batch_size * math.log(self.policy.depth() + 1))
        return max(1, min(cfg.max_batch_size, n))

    def flush_at_ms(self) -> float | None:
        """When the current window must flush (epoch ms), None when nothing waits.

        The earliest of: the oldest waiting item's ``enqueued_at_ms + max_wait_ms``; the earliest
        deadline among the items the next batch would take, less the estimated time of a batch of
        that size and ``safety_margin_ms``; and, when that batch takes a real-time item, the oldest
        one's ``enqueued_at_ms + realtime_max_wait_ms``.
        """
        oldest = self._by_enqueue.min()
        if oldest is None:
            return None
        at = oldest[0] + self.config.max_wait_ms
        nxt = self.policy.peek(self.batch_limit())
        realtime_wait = self.config.realtime_max_wait_ms
        if realtime_wait is not None:
            realtime = [e.item.enqueued_at_ms for e in nxt if e.item.priority is Priority.REALTIME]
            if realtime:
                at = min(at, min(realtime) + realtime_wait)
        deadlines = [e.item.deadline_at_ms for e in nxt if e.item.deadline_at_ms is not None]
        if deadlines:
            start_by = min(deadlines) - self.estimator.estimate_ms(len(nxt)) - self.config.safety_margin_ms
            at = min(at, start_by)
        return at

    def ready(self, now: float | None = None) -> bool:
        """Whether a batch should be popped now: items wait and either they fill the batch limit or
        the window's flush time has come. Called by the loop each time it wakes."""
        depth = self.policy.depth()
        if depth == 0:
            return False
        if depth >= self.batch_limit():
            return True
        at = self.flush_at_ms()
        return at is not None and (self.clock() if now is None else now) >= at

    def pop_batch(self, now: float | None = None) -> PoppedBatch:
        """Take the next batch; called when ``ready`` says so (or at shutdown, to drain).

        First every item whose deadline has passed (``deadline_at_ms < now``) leaves: under REJECT it
        goes to ``expired``; under DELAY it is queued again in the next lower class (see
        ``DeadlinePolicy``) and listed in ``demoted``. Then up to ``batch_limit()`` items are taken in
        the policy's order.
        """
        now = self.clock() if now is None else now
        expired, demoted = self._expire(now)
        limit = self.batch_limit()
        taken = self.policy.take(limit)
        for e in taken:
            del self._live[e.seq]
        return PoppedBatch(items=[e.item for e in taken], expired=expired, demoted=demoted, limit=limit)

    def take_where(self, wanted: Callable[[QueuedItem], bool]) -> list[QueuedItem]:
        """Remove the waiting items ``wanted`` selects, in arrival order; called when a rebalance's
        drain gives admitted work back (its records are read again by their partition's owner)."""
        entries = sorted((e for e in self._live.values() if wanted(e.item)), key=lambda e: e.seq)
        self.policy.discard(entries)
        for e in entries:
            del self._live[e.seq]
        return [e.item for e in entries]

    def record_batch(self, size: int, seconds: float) -> None:
        """Feed the batch-time estimator; called after each model call with its size and duration."""
        self.estimator.observe(size, seconds)

    # -- internals --------------------------------------------------------------------------------

    def _push(self, item: QueuedItem) -> None:
        self._seq += 1
        entry = QueueEntry(seq=self._seq, item=item, key=_own_key(item))
        self._live[entry.seq] = entry
        self.policy.push(entry)
        self._by_enqueue.add(item.enqueued_at_ms, entry.seq)
        if item.deadline_at_ms is not None:
            self._by_deadline.add(item.deadline_at_ms, entry.seq)

    def _expire(self, now: float) -> tuple[list[QueuedItem], list[QueuedItem]]:
        late: list[QueueEntry] = []
        while (top := self._by_deadline.min()) is not None and top[0] < now:
            self._by_deadline.pop()
            late.append(self._live.pop(top[1]))
        if not late:
            return [], []
        self.policy.discard(late)
        expired: list[QueuedItem] = []
        demoted: list[QueuedItem] = []
        for e in sorted(late, key=lambda e: e.seq):
            item = e.item
            lower = item.priority.next_lower
            if (
                self.config.deadline_policy[item.priority] is DeadlinePolicy.DELAY
                and lower is not None
                and self.policy.depth(lower) < self.config.queue_limit[lower]
            ):
                budget = self.config.deadline_ms[lower]
                moved = replace(item, priority=lower, deadline_at_ms=None if budget is None else now + budget)
                self._push(moved)
                demoted.append(moved)
            else:
                expired.append(item)
        return expired, demoted
