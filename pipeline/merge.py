"""Open leaders that later requests may join: the in-flight half of semantic dedup (pure logic).

A *leader* is a request that will make (or is making) a model call; a *follower* is a later
request that the merge decision (:mod:`pipeline.pairs`) lets share the leader's answer, in the same
scope. A follower makes no model call: it gets the leader's answer. A leader is open from the moment
it is queued until its answer is out. See docs/architecture.md ("Semantic dedup").

A follower only joins a leader at least as urgent as itself (its priority rank is not lower), so a
real-time request never waits behind a batch one.

The same registry is what :func:`pipeline.dedup.cluster` and ``surge dedup eval`` run, so what is
measured is what serves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pipeline.dedup import normalize
from pipeline.pairs import MergeDecision, ThresholdDecision, Verdict


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
    """Leaders open for joining, per scope, and the decision that lets a request join one.

    ``MergeRegistry(threshold)`` keeps the plain rule (cosine at least ``threshold`` and the strict
    guard, :class:`pipeline.pairs.ThresholdDecision`); ``MergeRegistry(decision=...)`` uses any
    :class:`pipeline.pairs.MergeDecision`, e.g. the learned one from
    :func:`pipeline.pairs.decision_from_settings`.
    """

    def __init__(self, threshold: float | None = None, *, decision: MergeDecision | None = None) -> None:
        if decision is None:
            if threshold is None:
                raise ValueError("MergeRegistry needs a threshold or a decision")
            decision = ThresholdDecision(threshold)
        self.decision: MergeDecision = decision
        self.threshold = threshold if threshold is not None else decision.cosine_floor
        self._leaders: dict[str, Leader] = {}
        self._by_scope: dict[str, list[str]] = {}

    def __len__(self) -> int:
        return len(self._leaders)

    def followers(self) -> int:
        """Requests waiting on an open leader (the inference agent's status)."""
        return sum(len(leader.followers) for leader in self._leaders.values())

    def find_verdict(
        self, scope: str, text: str, vector: np.ndarray | None, rank: int
    ) -> tuple[Leader, Verdict] | None:
        """The open leader ``text`` may join (exact match first, else the highest-scoring one the
        decision allows), with the decision's verdict."""
        norm = normalize(text)
        best: tuple[Leader, Verdict] | None = None
        floor = self.decision.cosine_floor
        for lid in self._by_scope.get(scope, ()):
            leader = self._leaders[lid]
            if leader.rank > rank:
                continue
            if leader.norm_text == norm:
                return leader, Verdict(True, 1.0, 1.0, "exact")
            cos = None
            if vector is not None and leader.vector is not None:
                cos = float(np.dot(leader.vector, vector))
                if cos < floor and self.decision.name == "threshold":
                    continue
            verdict = self.decision.decide(leader.text, text, cos)
            if verdict.merge and (best is None or verdict.score > best[1].score):
                best = (leader, verdict)
        return best

    def find(
        self, scope: str, text: str, vector: np.ndarray | None, rank: int
    ) -> tuple[Leader, float] | None:
        """Called for each new request: the best open leader it may join, with the similarity."""
        found = self.find_verdict(scope, text, vector, rank)
        return None if found is None else (found[0], found[1].similarity)

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
