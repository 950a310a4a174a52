"""``surge risk rules publish --file``: a rules file is read and validated whole before anything is
published; a number that is not finite, a file that is missing, not JSON, not a list, or holds a bad
rule gives a typed error and exit code 2 and contacts no broker (docs/architecture.md, "Risk: rules").

No broker: ``publish_rules`` is replaced by a recorder, and the broker setting points at a closed
port, so a test that got as far as publishing would fail loudly rather than reach a real Kafka."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from pipeline import cli
from pipeline.exceptions import SurgeError
from pipeline.risk.rules import DEFAULT_RULES, Rule, RuleError, parse_rule

# RulesFileError, rules_from_json and read_rules_file are imported inside the tests, so that each test
# of the CLI runs (and fails on what the CLI does) against a version without them

GOOD = {
    "rule_id": "x",
    "version": 1,
    "action": "decline",
    "points": 1,
    "when": [["account_count_1m", ">=", 3]],
}


def _rule(**changes: Any) -> dict[str, Any]:
    return {**GOOD, **changes}


@pytest.fixture
def published(monkeypatch: pytest.MonkeyPatch) -> list[list[Rule]]:
    """What ``surge risk rules publish`` handed to the producer; no broker is contacted."""
    import pipeline.risk_client

    calls: list[list[Rule]] = []

    async def fake_publish_rules(bootstrap: str, topic: str, rules: list[Rule], **_: Any) -> bool:
        calls.append(list(rules))
        return True

    monkeypatch.setattr(pipeline.risk_client, "publish_rules", fake_publish_rules)
    monkeypatch.setenv("SURGE_BROKER", "kafka://127.0.0.1:1")  # closed: nothing real is reachable
    return calls


# ---- finite numbers -----------------------------------------------------------------------------
NON_FINITE = [math.inf, -math.inf, math.nan]


@pytest.mark.parametrize("bad", NON_FINITE, ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("op", [">=", "<", "==", "!="])
def test_a_condition_value_that_is_not_finite_is_refused(bad: float, op: str) -> None:
    with pytest.raises(ValueError, match=r"(?s)when.*account_count_1m.*finite number"):
        Rule.model_validate(_rule(when=[["account_count_1m", op, bad]]))


@pytest.mark.parametrize("bad", NON_FINITE, ids=["inf", "-inf", "nan"])
def test_a_non_finite_member_of_an_in_list_is_refused(bad: float) -> None:
    with pytest.raises(ValueError, match=r"(?s)when.*account_count_1m in.*finite number"):
        Rule.model_validate(_rule(when=[["account_count_1m", "in", [1, bad]]]))


@pytest.mark.parametrize("bad", NON_FINITE, ids=["inf", "-inf", "nan"])
def test_points_that_are_not_finite_are_refused(bad: float) -> None:
    with pytest.raises(ValueError, match=r"(?s)points.*finite number"):
        Rule.model_validate(_rule(points=bad))


@pytest.mark.parametrize("literal", ["1e309", "-1e309", "Infinity", "-Infinity", "NaN"])
def test_a_rules_file_with_a_non_finite_threshold_names_the_rule_and_field(literal: str) -> None:
    from pipeline.risk.rules import RulesFileError, rules_from_json

    text = json.dumps([_rule()]).replace('">=", 3]', f'">=", {literal}]')
    assert literal in text
    with pytest.raises(RulesFileError, match=r"rule 0 \('x'\).*when.*account_count_1m.*finite number"):
        rules_from_json(text, "rules.json")


@pytest.mark.parametrize("literal", ["1e309", "NaN", "-Infinity"])
def test_a_worker_rejects_a_record_with_a_non_finite_threshold(literal: str) -> None:
    """The record's own JSON (another producer's): refused by name, not kept with an infinite value."""
    record = json.dumps(_rule()).replace('">=", 3]', f'">=", {literal}]').encode()
    with pytest.raises(RuleError, match=r"finite number"):
        parse_rule(b"x", record)


# ---- the CLI: a typed error, exit code 2, nothing published -------------------------------------
def _publish(path: Path | str, capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    rc = cli.main(["risk", "rules", "publish", "--file", str(path)])
    return rc, capsys.readouterr().err


@pytest.mark.parametrize("literal", ["1e309", "-1e309", "NaN"])
def test_publish_refuses_a_non_finite_threshold_and_publishes_nothing(
    tmp_path: Path, literal: str, published: list[list[Rule]], capsys: pytest.CaptureFixture[str]
) -> None:
    f = tmp_path / "rules.json"
    good = _rule(rule_id="fine")
    f.write_text(json.dumps([good, _rule()]).replace('">=", 3]]}]', f'">=", {literal}]]}}]'))
    assert literal in f.read_text()
    rc, err = _publish(f, capsys)
    assert rc == 2
    assert "RulesFileError" in err and "rule 1 ('x')" in err and "finite number" in err
    assert "Traceback" not in err
    assert published == []  # not even the good rule before it


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (None, "cannot be read"),
        ("not json at all", "not valid JSON"),
        ('{"rule_id": "x"}', "expected a JSON list of rules, got an object"),
        (json.dumps([_rule(when=[["no_such_feature", ">=", 1]])]), "unknown feature or event field"),
        (json.dumps([_rule(action="explode")]), "rule 0 ('x') rejected: action"),
        (json.dumps(["x"]), "rule 0 rejected"),
    ],
    ids=["missing", "not-json", "object", "unknown-feature", "bad-rule", "not-an-object"],
)
def test_publish_a_bad_rules_file_exits_2_with_a_typed_error(
    tmp_path: Path,
    content: str | None,
    expected: str,
    published: list[list[Rule]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    f = tmp_path / "rules.json"
    if content is not None:
        f.write_text(content)
    rc, err = _publish(f, capsys)
    assert rc == 2
    assert f"surge: RulesFileError: rules file '{f}'" in err and expected in err
    assert "Traceback" not in err
    assert published == []

    from pipeline.risk.rules import RulesFileError
    from pipeline.riskops import read_rules_file

    with pytest.raises(RulesFileError, match=r"rules file") as info:
        read_rules_file(f)
    assert isinstance(info.value, SurgeError) and expected in info.value.message


def test_a_valid_rules_file_parses_and_is_published_whole(
    tmp_path: Path, published: list[list[Rule]], capsys: pytest.CaptureFixture[str]
) -> None:
    rules = [r.model_dump(mode="json") for r in DEFAULT_RULES] + [
        _rule(rule_id="listed", when=[["event.country", "in", ["DE", "FR"]], ["event.amount", ">", 0.5]])
    ]
    f = tmp_path / "rules.json"
    f.write_text(json.dumps(rules))
    from pipeline.riskops import read_rules_file

    parsed = read_rules_file(f)
    assert [r.rule_id for r in parsed] == [r["rule_id"] for r in rules]
    assert parsed[: len(DEFAULT_RULES)] == list(DEFAULT_RULES)
    assert cli.main(["risk", "rules", "publish", "--file", str(f)]) == 0
    assert published == [parsed]
    assert f"published {len(rules)} rules" in capsys.readouterr().out
