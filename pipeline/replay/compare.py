"""The comparison report of a replay or a shadow against what live traffic got (docs/architecture.md,
"Replay"): joined on ``(user_id, request_id)`` for requests and on ``event_id`` for risk events.

Requests: agreement (same status, error code, answer and finish reason), exact answer matches and the
normalised edit distance of answers, how ``served_from`` shifts, latency old against new, and every
difference with a named cause (:data:`REQUEST_CAUSES`). Risk events: decision flips, score deltas
(p50, p95), per-feature mismatches, latency, recall at 1 % false positives where labels exist, and a
cause per flip (:data:`RISK_CAUSES`).

Pure: records come in as decoded JSON dicts.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Hashable, Iterator, Mapping, Sequence
from typing import Any, Generic, TypeVar

from pipeline.stats import latency_summary, percentile, recall_at_fpr

#: the causes a request difference is put down to, in the order they are tried
REQUEST_CAUSES: dict[str, str] = {
    "live_deadline_exceeded": "live answered deadline_exceeded; the replay runs without deadlines",
    "replay_deadline_exceeded": "the replay answered deadline_exceeded (deadlines were turned on)",
    "live_overloaded": "live answered overloaded (a full queue)",
    "replay_overloaded": "the replay answered overloaded (a full queue)",
    "live_degraded": "live answer was a template or a degraded answer (degradation level > 0)",
    "replay_degraded": "the replay's answer was degraded (degradation was turned on)",
    "rate_limit_state": "rate_limited on one side only: bucket state from before the range, or limits changed",
    "model_version_differs": "the two answers come from different model versions",
    "live_shared_answer": "live took another request's answer (cache or merge); the replay asked the model",
    "replay_shared_answer": "the replay took another request's answer (cache or merge); live asked the model",
    "model_error": "a model_error or internal error on one side",
    "invalid_request": "invalid_request on one side (validation settings differ)",
    "settings_changed": "the replay runs with other settings",
    "unexplained": "no named cause",
}
#: the causes of a risk decision flip (or of a differing score or features)
RISK_CAUSES: dict[str, str] = {
    "late_differs": "late on one side only: event arrival order differs from live",
    "model_version_differs": "the two decisions come from different model versions",
    "rule_version_differs": "the two decisions applied different rule sets",
    "features_differ": "window features differ (state before the warm-up, or arrival order across entities)",
    "settings_changed": "the replay runs with other settings (thresholds, windows)",
    "score_differs": "same features and versions, different score",
    "unexplained": "no named cause",
}
EXAMPLES = 20
EDIT_CAP = 4000

K = TypeVar("K", bound=Hashable)
Record = Mapping[str, Any]


def edit_distance(a: str, b: str) -> int:
    """Levenshtein distance (insertions, deletions, substitutions), texts cut at :data:`EDIT_CAP`."""
    a, b = a[:EDIT_CAP], b[:EDIT_CAP]
    if a == b:
        return 0
    if len(a) < len(b):
        a, b = b, a
    prev = list(range(len(b) + 1))
    for i, ca in enumerate(a, 1):
        cur = [i]
        for j, cb in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (ca != cb)))
        prev = cur
    return prev[-1]


def normalized_edit_distance(a: str | None, b: str | None) -> float:
    """Edit distance over the longer text's length: 0 identical, 1 nothing in common; 1 when one side
    has no answer (an error) and the other has one."""
    if a is None and b is None:
        return 0.0
    if a is None or b is None:
        return 1.0
    longest = max(len(a[:EDIT_CAP]), len(b[:EDIT_CAP]))
    return 0.0 if longest == 0 else edit_distance(a, b) / longest


def outcome(reply: Mapping[str, Any]) -> tuple[Any, ...]:
    """What must be equal for a replayed request to reproduce its live reply."""
    err = reply.get("error") or {}
    return (reply.get("status"), err.get("code"), reply.get("answer"), reply.get("finish_reason"))


def _code(reply: Mapping[str, Any]) -> str | None:
    return (reply.get("error") or {}).get("code")


def _degraded(reply: Mapping[str, Any]) -> bool:
    return reply.get("served_from") == "template" or int(reply.get("degradation_level") or 0) > 0


def timing_dependent(live: Mapping[str, Any]) -> bool:
    """Whether a live reply came from a condition no replay reproduces by design: an answer of a
    similar question (semantic cache, similarity below 1) or of a merge, a template or an answer whose
    max_tokens degradation capped (level 2 and up), a deadline miss or a full queue: each depends on
    what else was in flight at that moment (docs/architecture.md, "Replay"). An exact cache hit is the
    answer the model gives that text, so it counts as reproducible."""
    served = live.get("served_from")
    similar = served == "cache" and live.get("similarity") is not None and float(live["similarity"]) < 1.0
    return (
        served in ("merged", "template")
        or similar
        or int(live.get("degradation_level") or 0) >= 2
        or _code(live) in ("deadline_exceeded", "overloaded")
    )


def request_cause(live: Mapping[str, Any], new: Mapping[str, Any], changed: Sequence[str] = ()) -> str:
    """The named cause of a difference between a live reply and a replayed one."""
    lc, nc = _code(live), _code(new)
    for code, side in ((lc, "live"), (nc, "replay")):
        if code == "deadline_exceeded":
            return f"{side}_deadline_exceeded"
    for code, side in ((lc, "live"), (nc, "replay")):
        if code == "overloaded":
            return f"{side}_overloaded"
    if _degraded(live) and not _degraded(new):
        return "live_degraded"
    if _degraded(new) and not _degraded(live):
        return "replay_degraded"
    if "rate_limited" in (lc, nc) and lc != nc:
        return "rate_limit_state"
    lv, nv = live.get("model_version"), new.get("model_version")
    if live.get("status") == new.get("status") == "ok" and lv and nv and lv != nv:
        return "model_version_differs"
    shared = ("cache", "merged")
    if live.get("served_from") in shared and new.get("served_from") not in shared:
        return "live_shared_answer"
    if new.get("served_from") in shared and live.get("served_from") not in shared:
        return "replay_shared_answer"
    if lc in ("model_error", "internal") or nc in ("model_error", "internal"):
        return "model_error"
    if "invalid_request" in (lc, nc) and lc != nc:
        return "invalid_request"
    if changed:
        return "settings_changed"
    if live.get("served_from") in shared and new.get("served_from") in shared:
        return "live_shared_answer"
    return "unexplained"


def _rate(n: int, d: int) -> float | None:
    return None if d == 0 else round(n / d, 6)


def _dist(values: Sequence[float]) -> dict[str, float | None]:
    def r(x: float | None) -> float | None:
        return None if x is None else round(x, 6)

    return {
        "mean": r(sum(values) / len(values)) if values else None,
        "p50": r(percentile(values, 50)),
        "p95": r(percentile(values, 95)),
        "max": r(max(values)) if values else None,
    }


def _short(reply: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if reply is None:
        return None
    keep = ("status", "answer", "error", "served_from", "degradation_level", "model_version", "finish_reason")
    out = {k: reply.get(k) for k in keep if reply.get(k) is not None}
    answer = out.get("answer")
    if isinstance(answer, str) and len(answer) > 200:
        out["answer"] = answer[:200] + "..."
    return out


class _Join(Generic[K]):
    """Each replayed key once, in order, with its live and its replayed record (None where there is
    none). Counts what is missing on either side and collects both sides' latencies as it goes: the
    live one from the record's ``timings`` (``live_latency_field``), the replay's as measured."""

    def __init__(
        self,
        expected: Sequence[K],
        live: Mapping[K, Record],
        replay: Mapping[K, Record],
        replay_latency_ms: Mapping[K, float] | None,
        live_latency_field: str,
    ) -> None:
        self.expected, self.live, self.replay = expected, live, replay
        self.latency = replay_latency_ms or {}
        self.live_latency_field = live_latency_field
        self.replayed = self.joined = self.missing_live = self.missing_replay = 0
        self.live_latency_ms: list[float] = []
        self.replay_latency_ms: list[float] = []

    def __iter__(self) -> Iterator[tuple[K, Record | None, Record | None]]:
        for key in dict.fromkeys(self.expected):
            old, new = self.live.get(key), self.replay.get(key)
            self.replayed += 1
            if new is None:
                self.missing_replay += 1
            elif key in self.latency:
                self.replay_latency_ms.append(float(self.latency[key]))
            if old is None:
                self.missing_live += 1
            else:
                took = (old.get("timings") or {}).get(self.live_latency_field)
                if took is not None:
                    self.live_latency_ms.append(float(took))
            self.joined += old is not None and new is not None
            yield key, old, new

    def counts(self) -> dict[str, int]:
        return {
            "replayed": self.replayed,
            "joined": self.joined,
            "missing_live": self.missing_live,
            "missing_replay": self.missing_replay,
        }


def _by_cause(causes: Counter[str], table: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """How many differences each cause explains, and what each means (those that occurred only)."""
    return {
        "differences_by_cause": {c: causes[c] for c in table if causes.get(c)},
        "causes": {c: table[c] for c in table if causes.get(c)},
    }


def compare_requests(
    expected: Sequence[tuple[str, str]],
    live: Mapping[tuple[str, str], Mapping[str, Any]],
    replay: Mapping[tuple[str, str], Mapping[str, Any]],
    *,
    replay_latency_ms: Mapping[tuple[str, str], float] | None = None,
    changed: Sequence[str] = (),
) -> dict[str, Any]:
    """The report of replayed requests ``expected`` (``(user_id, request_id)``) against ``live``."""
    join = _Join(expected, live, replay, replay_latency_ms, "total_ms")
    same = same_answer_text = both_ok = comparable = comparable_same = 0
    distances: list[float] = []
    shifts: Counter[str] = Counter()
    causes: Counter[str] = Counter()
    examples: list[dict[str, Any]] = []
    live_status: Counter[str] = Counter()
    new_status: Counter[str] = Counter()
    versions: dict[str, Counter[str]] = {"live": Counter(), "replay": Counter()}
    for key, old, new in join:
        if new is not None:
            new_status[_code(new) or str(new.get("status"))] += 1
            versions["replay"][str(new.get("model_version"))] += 1
        if old is not None:
            live_status[_code(old) or str(old.get("status"))] += 1
            versions["live"][str(old.get("model_version"))] += 1
        if old is None or new is None:
            continue
        shifts[f"{old.get('served_from') or 'none'}->{new.get('served_from') or 'none'}"] += 1
        if old.get("status") == new.get("status") == "ok":
            both_ok += 1
            same_answer_text += old.get("answer") == new.get("answer")
        d = normalized_edit_distance(old.get("answer"), new.get("answer"))
        distances.append(d)
        fair = not timing_dependent(old)
        comparable += fair
        if outcome(old) == outcome(new):
            same += 1
            comparable_same += fair
            continue
        cause = request_cause(old, new, changed)
        causes[cause] += 1
        if len(examples) < EXAMPLES:
            examples.append(
                {
                    "user_id": key[0],
                    "request_id": key[1],
                    "cause": cause,
                    "edit_distance": round(d, 4),
                    "live": _short(old),
                    "replay": _short(new),
                }
            )
    differing = join.joined - same
    return {
        "kind": "requests",
        "counts": join.counts(),
        "agreement": {
            "same_outcome": same,
            "rate": _rate(same, join.joined),
            "differing": differing,
            "explained": differing - causes.get("unexplained", 0),
            "unexplained": causes.get("unexplained", 0),
            # live replies no replay reproduces by design left out (timing_dependent)
            "comparable": comparable,
            "comparable_same": comparable_same,
            "comparable_rate": _rate(comparable_same, comparable),
        },
        "answers": {
            "both_ok": both_ok,
            "exact_match": same_answer_text,
            "exact_match_rate": _rate(same_answer_text, both_ok),
            "normalized_edit_distance": _dist(distances),
        },
        "served_from_shift": dict(sorted(shifts.items())),
        "status": {"live": dict(sorted(live_status.items())), "replay": dict(sorted(new_status.items()))},
        "model_versions": {k: dict(v) for k, v in versions.items()},
        **_by_cause(causes, REQUEST_CAUSES),
        "examples": examples,
        "latency_ms": {
            "live_created_to_reply": latency_summary(join.live_latency_ms),
            "replay_copy_to_reply": latency_summary(join.replay_latency_ms),
        },
        "changed_settings": list(changed),
        "_series": {
            "edit_distance": distances,
            "live_latency_ms": join.live_latency_ms,
            "replay_latency_ms": join.replay_latency_ms,
        },
    }


def _feature_differs(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is not b
    try:
        return not math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=1e-9)
    except (TypeError, ValueError):
        return bool(a != b)


def risk_cause(live: Mapping[str, Any], new: Mapping[str, Any], changed: Sequence[str] = ()) -> str:
    """The named cause of a differing risk decision (its outcome, score or features)."""
    if bool(live.get("late")) != bool(new.get("late")):
        return "late_differs"
    if live.get("model_version") != new.get("model_version"):
        return "model_version_differs"
    lr, nr = str(live.get("rule_version") or ""), str(new.get("rule_version") or "")
    if lr != nr:
        return "rule_version_differs"
    lf, nf = live.get("features") or {}, new.get("features") or {}
    if any(_feature_differs(lf.get(k), nf.get(k)) for k in set(lf) | set(nf)):
        return "features_differ"
    if changed:
        return "settings_changed"
    if live.get("score") != new.get("score"):
        return "score_differs"
    return "unexplained"


def _recall(
    decisions: Mapping[str, Mapping[str, Any]], labels: Mapping[str, int], keys: Sequence[str]
) -> dict[str, float] | None:
    rows = [
        (float(decisions[k]["score"]), int(labels[k]))
        for k in keys
        if k in labels and decisions.get(k, {}).get("score") is not None
    ]
    if not rows or len({y for _, y in rows}) < 2:
        return None
    got = recall_at_fpr([s for s, _ in rows], [y for _, y in rows], 0.01)
    return {k: round(v, 6) for k, v in got.items()} | {"events": len(rows)}


def compare_risk(
    expected: Sequence[str],
    live: Mapping[str, Mapping[str, Any]],
    replay: Mapping[str, Mapping[str, Any]],
    *,
    replay_latency_ms: Mapping[str, float] | None = None,
    labels: Mapping[str, int] | None = None,
    changed: Sequence[str] = (),
) -> dict[str, Any]:
    """The report of replayed risk events ``expected`` (event ids) against ``live`` decisions."""
    join = _Join(expected, live, replay, replay_latency_ms, "produce_to_decision_ms")
    flips: Counter[str] = Counter()
    causes: Counter[str] = Counter()
    features: Counter[str] = Counter()
    deltas: list[float] = []
    signed: list[float] = []
    examples: list[dict[str, Any]] = []
    joined_keys: list[str] = []
    same = identical = 0
    for key, old, new in join:
        if old is None or new is None:
            continue
        joined_keys.append(key)
        flips[f"{old.get('decision')}->{new.get('decision')}"] += 1
        if old.get("score") is not None and new.get("score") is not None:
            d = float(new["score"]) - float(old["score"])
            signed.append(d)
            deltas.append(abs(d))
        lf, nf = old.get("features") or {}, new.get("features") or {}
        mismatched = sorted(k for k in set(lf) | set(nf) if _feature_differs(lf.get(k), nf.get(k)))
        features.update(mismatched)
        flipped = old.get("decision") != new.get("decision")
        same += not flipped
        differs = flipped or mismatched or old.get("score") != new.get("score")
        if not differs and sorted(old.get("reasons") or []) == sorted(new.get("reasons") or []):
            identical += 1
            continue
        cause = risk_cause(old, new, changed)
        causes[cause] += 1
        if len(examples) < EXAMPLES and flipped:
            examples.append(
                {
                    "event_id": key,
                    "cause": cause,
                    "live": old.get("decision"),
                    "replay": new.get("decision"),
                    "live_score": old.get("score"),
                    "replay_score": new.get("score"),
                    "features_differ": mismatched[:10],
                }
            )
    joined = join.joined
    flipped_n = sum(n for k, n in flips.items() if k.split("->")[0] != k.split("->")[1])
    report: dict[str, Any] = {
        "kind": "risk-events",
        "counts": join.counts(),
        "agreement": {
            "same_decision": same,
            "rate": _rate(same, joined),
            "identical": identical,
            "identical_rate": _rate(identical, joined),
            "flips": flipped_n,
        },
        "decision_flips": dict(sorted(flips.items())),
        "score_delta": {"abs": _dist(deltas), "signed_mean": _dist(signed)["mean"], "pairs": len(deltas)},
        "feature_mismatches": dict(features.most_common()),
        **_by_cause(causes, RISK_CAUSES),
        "examples": examples,
        "latency_ms": {
            "live_produce_to_decision": latency_summary(join.live_latency_ms),
            "replay_copy_to_decision": latency_summary(join.replay_latency_ms),
        },
        "changed_settings": list(changed),
        "_series": {
            "score_delta": signed,
            "live_latency_ms": join.live_latency_ms,
            "replay_latency_ms": join.replay_latency_ms,
        },
    }
    if labels:
        report["recall_at_1pct_fpr"] = {
            "live": _recall(live, labels, joined_keys),
            "replay": _recall(replay, labels, joined_keys),
        }
    return report


def public(report: Mapping[str, Any]) -> dict[str, Any]:
    """The report without its raw series (what the JSON file holds)."""
    return {k: v for k, v in report.items() if not k.startswith("_")}


def summary_lines(report: Mapping[str, Any]) -> list[str]:
    """A short terminal summary of a report."""
    c, a = report["counts"], report["agreement"]
    lines = [
        f"replayed {c['replayed']}, joined with live {c['joined']} "
        f"(no live reply {c['missing_live']}, no replay reply {c['missing_replay']})"
    ]
    if report["kind"] == "requests":
        ans = report["answers"]
        ed = ans["normalized_edit_distance"]
        lines.append(
            f"same outcome {a['same_outcome']}/{c['joined']} = {_pct(a['rate'])}; differing {a['differing']} "
            f"(explained {a['explained']}, unexplained {a['unexplained']}); live answers a replay can "
            f"reproduce (not merged, similar, templated, capped, late or overloaded): {a['comparable_same']}/"
            f"{a['comparable']} = {_pct(a['comparable_rate'])}"
        )
        lines.append(
            f"answers: exact match {ans['exact_match']}/{ans['both_ok']} = {_pct(ans['exact_match_rate'])}; "
            f"normalised edit distance mean {ed['mean']}, p95 {ed['p95']}"
        )
        lines.append(
            "served_from live->replay: "
            + ", ".join(f"{k} {v}" for k, v in report["served_from_shift"].items())
        )
        lines.append(_request_latency_line(report["latency_ms"]))
    else:
        sd = report["score_delta"]["abs"]
        lines.append(
            f"same decision {a['same_decision']}/{c['joined']} = {_pct(a['rate'])}, identical "
            f"{a['identical']}, flips {a['flips']}: "
            + ", ".join(
                f"{k} {v}"
                for k, v in report["decision_flips"].items()
                if k.split("->")[0] != k.split("->")[1]
            )
        )
        lines.append(f"|score delta| p50 {sd['p50']}, p95 {sd['p95']}, max {sd['max']}")
        if report["feature_mismatches"]:
            top = list(report["feature_mismatches"].items())[:5]
            lines.append("feature mismatches: " + ", ".join(f"{k} {v}" for k, v in top))
        rec = report.get("recall_at_1pct_fpr")
        if rec:
            lines.append(f"recall at 1 % FPR: live {rec['live']}, replay {rec['replay']}")
    if report["differences_by_cause"]:
        lines.append("by cause: " + ", ".join(f"{k} {v}" for k, v in report["differences_by_cause"].items()))
    return lines


def _request_latency_line(lat: Mapping[str, Mapping[str, Any]]) -> str:
    """Live and replayed latency, each with what it measures: they are measured differently (a replayed
    copy keeps its old ``created_at``), so each is compared with itself across runs, not with the
    other (docs/architecture.md, "Replay")."""
    live, new = lat["live_created_to_reply"], lat["replay_copy_to_reply"]
    return (
        f"latency p50/p99 ms: live {live['p50_ms']}/{live['p99_ms']} (request created_at to reply made, "
        f"the live worker's timings.total_ms, {live['count']} replies that carry it); replay "
        f"{new['p50_ms']}/{new['p99_ms']} (copy sent to reply read, {new['count']} replies)"
    )


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.3f} %"
