"""Records of the risk path (docs/architecture.md, "Risk"): JSON, UTF-8, validated with pydantic.

* :class:`RiskEvent` on ``surge.risk.events``, key = ``account``;
* :class:`RiskDecision` on ``surge.risk.decisions``, key = ``account``;
* :class:`LateEvent` on ``surge.risk.late``, key = ``account``.

Decoding raises :class:`InvalidRiskEventError` only, whose message says what was wrong and what the
limit is; :func:`salvage_event_ids` recovers ``event_id``/``account`` from a record that failed
validation so that it can still get an error decision.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from pipeline.exceptions import InvalidRequestError
from pipeline.records import (
    ErrorInfo,
    check_key,
    check_size,
    describe,
    salvage_object,
    salvaged_id,
    without_bom,
)

EventType = Literal["payment", "transfer", "login"]
Outcome = Literal["approve", "review", "decline", "error"]
#: the entities features are kept for, in the order an event visits them
ENTITY_KINDS: tuple[str, ...] = ("account", "card", "device", "ip")
#: largest amount an event may carry, in currency units
MAX_AMOUNT = 1e9

Id = Annotated[str, Field(min_length=1, max_length=128)]


#: default of ``SURGE_RISK_MAX_AHEAD_MS``: the latest an event may be dated after the worker's clock
MAX_AHEAD_MS = 5_000


class InvalidRiskEventError(InvalidRequestError):
    """A risk event that cannot be decoded or fails validation."""


class EventAheadOfClockError(InvalidRiskEventError):
    """A risk event dated further after the worker's clock than ``SURGE_RISK_MAX_AHEAD_MS``."""

    def __init__(self, account: str, event_time_ms: int, now_ms: int, limit_ms: int) -> None:
        ahead = event_time_ms - now_ms
        super().__init__(
            f"event_time_ms {event_time_ms} is {ahead} ms after this worker's clock; at most {limit_ms} ms "
            f"is accepted (a later time would move account {account[:80]!r}'s latest event past every "
            "on-time event, and those would be late)"
        )
        self.event_time_ms, self.now_ms, self.ahead_ms, self.limit_ms = event_time_ms, now_ms, ahead, limit_ms


def check_event_time(event: RiskEvent, now_ms: int, max_ahead_ms: int) -> RiskEvent:
    """``event``, unless it is dated more than ``max_ahead_ms`` after ``now_ms`` (the worker's clock):
    then :class:`EventAheadOfClockError`. An account's latest event time only moves forward, and an
    event more than the grace period behind it is late (added to no feature), so one event dated
    far ahead would leave every later on-time event of its account unscored by its features until
    the clock caught up. docs/architecture.md, "Risk: features"."""
    if event.event_time_ms - now_ms > max_ahead_ms:
        raise EventAheadOfClockError(event.account, event.event_time_ms, now_ms, max_ahead_ms)
    return event


