"""Versioned rules over the risk features, and the rule book every risk worker keeps
(docs/architecture.md, "Risk: rules").

A rule is a JSON record on the compacted topic ``surge.risk.rules``, keyed by its ``rule_id``::

    {"rule_id": "card_testing", "version": 2, "action": "decline", "points": 3,
     "when": [["card_small_1m", ">=", 3]], "description": "several small payments on a card within a minute"}

``when`` holds conditions that must all hold; each names a feature (:data:`ALL_FEATURES`) or an event
field (``event.amount``, ``event.type``, ``event.country``, ...), an operator (``>`` ``>=`` ``<``
``<=`` ``==`` ``!=`` ``in`` ``not_in``) and a value. A condition on a feature the event lacks (None)
does not hold. A record with a null value (a tombstone) removes the rule. Every number in a rule (its
points, a condition's value, the members of an ``in`` list) must be finite: JSON has no infinity or
NaN, so such a rule would be written with ``null`` in their place and every worker would reject it.

The rule set's version (:func:`ruleset_version`) is derived from its content, so every worker that has
read the same records names the same version. :class:`RuleBook` keeps the current set and the last
few versions, so a decision pinned to a version evaluates that version.

Pure: pydantic and the standard library.
"""

from __future__ import annotations

import hashlib
import json
import math
import operator
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from pipeline.exceptions import SurgeError
from pipeline.risk.features import ALL_FEATURES

Op = Literal[">", ">=", "<", "<=", "==", "!=", "in", "not_in"]
#: event fields a rule may test (``event.<field>``)
EVENT_FIELDS = ("type", "amount", "currency", "country", "merchant", "account", "card", "device", "ip")
_OPS: dict[str, Callable[[Any, Any], bool]] = {
    ">": operator.gt,
    ">=": operator.ge,
    "<": operator.lt,
    "<=": operator.le,
    "==": operator.eq,
    "!=": operator.ne,
    "in": lambda a, b: a in b,
    "not_in": lambda a, b: a not in b,
}
_KNOWN = frozenset(ALL_FEATURES) | {f"event.{f}" for f in EVENT_FIELDS}


class RuleError(SurgeError):
    """A rule record that cannot be decoded or names something that does not exist."""

    code = "invalid_request"

    def __init__(self, rule_id: str | None, detail: str) -> None:
        super().__init__(f"rule {rule_id!r} rejected: {detail}")
        self.rule_id = rule_id
        self.detail = detail


class RulesFileError(SurgeError):
    """A rules file (``surge risk rules publish --file``) that cannot be read, is not a JSON list of
    rules, or holds a rule that fails validation; names the file and, for a bad rule, its position and
    id. Nothing of such a file is published."""

    code = "invalid_request"

    def __init__(self, source: str, detail: str) -> None:
        super().__init__(f"rules file {source!r}: {detail}")
        self.source = source
        self.detail = detail


def _non_finite(value: Any) -> float | None:
    """The first number in ``value`` (a number, or a list of them at any depth) that is not finite."""
    if isinstance(value, float) and not math.isfinite(value):
        return value
    if isinstance(value, list | tuple):
        for v in value:
            if (bad := _non_finite(v)) is not None:
                return bad
    return None


def describe_validation_error(exc: ValidationError, limit: int = 5) -> str:
    """``field: message`` for the first ``limit`` errors of ``exc``, joined by ``; ``."""
    return "; ".join(
        f"{'.'.join(str(p) for p in e['loc']) or 'record'}: {e['msg']}" for e in exc.errors()[:limit]
    )


class Rule(BaseModel):
    """One rule (the value of a record on ``surge.risk.rules``)."""

    # allow_inf_nan=False: a number that is not finite has no JSON form (it is written as null)
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False)

    rule_id: Annotated[str, Field(pattern=r"^[a-z0-9][a-z0-9_.-]{0,63}$")]
    version: Annotated[int, Field(ge=1, strict=True)]
    action: Literal["review", "decline"]
    #: weight in the rules' own score (what ``surge bench risk`` ranks events by for "rules alone")
    points: Annotated[float, Field(ge=0, le=100)] = 1.0
    when: Annotated[list[tuple[str, Op, Any]], Field(min_length=1, max_length=16)]
    description: Annotated[str, Field(max_length=500)] = ""
    enabled: bool = True

    @field_validator("when")
    @classmethod
    def _known(cls, v: list[tuple[str, str, Any]]) -> list[tuple[str, str, Any]]:
        for i, (name, op, value) in enumerate(v):
            if name not in _KNOWN:
                raise ValueError(f"unknown feature or event field {name!r}")
            # ``value`` is Any, so allow_inf_nan does not reach it: checked here, lists included
            if (bad := _non_finite(value)) is not None:
                raise ValueError(
                    f"condition {i} ({name} {op}): the value must be a finite number, got {bad!r}"
                )
            if op in ("in", "not_in"):
                if not isinstance(value, list) or not value:
                    raise ValueError(f"{name} {op}: the value must be a non-empty list, got {value!r}")
            elif op not in ("==", "!=") and (isinstance(value, bool) or not isinstance(value, int | float)):
                raise ValueError(f"{name} {op}: the value must be a number, got {value!r}")
        return v


