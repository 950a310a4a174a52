"""The pure parts of replay and shadow (pipeline/replay/plan.py, compare.py, plot.py)."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from pipeline.replay import compare, plan
from pipeline.replay.plan import (
    PartitionRange,
    ReplayError,
    ReplayNames,
    ReplayRangeError,
    ReplaySettingError,
    ReplayTimeError,
    Throttle,
)
from pipeline.replyto import ReplyToPolicy
from pipeline.settings import Settings
from pipeline.topics import TopicNames

NOW = 1_735_689_600_000  # 2025-01-01T00:00:00Z


def test_times() -> None:
    assert plan.parse_time("now", NOW) == NOW
    assert plan.parse_time("1735689600123", NOW) == 1_735_689_600_123
    assert plan.parse_time("2025-01-01T00:00:00Z", NOW) == NOW
    assert plan.parse_time("2025-01-01T01:00:00+01:00", NOW) == NOW
    assert plan.parse_time("2025-01-01 00:00:01", NOW) == NOW + 1000  # no zone: UTC
    assert plan.parse_time("-2h", NOW) == NOW - 7_200_000
    assert plan.parse_time("now-30m", NOW) == NOW - 1_800_000
    assert plan.parse_time("-1.5s", NOW) == NOW - 1500
    with pytest.raises(ReplayTimeError, match="yesterday"):
        plan.parse_time("yesterday", NOW)
    with pytest.raises(ReplayRangeError) as err:
        plan.check_range(NOW, NOW - 5)
    assert (err.value.from_ms, err.value.to_ms) == (NOW, NOW - 5) and "-5 ms" in err.value.message


def test_names_are_the_replays_own() -> None:
    n = ReplayNames("surge", "surge.", "abc-1")
    assert (n.app_id, n.prefix) == ("surge-replay-abc-1", "surge.replay.abc-1.")
    assert n.topics.requests == "surge.replay.abc-1.requests"
    assert n.owns("surge.replay.abc-1.replies") and n.owns("surge-replay-abc-1-replybook-changelog")
    for live in (
        "surge.requests",
        "surge.replies",
        "surge-replybook-changelog",
        "surge.replay.abc-2.replies",
    ):
        assert not n.owns(live), live
    assert ReplayNames("surge", "surge.", "x", kind="shadow").prefix == "surge.shadow.x."
    with pytest.raises(ReplayError):
        ReplayNames("surge", "surge.", "a.b")
    assert plan.new_replay_id(NOW, "f00") == "20250101000000-f00"
    # the live policy refuses the replay's topics, so no client can reach them
    live = ReplyToPolicy(TopicNames("surge."), "surge")
    assert live.safe(n.topics.replies) == "surge.replies"


def test_ranges_by_timestamp() -> None:
    ranges = plan.plan_ranges(
        {0: 5, 1: None, 2: 0, 3: 7}, {0: 9, 1: None, 2: None, 3: 7}, {0: 20, 1: 4, 2: 3, 3: 10}
    )
    assert ranges == [PartitionRange(0, 5, 9), PartitionRange(2, 0, 3)]
    assert sum(r.count for r in ranges) == 7


def test_throttle_paces_records() -> None:
    t = [100.0]
    th = Throttle(10, lambda: t[0])
    assert [th.delay() for _ in range(3)] == pytest.approx([0, 0.1, 0.2])
    t[0] += 1.0  # idle: no debt carried forward
    assert th.delay() == 0
    assert Throttle(0, lambda: 0.0).delay(1000) == 0


#: the ids among req-0 .. req-199 in a 10 % sample: the first 8 bytes of sha256(id), big-endian, as a
#: fraction of 2**64, under 0.10 (computed once with hashlib, independently of plan.sampled)
PINNED_SAMPLED_10 = [
    "req-7", "req-21", "req-23", "req-30", "req-44", "req-54", "req-65", "req-67", "req-74", "req-85",
    "req-91", "req-126", "req-129", "req-130", "req-138", "req-149", "req-170", "req-171", "req-180",
    "req-187", "req-195",
]  # fmt: skip


def test_sampling_by_hash() -> None:
    ids = [f"req-{i}" for i in range(20_000)]
    share = sum(plan.sampled(i, 10) for i in ids) / len(ids)
    assert 0.09 < share < 0.11
    # the same ids in every process and every run (a hash of the id, not Python's salted hash()):
    # these were computed once and pinned
    assert [i for i in ids[:200] if plan.sampled(i, 10)] == PINNED_SAMPLED_10
    assert all(plan.sampled(i, 100) for i in ids[:10]) and not any(plan.sampled(i, 0) for i in ids[:10])
    # a larger share holds every request of a smaller one
    assert all(plan.sampled(i, 30) for i in ids if plan.sampled(i, 10))


def test_a_restarted_shadow_reads_live_replies_from_where_its_sampler_resumes() -> None:
    """The live-reply reader starts at the oldest first unread request of the sampler's partitions (a
    restarted shadow catches up from its committed offsets), or now when it has read them all; less a
    margin for replies stamped by another clock (docs/architecture.md, "Replay")."""
    skew = plan.LIVE_REPLY_SKEW_MS
    assert plan.live_replies_from({0: None, 1: NOW - 90_000, 2: NOW - 30_000}, NOW) == NOW - 90_000 - skew
    assert plan.live_replies_from({0: None, 1: None}, NOW) == NOW - skew
    assert plan.live_replies_from({}, NOW) == NOW - skew


def test_a_request_the_intake_sent_on_is_replayed_once() -> None:
    """A record without a key, or off its key's partition, was sent on by the live intake with the
    same bytes to the partition its key hashes to: the original is left out when that copy is in the
    range, kept when it is not (the copy fell after ``--to``)."""
    home = {b"alice": 1, b"bob": 0}.__getitem__
    records = [
        (0, None, b"unkeyed"),  # 0: sent on ...
        (1, b"alice", b"unkeyed"),  # 1: ... here: replayed
        (0, b"alice", b"off home"),  # 2: sent on, its copy after the range: kept
        (0, b"bob", b"served"),  # 3: on its home partition
        (1, b"alice", b"served"),  # 4: the same bytes again, on its home: both were served live
        (0, None, None),  # 5: an empty record: rejected where it landed
    ]
    assert plan.sent_on_originals(records, home) == {0}
    assert plan.sent_on_originals(records[1:], home) == set()


def test_rewrite_keeps_the_request_but_its_reply_to() -> None:
    live = ReplyToPolicy(TopicNames("surge."), "surge")
    req = {
        "request_id": "r1",
        "user_id": "u1",
        "prompt": "héllo",
        "created_at": 123,
        "reply_to": "surge.replies.gw-1",
    }
    c = plan.rewrite_request(json.dumps(req).encode(), "surge.replay.x.replies", live)
    assert json.loads(c.value) == {**req, "reply_to": "surge.replay.x.replies"}
    assert (c.ids, c.live_reply_topic) == (("u1", "r1"), "surge.replies.gw-1")
    bare = {"request_id": "r2", "user_id": "u1", "prompt": "hi"}
    c = plan.rewrite_request(json.dumps(bare).encode(), "surge.replay.x.replies", live)
    assert (
        json.loads(c.value)["reply_to"] == "surge.replay.x.replies" and c.live_reply_topic == "surge.replies"
    )
    # a reply_to live refused stays: the replay refuses it too, and answers on its own topic
    bad = {"request_id": "r3", "user_id": "u1", "prompt": "hi", "reply_to": "surge.work.realtime"}
    raw = json.dumps(bad).encode()
    c = plan.rewrite_request(raw, "surge.replay.x.replies", live)
    assert c.value == raw and c.live_reply_topic == "surge.replies"
    assert ReplyToPolicy(TopicNames("surge.replay.x."), "surge-replay-x").safe(bad["reply_to"]) == (
        "surge.replay.x.replies"
    )
    c = plan.rewrite_request(b"\xff not json", "surge.replay.x.replies", live)
    assert (c.value, c.ids, c.live_reply_topic) == (b"\xff not json", None, None)


def test_sets_and_worker_env() -> None:
    fields = list(Settings.model_fields)
    assert plan.parse_sets(["max_batch_size=16", "SURGE_FAQ_CONFIDENCE_FLOOR=0.5"], fields) == {
        "max_batch_size": "16",
        "faq_confidence_floor": "0.5",
    }
    for bad, why in (("app_id=x", "replay's own"), ("nope=1", "no setting"), ("max_batch_size", "KEY=VALUE")):
        with pytest.raises(ReplaySettingError, match=why):
            plan.parse_sets([bad], fields)
    n = ReplayNames("surge", "surge.", "r1")
    env = plan.worker_env(
        n,
        broker="kafka://h:1",
        data_dir="/d",
        partitions=3,
        role="all",
        model="echo",
        sets={"max_batch_size": "16", "cache_ttl_s": "60"},
    )
    assert env["SURGE_APP_ID"] == "surge-replay-r1" and env["SURGE_TOPIC_PREFIX"] == "surge.replay.r1."
    assert env["SURGE_DEADLINES_ENABLED"] == "false" and env["SURGE_DEGRADE_ENABLED"] == "false"
    # the default cache mode: exact repeats only, no merging
    assert env["SURGE_CACHE_ENABLED"] == "true" and env["SURGE_SEMANTIC_CACHE_ENABLED"] == "false"
    assert env["SURGE_DEDUP_ENABLED"] == "false"
    assert env["SURGE_REPLY_TOPIC_PATTERN"] == "" and env["SURGE_PARTITIONS"] == "3"
    assert env["SURGE_MODEL"] == "echo" and env["SURGE_MAX_BATCH_SIZE"] == "16"
    off = plan.worker_env(n, broker="b", data_dir="d", partitions=1, role="all", caches="off")
    assert off["SURGE_CACHE_ENABLED"] == "false" and off["SURGE_DEDUP_ENABLED"] == "false"
    live = plan.worker_env(n, broker="b", data_dir="d", partitions=1, role="all", caches="live")
    assert not {"SURGE_CACHE_ENABLED", "SURGE_DEDUP_ENABLED", "SURGE_SEMANTIC_CACHE_ENABLED"} & set(live)
    with pytest.raises(ReplayError, match="one of exact"):
        plan.worker_env(n, broker="b", data_dir="d", partitions=1, role="all", caches="some")
    assert plan.changed_settings("echo", "faq", {"max_wait_ms": "5"}) == ["model", "max_wait_ms"]
    assert plan.changed_settings("faq", "faq", {}) == []


def test_deadlines_can_be_turned_off() -> None:
    s = Settings.load(deadlines_enabled=False)
    assert all(s.deadline_ms(p) is None for p in ("realtime", "interactive", "batch", "offline"))
    assert Settings.load().deadline_ms("realtime") == 200


def test_edit_distance() -> None:
    assert compare.edit_distance("kitten", "sitting") == 3
    assert compare.edit_distance("", "abc") == 3 and compare.edit_distance("abc", "abc") == 0
    assert compare.normalized_edit_distance("kitten", "sitting") == pytest.approx(3 / 7)
    assert (
        compare.normalized_edit_distance(None, "x") == 1.0
        and compare.normalized_edit_distance(None, None) == 0
    )


def _ok(answer: str, served: str = "model", version: str = "m-1", **kw: object) -> dict[str, object]:
    return {
        "status": "ok",
        "answer": answer,
        "finish_reason": "stop",
        "served_from": served,
        "model_version": version,
        "timings": {"total_ms": 10.0},
        **kw,
    }


def _err(code: str, **kw: object) -> dict[str, object]:
    return {"status": "error", "error": {"code": code, "message": "m"}, "timings": {"total_ms": 30.0}, **kw}


def test_request_report_on_a_history_with_known_differences() -> None:
    keys = [("u", f"r{i}") for i in range(10)]
    live = {
        keys[0]: _ok("a"),
        keys[1]: _ok("b"),
        keys[2]: _ok("c", served="cache"),
        keys[3]: _err("deadline_exceeded"),
        keys[4]: _ok("busy", served="template", degradation_level=3),
        keys[5]: _ok("old answer", version="m-0"),
        keys[6]: _ok("kitten", served="merged"),
        keys[7]: _err("rate_limited"),
        keys[8]: _ok("xyz"),
    }
    new = {
        k: _ok(v)
        for k, v in zip(keys, ["a", "b", "c", "d", "real", "new answer", "sitting", "h", "xyw"], strict=False)
    }
    new[keys[5]] = _ok("new answer", version="m-1")
    new[keys[9]] = _ok("j")
    rep = compare.compare_requests(keys, live, new, replay_latency_ms={k: 5.0 for k in keys})
    assert rep["counts"] == {"replayed": 10, "joined": 9, "missing_live": 1, "missing_replay": 0}
    assert rep["agreement"]["same_outcome"] == 3 and rep["agreement"]["rate"] == pytest.approx(
        3 / 9, abs=1e-6
    )
    assert rep["differences_by_cause"] == {
        "live_deadline_exceeded": 1,
        "live_degraded": 1,
        "rate_limit_state": 1,
        "model_version_differs": 1,
        "live_shared_answer": 1,
        "unexplained": 1,
    }
    assert rep["agreement"]["unexplained"] == 1 and rep["agreement"]["explained"] == 5
    # comparable: live replies not merged, similar, templated, capped, late or overloaded: r0, r1, r2 (an
    # exact cache hit), r5, r7, r8
    assert (rep["agreement"]["comparable"], rep["agreement"]["comparable_same"]) == (6, 3)
    assert compare.timing_dependent(_ok("x", served="cache", similarity=0.93))
    assert not compare.timing_dependent(_ok("x", served="cache", similarity=1.0))
    assert rep["answers"]["both_ok"] == 7 and rep["answers"]["exact_match"] == 3  # a, b, c
    assert rep["served_from_shift"]["cache->model"] == 1 and rep["served_from_shift"]["none->model"] == 2
    ed = rep["_series"]["edit_distance"]
    assert sorted(ed)[-3:] == [1.0, 1.0, 1.0] and pytest.approx(3 / 7) in ed and pytest.approx(1 / 3) in ed
    assert rep["latency_ms"]["replay_copy_to_reply"]["p50_ms"] == 5.0
    assert rep["latency_ms"]["live_created_to_reply"]["count"] == 9
    assert {e["request_id"]: e["cause"] for e in rep["examples"]}["r8"] == "unexplained"
    # with a changed setting, what no other cause explains is put down to it
    rep = compare.compare_requests(keys, live, new, changed=["faq_confidence_floor"])
    assert (
        rep["differences_by_cause"].get("settings_changed") == 1
        and "unexplained" not in rep["differences_by_cause"]
    )
    text = "\n".join(compare.summary_lines(rep))
    assert "same outcome 3/9" in text and "cache->model 1" in text
    # the two latencies are measured differently, and the summary says how, with their counts
    (line,) = [x for x in text.splitlines() if x.startswith("latency")]
    assert "request created_at to reply made" in line and "timings.total_ms" in line
    assert "9 replies that carry it" in line and "copy sent to reply read, 0 replies" in line  # none given


def test_request_causes() -> None:
    c = compare.request_cause
    assert c(_ok("a"), _err("deadline_exceeded")) == "replay_deadline_exceeded"
    assert c(_err("overloaded"), _ok("a")) == "live_overloaded"
    assert c(_ok("a"), _ok("b", served="cache")) == "replay_shared_answer"
    assert c(_err("model_error"), _ok("a")) == "model_error"
    assert c(_err("invalid_request"), _ok("a")) == "invalid_request"
    assert set(compare.REQUEST_CAUSES) >= {"unexplained", "settings_changed"}


def _dec(
    decision: str, score: float | None, late: bool = False, rv: str = "v1", mv: str = "g1", **features: float
) -> dict[str, object]:
    return {
        "decision": decision,
        "score": score,
        "late": late,
        "rule_version": rv,
        "model_version": mv,
        "features": {"account_count_1h": 1, **features},
        "reasons": [],
        "timings": {"produce_to_decision_ms": 4.0},
    }


def test_risk_report() -> None:
    ids = [f"e{i}" for i in range(8)]
    live = {
        "e0": _dec("approve", 0.1),
        "e1": _dec("approve", 0.2),
        "e2": _dec("review", 0.5, card_count_1m=3),
        "e3": _dec("review", None, late=True),
        "e4": _dec("approve", 0.1, mv="g0"),
        "e5": _dec("decline", 0.9),
        "e6": _dec("approve", 0.05),
        "e7": _dec("approve", 0.3),
    }
    new = dict(live)
    new["e2"] = _dec("approve", 0.2, card_count_1m=1)
    new["e3"] = _dec("approve", 0.1)
    new["e4"] = _dec("review", 0.6)
    new["e7"] = _dec("review", 0.3, rv="v2")
    labels = {"e0": 0, "e1": 0, "e2": 1, "e3": 0, "e4": 1, "e5": 1, "e6": 0, "e7": 0}
    rep = compare.compare_risk(ids, live, new, labels=labels, replay_latency_ms={i: 2.0 for i in ids})
    assert rep["agreement"]["flips"] == 4 and rep["agreement"]["same_decision"] == 4
    assert rep["decision_flips"]["review->approve"] == 2 and rep["decision_flips"]["approve->review"] == 2
    assert rep["differences_by_cause"] == {
        "late_differs": 1,
        "model_version_differs": 1,
        "rule_version_differs": 1,
        "features_differ": 1,
    }
    assert rep["feature_mismatches"] == {"card_count_1m": 1}
    assert rep["score_delta"]["pairs"] == 7
    assert rep["score_delta"]["abs"]["max"] == pytest.approx(0.5)
    assert rep["score_delta"]["abs"]["p50"] == pytest.approx(0.0)
    rec = rep["recall_at_1pct_fpr"]
    # live: positives .5, .9 above every negative (max .3), e4 (.1) below; replay: .6, .9 above, e2 (.2) not
    assert rec["live"]["recall"] == pytest.approx(2 / 3) and rec["replay"]["recall"] == pytest.approx(2 / 3)
    assert "flips 4" in "\n".join(compare.summary_lines(rep))


def test_plots(tmp_path) -> None:  # type: ignore[no-untyped-def]
    from pipeline.replay.plot import plot_report

    keys = [("u", "r1"), ("u", "r2")]
    rep = compare.compare_requests(
        keys, {keys[0]: _ok("a")}, {keys[0]: _ok("b"), keys[1]: _ok("c")}, replay_latency_ms={keys[0]: 3.0}
    )
    r_png = plot_report(rep, tmp_path / "r.png")
    assert r_png is not None and r_png.stat().st_size > 10_000
    rrep = compare.compare_risk(["e"], {"e": _dec("approve", 0.1)}, {"e": _dec("review", 0.7)})
    k_png = plot_report(rrep, tmp_path / "k.png")
    assert k_png is not None and k_png.stat().st_size > 10_000
    assert "_series" not in compare.public(rep)


def test_a_replay_without_matplotlib_writes_no_plot_and_says_why(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """matplotlib is the ``plot`` extra, left out of worker images: the report goes on without a PNG."""
    from pipeline.replay.plot import plot_report

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib now fails
    keys = [("u", "r1")]
    rep = compare.compare_requests(keys, {keys[0]: _ok("a")}, {keys[0]: _ok("b")})
    assert plot_report(rep, tmp_path / "r.png") is None
    assert not (tmp_path / "r.png").exists()
    assert "surge[plot]" in caplog.text


def test_the_replay_starts_from_the_live_settings() -> None:
    from pydantic import SecretStr

    live = plan.live_env(
        {
            "model": "echo",
            "app_id": "surge",
            "degrade_up_queue_depth": (1.0, 2.0, 3.0),
            "dedup_enabled": True,
            "kafka_sasl_password": SecretStr("pw"),
            "model_path": None,
        }
    )
    assert live == {
        "SURGE_MODEL": "echo",
        "SURGE_DEGRADE_UP_QUEUE_DEPTH": "[1.0, 2.0, 3.0]",
        "SURGE_DEDUP_ENABLED": "true",
        "SURGE_KAFKA_SASL_PASSWORD": "pw",
    }
    n = ReplayNames("surge", "surge.", "r1")
    env = plan.worker_env(n, broker="b", data_dir="d", partitions=1, role="all", live=live)
    assert env["SURGE_MODEL"] == "echo" and env["SURGE_DEDUP_ENABLED"] == "false"
    env = plan.worker_env(n, broker="b", data_dir="d", partitions=1, role="all", live=live, caches="live")
    assert env["SURGE_DEDUP_ENABLED"] == "true" and "SURGE_CACHE_ENABLED" not in env
    assert (
        plan.worker_env(n, broker="b", data_dir="d", partitions=1, role="all", live=live, model="faq")[
            "SURGE_MODEL"
        ]
        == "faq"
    )


def test_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    from pipeline.cli import build_parser, main

    args = build_parser().parse_args(
        ["replay", "--from=-1h", "--model", "echo", "--set", "max_wait_ms=5", "--caches", "off"]
    )
    assert (args.topic, args.from_, args.to, args.sets, args.caches) == (
        "requests",
        "-1h",
        "now",
        ["max_wait_ms=5"],
        "off",
    )
    assert build_parser().parse_args(["shadow", "--percent", "5"]).percent == 5
    # refused before anything connects: a typed error, exit status 2
    assert main(["replay", "--from", "now-1h", "--set", "app_id=mine"]) == 2
    assert "replay's own" in capsys.readouterr().err
    assert main(["replay", "--from", "yesterday"]) == 2
    assert main(["replay"]) == 2


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["shadow", "--percent", "5", "--window", "0"], "--window"),
        (["shadow", "--percent", "5", "--window", "-1"], "--window"),
        (["shadow", "--percent", "0"], "--percent"),
        (["shadow", "--percent", "100.5"], "--percent"),
        (["replay", "--shadow", "0"], "--shadow"),
    ],
)
def test_shadow_flags_out_of_range_are_refused_naming_the_flag(
    argv: list[str], flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--window`` below 1 would keep no request (or fail on the first with a KeyError), and a share
    of 0 % mirrors nothing: refused by argparse (exit status 2) under the flag the user typed."""
    from pipeline.cli import build_parser

    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 2
    assert f"argument {flag}:" in capsys.readouterr().err
    assert build_parser().parse_args(["shadow", "--percent", "100", "--window", "1"]).window == 1