class RiskEvent(BaseModel):
    """One payment, transfer or login, as producers write it to ``surge.risk.events``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    event_id: Id
    type: EventType
    account: Id
    card: Id | None = None
    device: Id | None = None
    ip: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    #: strict: a JSON number (an integer is taken as a float), never a string or a boolean
    amount: Annotated[float, Field(ge=0, le=MAX_AMOUNT, allow_inf_nan=False, strict=True)] = 0.0
    currency: Annotated[str, Field(pattern=r"^[A-Z]{3}$")] = "EUR"
    merchant: Id | None = None
    country: Annotated[str, Field(pattern=r"^[A-Z]{2}$")]
    event_time_ms: Annotated[int, Field(ge=0, le=10**13, strict=True)]

    @model_validator(mode="after")
    def _by_type(self) -> RiskEvent:
        if self.type == "payment" and self.card is None:
            raise ValueError("a payment needs a card")
        if self.type == "login" and self.amount != 0:
            raise ValueError(f"a login carries no amount, got {self.amount:g}")
        return self


class RiskTimings(BaseModel):
    model_config = ConfigDict(frozen=True)

    #: the event's own time (what the windows use)
    event_time_ms: int
    #: the record's timestamp on surge.risk.events (when the producer sent it)
    produced_ms: int
    #: when the decision was made
    decided_ms: int
    #: decided_ms - produced_ms
    produce_to_decision_ms: float
    #: escalated decisions: from the local decision to the final one (the model path's round trip)
    escalation_ms: float | None = None


class Escalation(BaseModel):
    """How an escalated decision was made (docs/architecture.md, "Risk: escalation")."""

    model_config = ConfigDict(frozen=True)

    #: the id of the request put to the model path (a keyed hash of the event id)
    request_id: str
    #: answered, not_applied (milder than the local decision), unparsed, template, error, unanswered
    outcome: str
    #: the decision the risk worker made on its own
    local_decision: Outcome
    #: the decision the model's answer named, when it named one
    answer: Outcome | None = None


class RiskDecision(BaseModel):
    """One decision per event, on ``surge.risk.decisions`` keyed by account."""

    model_config = ConfigDict(frozen=True)

    event_id: str
    account: str
    decision: Outcome
    #: the model's fraud probability; None when no model ran (late or invalid events, model off)
    score: float | None = None
    #: the rules and features behind the decision, e.g. ``rule card_testing@2: card_small_1m=4 >= 3``
    reasons: list[str] = []
    rule_version: str | None = None
    model_version: str | None = None
    #: every feature value the rules and the model saw (None: the event has no such entity)
    features: dict[str, float | int | None] = {}
    late: bool = False
    error: ErrorInfo | None = None
    timings: RiskTimings | None = None
    #: which path decided: ``local`` (rules and the model in the risk worker) or ``model`` (the request
    #: path's model, asked about a borderline decision: docs/architecture.md, "Risk: escalation")
    path: Literal["local", "model"] = "local"
    #: escalated decisions only: how the escalation went
    escalation: Escalation | None = None

    def same_as(self, other: RiskDecision) -> bool:
        """Equal apart from timings: what a decision repeated after a crash must satisfy."""
        return self.model_dump(exclude={"timings"}) == other.model_dump(exclude={"timings"})


class LateEvent(BaseModel):
    """An event later than the grace period, for operators (``surge.risk.late``)."""

    model_config = ConfigDict(frozen=True)

    event: dict[str, Any]
    #: the account's latest event time when this one arrived
    watermark_ms: int
    late_by_ms: int
    grace_ms: int
    source_partition: int
    source_offset: int


def decode_event(raw: bytes | None, key: bytes | None, *, max_record_bytes: int) -> RiskEvent:
    """Decode and validate one event record; raises :class:`InvalidRiskEventError` only."""
    raw = check_size(raw, max_record_bytes, InvalidRiskEventError)
    try:
        ev = RiskEvent.model_validate_json(without_bom(raw))
    except ValidationError as exc:
        kinds = {e["type"] for e in exc.errors()}
        if kinds & {"json_invalid", "json_type"}:
            raise InvalidRiskEventError(f"record is not a valid JSON object: {describe(exc)}") from exc
        raise InvalidRiskEventError(f"invalid risk event: {describe(exc)}") from exc
    except (ValueError, RecursionError) as exc:  # pragma: no cover - pydantic wraps these
        raise InvalidRiskEventError(f"record is not valid JSON: {exc}") from exc
    if key is None:
        # an account's features live on the partition its id hashes to; an event without a key lands
        # on any partition and would be counted in a second state of its account there, out of sight of
        # the velocity rules (docs/architecture.md, "Risk")
        raise InvalidRiskEventError(
            f"the record has no key; key risk events by their account ({ev.account[:80]!r}), so that all "
            "of an account's events reach the partition that holds its features"
        )
    check_key(key, "account", ev.account, "risk events", InvalidRiskEventError)
    return ev


def salvage_event_ids(raw: bytes | None) -> tuple[str, str] | None:
    """``(event_id, account)`` from a record that failed validation, when readable."""
    data = salvage_object(raw)
    if data is None:
        return None
    eid, account = salvaged_id(data.get("event_id")), salvaged_id(data.get("account"))
    return (eid, account) if eid is not None and account is not None else None
