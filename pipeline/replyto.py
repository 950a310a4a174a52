"""Which topics a request may name as ``reply_to`` (docs/architecture.md, "Tenant isolation").

A client chooses ``reply_to``; left open, it could write into a table's changelog (corrupting the
table on its next recovery), into ``__consumer_offsets`` (the broker refuses, the source offset is
never acked and its partition never commits again), into a work topic (skipping intake), or create
a new topic per request. Only topics matching the configured pattern are allowed (by default the
replies topic and ``<prefix>replies.<suffix>``), and internal topics are refused whatever the
pattern says; and of those only topics that exist (:class:`KnownTopics`): a reply to a missing
topic would create it on a broker with ``auto.create.topics.enable`` (one new topic per request name
a client makes up) and wait for its metadata on one without. Pure: no Kafka imports.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from pipeline.exceptions import InvalidRequestError
from pipeline.terms import PRIORITIES as _PRIORITIES
from pipeline.topics import TopicNames


class ReplyToPolicy:
    """Validates ``reply_to`` names against an allow pattern and a list of internal topics."""

    def __init__(self, topics: TopicNames, app_id: str, pattern: str = "") -> None:
        self.topics = topics
        self.app_id = app_id
        self.pattern = pattern or re.escape(topics.prefix) + r"replies(\.[A-Za-z0-9_-][A-Za-z0-9._-]*)?"
        self._allow = re.compile(self.pattern)
        self._internal = {topics.requests, topics.deadletter, *(topics.work(p) for p in _PRIORITIES)}

    def internal(self, name: str) -> bool:
        """Topics no client may write to: Kafka's and Faust's own, changelogs, surge's inputs."""
        return (
            name.startswith("__")
            or name in self._internal
            or name.startswith(f"{self.app_id}-")
            or name.endswith("-changelog")
            or "__assignor" in name
            or name.startswith(f"{self.topics.prefix}work.")
            or name.startswith(f"{self.topics.prefix}risk.")
        )

    def resolve(self, reply_to: str | None) -> str:
        """The topic to reply on; raises :class:`InvalidRequestError` for a refused ``reply_to``."""
        if reply_to is None:
            return self.topics.replies
        if self.internal(reply_to) or not self._allow.fullmatch(reply_to):
            raise InvalidRequestError(
                f"reply_to {reply_to!r} is not allowed: it must match {self.pattern!r} and must not "
                "name an internal, work or changelog topic"
            )
        return reply_to

    def safe(self, reply_to: str | None) -> str:
        """``reply_to`` when allowed, else the default replies topic (for error replies)."""
        try:
            return self.resolve(reply_to)
        except InvalidRequestError:
            return self.topics.replies


#: how long a topic found to exist is believed to (it is asked about again after this), ms
FOUND_TTL_MS = 60_000
#: how long a topic found missing is believed to be (a client that creates its reply topic just
#: after naming it is refused this long), ms
MISSING_TTL_MS = 1_000
#: longest the intake waits for the broker's answer (a broker that is restarting may not answer)
PROBE_TIMEOUT_S = 2.0
#: names remembered at most (least recently asked about forgotten first): a client making up a new
#: name per request grows nothing past this
MAX_NAMES = 10_000


class KnownTopics:
    """Whether reply topics exist, as the broker answered ``probe`` (a metadata request that never
    creates the topic), each answer remembered for a while: :data:`FOUND_TTL_MS` when found,
    :data:`MISSING_TTL_MS` when missing. ``probe`` raising or taking longer than
    :data:`PROBE_TIMEOUT_S` (the broker did not answer) counts as found and is not remembered: the
    reply is then sent as before, and it is asked again next time."""

    def __init__(
        self,
        probe: Callable[[str], Awaitable[bool]],
        *,
        found_ttl_ms: float = FOUND_TTL_MS,
        missing_ttl_ms: float = MISSING_TTL_MS,
        max_names: int = MAX_NAMES,
        probe_timeout_s: float = PROBE_TIMEOUT_S,
        clock_ms: Callable[[], float] = lambda: time.monotonic() * 1000.0,
    ) -> None:
        self.probe = probe
        self.found_ttl_ms, self.missing_ttl_ms, self.max_names = found_ttl_ms, missing_ttl_ms, max_names
        self.probe_timeout_s = probe_timeout_s
        self.clock_ms = clock_ms
        self._answers: OrderedDict[str, tuple[bool, float]] = OrderedDict()
        #: metadata requests made, and those that failed or went unanswered
        self.probes = self.probe_errors = 0

    def __len__(self) -> int:
        return len(self._answers)

    async def exists(self, name: str) -> bool:
        """Called for every reply topic a request names, before anything is sent there."""
        now = self.clock_ms()
        known = self._answers.get(name)
        if known is not None and now - known[1] < (self.found_ttl_ms if known[0] else self.missing_ttl_ms):
            self._answers.move_to_end(name)
            return known[0]
        self.probes += 1
        try:
            found = await asyncio.wait_for(self.probe(name), self.probe_timeout_s)
        except Exception:  # TimeoutError included
            self.probe_errors += 1
            return True
        self._answers[name] = (found, self.clock_ms())
        self._answers.move_to_end(name)
        while len(self._answers) > self.max_names:
            self._answers.popitem(last=False)
        return found
