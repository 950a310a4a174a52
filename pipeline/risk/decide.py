"""From features to a decision: rules and the model (docs/architecture.md, "Risk: decisions").

* ``decline`` when a decline rule fires or the model's score reaches ``decline_score``;
* else ``review`` when a review rule fires or the score reaches ``review_score``;
* else ``approve``.

Reasons name every rule that fired with the feature values that made it fire, and, when the model
drove the outcome, the score against its threshold and the features that pushed it up most. The
decision is a pure function of the event, its features, the rule set and the model: an event read
again after a crash gets the same decision.

Pure: no Faust, no Kafka; the model is anything with the :class:`Scorer` interface.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from pipeline.risk.rules import Hit, RuleSet


class Scorer(Protocol):
    """What the decision needs from a model (``models/risk.py``)."""

    version: str

    def score_many(self, rows: Sequence[tuple[dict[str, Any], dict[str, Any]]]) -> list[float]:
        """Fraud probabilities of ``(event, features)`` rows."""
        ...

    def explain(
        self, event: dict[str, Any], features: dict[str, Any], top: int = 3
    ) -> list[tuple[str, float, float]]:
        """The ``top`` inputs that raised the score most: ``(name, input value, contribution)``."""
        ...


@dataclass(frozen=True, slots=True)
class Thresholds:
    review_score: float = 0.5
    decline_score: float = 0.9


@dataclass(frozen=True, slots=True)
class Verdict:
    decision: str
    score: float | None
    reasons: list[str]
    hits: list[Hit]


def decide(
    event: dict[str, Any],
    features: dict[str, Any],
    rules: RuleSet,
    score: float | None,
    thresholds: Thresholds,
    model: Scorer | None = None,
) -> Verdict:
    """The decision for one event whose model score (None: no model) is already known."""
    hits = rules.evaluate(features, event)
    reasons = [h.reason() for h in hits]
    actions = {h.action for h in hits}
    by_model = None
    if score is not None and score >= thresholds.decline_score:
        by_model = f"model score {score:.3f} >= decline threshold {thresholds.decline_score:g}"
    elif score is not None and score >= thresholds.review_score:
        by_model = f"model score {score:.3f} >= review threshold {thresholds.review_score:g}"
    if "decline" in actions or (score is not None and score >= thresholds.decline_score):
        decision = "decline"
    elif actions or (score is not None and score >= thresholds.review_score):
        decision = "review"
    else:
        decision = "approve"
    if by_model is not None:
        reasons.append(by_model)
        if model is not None:
            top = model.explain(event, features, 3)
            reasons += [f"model: {name}={_fmt(name, value)} (+{c:.2f})" for name, value, c in top if c > 0]
    return Verdict(decision, score, reasons, hits)


def _fmt(name: str, value: float) -> str:
    if value == -1 and not name.startswith("event_"):
        return "none"  # the event has no such entity
    return f"{value:.6g}"
