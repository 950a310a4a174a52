"""Topic names (docs/architecture.md, "Topics"), with the configured prefix."""

from __future__ import annotations

from dataclasses import dataclass

from pipeline.terms import PRIORITIES


@dataclass(frozen=True, slots=True)
class TopicNames:
    prefix: str = "surge."

    @property
    def requests(self) -> str:
        return f"{self.prefix}requests"

    @property
    def replies(self) -> str:
        return f"{self.prefix}replies"

    @property
    def deadletter(self) -> str:
        return f"{self.prefix}deadletter"

    @property
    def risk_events(self) -> str:
        return f"{self.prefix}risk.events"

    @property
    def risk_decisions(self) -> str:
        return f"{self.prefix}risk.decisions"

    @property
    def risk_rules(self) -> str:
        """Compacted, keyed by rule id: the rules every risk worker applies."""
        return f"{self.prefix}risk.rules"

    @property
    def risk_late(self) -> str:
        """Risk events later than the grace period."""
        return f"{self.prefix}risk.late"

    def risk(self) -> list[str]:
        """The risk path's topics (the rules topic is compacted)."""
        return [self.risk_events, self.risk_decisions, self.risk_rules, self.risk_late]

    def work(self, priority: str) -> str:
        """Work topic of one priority class."""
        if priority not in PRIORITIES:
            raise ValueError(f"unknown priority {priority!r}; one of {PRIORITIES}")
        return f"{self.prefix}work.{priority}"

    def all(self) -> list[str]:
        """Every topic surge itself reads or writes (not the changelogs Faust creates)."""
        return [self.requests, *(self.work(p) for p in PRIORITIES), self.replies, self.deadletter]
