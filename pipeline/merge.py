"""Open leaders that later requests may join: the in-flight half of semantic dedup (pure logic).

A *leader* is a request that will make (or is making) a model call; a *follower* is a later
request whose question is the same (exact normalised text, or embedding similarity at or above the
threshold with the lexical guard's consent) in the same scope. A follower makes no model call: it
gets the leader's answer. A leader is open from the moment it is queued until its answer is out.

A follower only joins a leader at least as urgent as itself (its priority rank is not lower), so a
real-time request never waits behind a batch one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.dedup import guard_allows, normalize


@dataclass
class Leader:
    leader_id: str
    scope: str
    norm_text: str
    text: str
    vector: np.ndarray | None
    rank: int  # priority rank: 0 realtime ... 3 offline
    followers: list[tuple[Any, float]] = field(default_factory=list)


class MergeRegistry:
    """Leaders open for joining, per scope."""

    def __init__(self, threshold: float) -> None:
        self.threshold = threshold
        self._leaders: dict[str, Leader] = {}
        self._by_scope: dict[str, list[str]] = {}

    def __len__(self) -> int:
        return len(self._leaders)

    def find(
        self, scope: str, text: str, vector: np.ndarray | None, rank: int
    ) -> tuple[Leader, float] | None:
        """Called for each new request: the best open leader it may join, with the similarity."""
        norm = normalize(text)
        best: tuple[Leader, float] | None = None
        for lid in self._by_scope.get(scope, ()):
            leader = self._leaders[lid]
            if leader.rank > rank:
                continue
            if leader.norm_text == norm:
                return leader, 1.0
            if vector is None or leader.vector is None:
                continue
            sim = float(np.dot(leader.vector, vector))
            if (
                sim >= self.threshold
                and (best is None or sim > best[1])
                and guard_allows(leader.text, text)[0]
            ):
                best = (leader, sim)
        return best

    def open(self, leader_id: str, scope: str, text: str, vector: np.ndarray | None, rank: int) -> Leader:
        """Called when a request becomes a leader (queued for a model call).

        A request_id already open (a redelivered duplicate) keeps its first leader.
        """
        existing = self._leaders.get(leader_id)
        if existing is not None:
            return existing
        leader = Leader(leader_id, scope, normalize(text), text, vector, rank)
        self._leaders[leader_id] = leader
        self._by_scope.setdefault(scope, []).append(leader_id)
        return leader

    def get(self, leader_id: str) -> Leader | None:
        return self._leaders.get(leader_id)

    def close(self, leader_id: str) -> list[tuple[Any, float]]:
        """Called when the leader's answer (or error) is out; returns its followers with similarities."""
        leader = self._leaders.pop(leader_id, None)
        if leader is None:
            return []
        ids = self._by_scope.get(leader.scope, [])
        if leader_id in ids:
            ids.remove(leader_id)
        if not ids:
            self._by_scope.pop(leader.scope, None)
        return leader.followers