class Hit(NamedTuple):
    """One rule that fired for an event, with the values that made it fire."""

    rule_id: str
    version: int
    action: str
    points: float
    detail: str

    def reason(self) -> str:
        return f"rule {self.rule_id}@{self.version}: {self.detail}"


def _getter(name: str) -> Callable[[dict[str, Any], dict[str, Any]], Any]:
    if name.startswith("event."):
        field = name[6:]
        return lambda features, event: event.get(field)
    return lambda features, event: features.get(name)


class _Compiled:
    __slots__ = ("conds", "rule")

    def __init__(self, rule: Rule) -> None:
        self.rule = rule
        self.conds = [(name, _getter(name), _OPS[op], op, value) for name, op, value in rule.when]

    def check(self, features: dict[str, Any], event: dict[str, Any]) -> Hit | None:
        parts = []
        for name, get, fn, op, value in self.conds:
            x = get(features, event)
            if x is None:
                return None
            try:
                if not fn(x, value):
                    return None
            except TypeError:
                return None
            parts.append(f"{name}={_fmt(x)} {op} {_fmt(value)}")
        r = self.rule
        return Hit(r.rule_id, r.version, r.action, r.points, ", ".join(parts))


def _fmt(x: Any) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def ruleset_version(rules: Iterable[Rule]) -> str:
    """``v<highest rule version>-<8 hex of the content hash>``: equal content, equal version."""
    rules = sorted(rules, key=lambda r: r.rule_id)
    blob = json.dumps([r.model_dump(mode="json") for r in rules], sort_keys=True, separators=(",", ":"))
    top = max((r.version for r in rules), default=0)
    return f"v{top}-{hashlib.sha256(blob.encode()).hexdigest()[:8]}"


class RuleSet:
    """An immutable set of rules with its version; :meth:`evaluate` returns the hits."""

    def __init__(self, rules: Iterable[Rule]) -> None:
        self.rules: tuple[Rule, ...] = tuple(sorted(rules, key=lambda r: r.rule_id))
        self.version = ruleset_version(self.rules)
        self._compiled = [_Compiled(r) for r in self.rules if r.enabled]

    def evaluate(self, features: dict[str, Any], event: dict[str, Any]) -> list[Hit]:
        """Every enabled rule whose conditions all hold, in rule-id order."""
        return [h for c in self._compiled if (h := c.check(features, event)) is not None]

    def points(self, features: dict[str, Any], event: dict[str, Any]) -> float:
        """The rules' own risk score: the sum of the points of the rules that fire."""
        return sum(h.points for h in self.evaluate(features, event))

    def __len__(self) -> int:
        return len(self.rules)


def parse_rule(key: bytes | str | None, value: bytes | None) -> Rule | None:
    """The rule in one record of the rules topic; None for a tombstone. Raises :class:`RuleError`."""
    rid = key.decode("utf-8", "replace") if isinstance(key, bytes) else key
    if value is None:
        return None
    try:
        rule = Rule.model_validate_json(value)
    except ValidationError as exc:
        raise RuleError(rid, describe_validation_error(exc)) from exc
    if rid is not None and rid != rule.rule_id:
        raise RuleError(rid, f"the record key {rid!r} differs from rule_id {rule.rule_id!r}")
    return rule


def _json_kind(doc: Any) -> str:
    if doc is None:
        return "null"
    kinds = ((bool, "a boolean"), (dict, "an object"), (str, "a string"), (int | float, "a number"))
    return next((k for t, k in kinds if isinstance(doc, t)), type(doc).__name__)


def rules_from_json(text: str | bytes, source: str = "<rules>") -> list[Rule]:
    """The rules of a rules file's content: a JSON list of rule objects, each validated as a worker
    would read it once published (its record, serialised, parsed back with :func:`parse_rule`). Raises
    :class:`RulesFileError` for the first problem: not JSON, not a list, a rule that fails validation
    (by position and id), two rules with one id. Nothing is returned unless the whole file is good."""
    try:
        doc = json.loads(text)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise RulesFileError(source, f"not valid JSON: {exc}") from exc
    if not isinstance(doc, list):
        raise RulesFileError(source, f"expected a JSON list of rules, got {_json_kind(doc)}")
    rules: list[Rule] = []
    seen: dict[str, int] = {}
    for i, item in enumerate(doc):
        rid = item.get("rule_id") if isinstance(item, dict) else None
        where = f"rule {i}" + (f" ({rid!r})" if isinstance(rid, str) else "")
        try:
            rule = Rule.model_validate(item)
            # what the workers will read: the record as published, parsed back
            parse_rule(rule.rule_id, rule.model_dump_json().encode())
        except ValidationError as exc:
            raise RulesFileError(source, f"{where} rejected: {describe_validation_error(exc)}") from exc
        except RuleError as exc:
            raise RulesFileError(source, f"{where} rejected: {exc.detail}") from exc
        if rule.rule_id in seen:
            raise RulesFileError(
                source, f"{where}: rule_id {rule.rule_id!r} is also rule {seen[rule.rule_id]}"
            )
        seen[rule.rule_id] = i
        rules.append(rule)
    return rules