def test_a_shadow_asked_for_no_share_or_no_window_is_refused() -> None:
    """The same checks for a shadow started from Python, with typed errors that name the setting
    (not ``--shadow`` for ``surge shadow --percent``)."""
    from pipeline.replay.shadow import Shadow, ShadowOptions

    s = Settings.load(broker="kafka://127.0.0.1:1")
    with pytest.raises(plan.ShadowPercentError, match=r"shadow share 0 %.*surge shadow --percent") as err:
        Shadow(ShadowOptions(percent=0.0), s)
    assert isinstance(err.value, ReplayError) and err.value.percent == 0
    for window in (0, -1):
        with pytest.raises(plan.ShadowWindowError, match=f"shadow window {window}: .* at least 1"):
            Shadow(ShadowOptions(percent=5, window=window), s)


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (None, "cannot be read"),
        ('{"event_id": "a", "label": 1}\nnot json\n', "line 2: not JSON"),
        ('{"event_id": "a", "label": 1}\n[1, 2]\n', "line 2: not a JSON object"),
        ('{"event_id": "a", "label": "yes"}\n', "line 1: label 'yes' is not 0 or 1"),
    ],
)
async def test_a_bad_labels_file_is_refused_before_the_replay_connects(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    content: str | None,
    why: str,
) -> None:
    """``--labels`` is read before anything connects or is created: a missing file or a line that is
    not a label is a typed error (exit status 2 with its message), not a traceback after the whole
    replay with its topics left on the cluster."""
    from pipeline.cli import main
    from pipeline.replay.plan import ReplayLabelsError
    from pipeline.replay.runner import ReplayOptions, run_replay

    labels = tmp_path / "labels.jsonl"
    if content is not None:
        labels.write_text(content, encoding="utf-8")
    # nothing listens here: a replay that got as far as connecting would fail with another error
    nowhere = Settings.load(broker="kafka://127.0.0.1:1")
    opts = ReplayOptions(
        topic="risk-events",
        from_ms=NOW - 60_000,
        to_ms=NOW,
        labels_path=labels,
        out_dir=tmp_path / "out",
        quiet=True,
    )
    with pytest.raises(ReplayLabelsError, match=why) as err:
        await run_replay(opts, nowhere)
    assert isinstance(err.value, ReplayError) and err.value.path == str(labels)
    assert not (tmp_path / "out").exists()  # nothing made, not even the output folder
    monkeypatch.setenv("SURGE_BROKER", "kafka://127.0.0.1:1")
    argv = ["replay", "--topic", "risk-events", "--from=-1m", "--labels", str(labels), "--quiet"]
    assert await asyncio.to_thread(main, [*argv, "--out", str(tmp_path / "cli")]) == 2  # its own loop
    assert f"ReplayLabelsError: --labels {labels}" in capsys.readouterr().err
    assert not (tmp_path / "cli").exists()
    # what ``surge risk simulate`` writes loads: its ``sim_config`` line is skipped
    from pipeline.replay.runner import load_labels
    from pipeline.risk.simulate import SimConfig, write_jsonl

    sim = tmp_path / "sim.jsonl"
    write_jsonl(sim, [{"event_id": "e1", "label": 0}, {"event_id": "e2", "label": 1}], SimConfig())
    assert load_labels(sim) == {"e1": 0, "e2": 1}
