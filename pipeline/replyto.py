"""Which topics a request may name as ``reply_to`` (docs/architecture.md, "Tenant isolation").

A client chooses ``reply_to``; left open, it could write into a table's changelog (corrupting the
table on its next recovery), into ``__consumer_offsets`` (the broker refuses, the source offset is
never acked and its partition never commits again), into a work topic (skipping intake), or create
a new topic per request. Only topics matching the configured pattern are allowed (by default the
replies topic and ``<prefix>replies.<suffix>``), and internal topics are refused whatever the
pattern says. Pure: no Kafka imports.
"""

from __future__ import annotations

import re

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