class RuleBook:
    """The current rule set of a worker, built from the rules topic, and the last ``keep`` versions."""

    def __init__(self, rules: Iterable[Rule] = (), keep: int = 32) -> None:
        self._rules: dict[str, Rule] = {r.rule_id: r for r in rules}
        self._history: OrderedDict[str, RuleSet] = OrderedDict()
        self.keep = keep
        self.current = self._remember(RuleSet(self._rules.values()))

    def _remember(self, rs: RuleSet) -> RuleSet:
        self._history[rs.version] = rs
        self._history.move_to_end(rs.version)
        while len(self._history) > self.keep:
            self._history.popitem(last=False)
        return rs

    def apply(self, key: bytes | str | None, value: bytes | None) -> RuleSet:
        """Apply one record of the rules topic; returns the new current set. Raises :class:`RuleError`
        for a bad record (the book is then unchanged)."""
        rs, errors = self.apply_many([(key, value)])
        if errors:
            raise errors[0]
        return rs

    def apply_many(
        self, records: Iterable[tuple[bytes | str | None, bytes | None]]
    ) -> tuple[RuleSet, list[RuleError]]:
        """Apply records read together, in order, as one change: one new version for all of them (a
        rule set published in one transaction arrives in one read, and no decision should name half
        of it). A bad record is left out and returned; the book keeps that rule's previous version."""
        errors: list[RuleError] = []
        changed = False
        for key, value in records:
            try:
                rule = parse_rule(key, value)
            except RuleError as exc:
                errors.append(exc)
                continue
            if rule is None:
                rid = key.decode() if isinstance(key, bytes) else key
                if rid is None or rid not in self._rules:
                    continue
                del self._rules[rid]
            else:
                self._rules[rule.rule_id] = rule
            changed = True
        if changed:
            self.current = self._remember(RuleSet(self._rules.values()))
        return self.current, errors

    def get(self, version: str) -> RuleSet | None:
        """The rule set of ``version``, if this book has seen it recently."""
        return self._history.get(version)


#: the rules a fresh deployment starts with (``surge risk rules publish --defaults``, and a risk
#: worker that finds the rules topic empty)
DEFAULT_RULES: tuple[Rule, ...] = (
    Rule(
        rule_id="card_testing",
        version=1,
        action="decline",
        points=3,
        when=[("card_small_1m", ">=", 3)],
        description="three or more small payments on one card within a minute",
    ),
    Rule(
        rule_id="card_velocity",
        version=1,
        action="review",
        points=2,
        when=[("card_count_1m", ">=", 4)],
        description="four or more payments on one card within a minute",
    ),
    Rule(
        rule_id="new_device_new_country",
        version=1,
        action="review",
        points=2,
        when=[("account_new_device", "==", 1), ("account_new_country", "==", 1)],
        description="a device and a country the account has never used, at once",
    ),
    Rule(
        rule_id="amount_spike",
        version=1,
        action="review",
        points=1,
        when=[("account_amount_ratio_24h", ">=", 8), ("event.amount", ">=", 300)],
        description="an amount at least 8 times the account's 24 h mean, and at least 300",
    ),
    Rule(
        rule_id="large_amount",
        version=1,
        action="review",
        points=1,
        when=[("event.amount", ">=", 3000)],
        description="any amount of 3000 or more",
    ),
    Rule(
        rule_id="shared_ip",
        version=1,
        action="review",
        points=1,
        when=[("ip_distinct_account_1h", ">=", 4)],
        description="an IP used by four or more accounts within an hour",
    ),
    Rule(
        rule_id="device_many_accounts",
        version=1,
        action="review",
        points=2,
        when=[("device_distinct_account_24h", ">=", 3)],
        description="a device used by three or more accounts within a day",
    ),
    Rule(
        rule_id="card_two_countries",
        version=1,
        action="review",
        points=1,
        when=[("card_distinct_country_24h", ">=", 2), ("account_new_country", "==", 1)],
        description="a card in a second country within a day, new to the account",
    ),
)
