"""Unit tests of pipeline.cli: the argument parser, and two commands that need no broker."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline import cli
from pipeline.auth import KEY_ID_HEADER, sign
from pipeline.cli import build_parser
from pipeline.exceptions import InvalidRequestError

ROOT = Path(__file__).resolve().parents[1]


def parse(*argv: str):
    return build_parser().parse_args(list(argv))


@pytest.mark.parametrize("action", ["start", "stop", "status"])
def test_kafka_actions(action: str) -> None:
    args = parse("kafka", action, "--data-dir", "/tmp/k", "--port", "19092")
    assert (args.command, args.action, args.data_dir, args.port) == ("kafka", action, "/tmp/k", 19092)
    assert args.fn is cli.cmd_kafka
    default = parse("kafka", action)
    assert default.data_dir == ".surge-kafka" and default.port is None


@pytest.mark.parametrize("role", ["intake", "inference", "all", "risk"])
def test_worker_role(role: str) -> None:
    args = parse("worker", "--role", role, "--web-port", "6070")
    assert (args.role, args.web_port, args.fn) == (role, 6070, cli.cmd_worker)
    assert parse("worker").role is None  # the setting (SURGE_ROLE) decides


def test_send_flags() -> None:
    args = parse(
        "send",
        "how do I top up my card",
        "--user",
        "u7",
        "--tenant",
        "acme",
        "--tier",
        "premium",
        "--priority",
        "realtime",
        "--max-tokens",
        "64",
        "--request-id",
        "r-1",
        "--timeout-s",
        "2.5",
    )
    assert args.prompt == "how do I top up my card"
    assert (args.user, args.tenant, args.tier, args.priority) == ("u7", "acme", "premium", "realtime")
    assert (args.max_tokens, args.request_id, args.timeout_s) == (64, "r-1", 2.5)
    assert args.fn is cli.cmd_send
    default = parse("send", "hi")
    # left out of the record unless given: the record's defaults, or a signing key's own
    assert (default.tenant, default.tier, default.priority, default.max_tokens) == (None, None, None, 256)
    assert default.api_key is None
    assert parse("send", "hi", "--api-key", "k-1").api_key == "k-1"


def test_send_signs_with_the_flag_or_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cli.SEND_API_KEY_ENV, raising=False)
    assert cli.send_signer(None) is None
    monkeypatch.setenv(cli.SEND_API_KEY_ENV, "k-env")
    env_key = cli.send_signer(None)
    assert env_key is not None and env_key.key == "k-env"
    flag_key = cli.send_signer("k-flag")
    assert flag_key is not None and flag_key.key == "k-flag", "the flag wins over the environment"
    assert dict(sign(flag_key, b"{}"))[KEY_ID_HEADER] == flag_key.key_id.encode()
    with pytest.raises(InvalidRequestError, match="printable ASCII"):
        cli.send_signer("has a space")


def test_tail_flags() -> None:
    args = parse("tail", "--topic", "my.replies", "--from-beginning")
    assert (args.topic, args.from_beginning, args.fn) == ("my.replies", True, cli.cmd_tail)
    assert parse("tail").from_beginning is False


def test_demo_flags() -> None:
    args = parse("demo", "--n", "50", "--rate", "12.5", "--summary-json", "out.json", "--quiet")
    assert (args.n, args.rate, args.summary_json, args.quiet) == (50, 12.5, "out.json", True)
    assert args.fn is cli.cmd_demo
    default = parse("demo")
    assert (default.n, default.rate, default.summary_json) == (200, 20.0, None)


@pytest.mark.parametrize("action", ["train", "eval"])
def test_faq_actions(action: str) -> None:
    args = parse("faq", action, "--data", "train.csv")
    assert (args.action, args.data, args.fn) == (action, "train.csv", cli.cmd_faq)


def test_faq_needs_data() -> None:
    with pytest.raises(SystemExit):
        parse("faq", "train")


def test_dedup_eval_flags() -> None:
    args = parse("dedup", "eval", "--pairs", "sts.csv", "--thresholds", "0.8:0.95:0.01", "--json", "d.json")
    assert (args.action, args.pairs, args.thresholds, args.json) == (
        "eval",
        "sts.csv",
        "0.8:0.95:0.01",
        "d.json",
    )
    assert args.fn is cli.cmd_dedup
    assert parse("dedup", "eval", "--pairs", "p.csv").thresholds is None


@pytest.mark.parametrize("scenario", ["batching", "merging", "priority", "overhead", "gateway", "risk"])
def test_bench_scenarios(scenario: str) -> None:
    args = parse("bench", scenario, "--quick", "--json", "b.json", "--plot", "b.png")
    assert (args.scenario, args.quick, args.json, args.plot) == (scenario, True, "b.json", "b.png")
    assert args.fn is cli.cmd_bench
    assert parse("bench", scenario).quick is False


def test_bench_limit_qps_fixes_l_for_the_load_scenarios_only() -> None:
    from pipeline.devtools.bench import run_bench
    from pipeline.devtools.bench.common import BenchError

    assert parse("bench", "failover", "--limit-qps", "120").limit_qps == 120.0
    assert parse("bench", "surge").limit_qps is None
    # refused before anything starts: a scenario that offers no multiple of L, or no positive L
    with pytest.raises(BenchError, match="applies to surge and failover"):
        run_bench("merging", limit_qps=100.0)
    with pytest.raises(BenchError, match="positive"):
        run_bench("surge", limit_qps=0.0)


def test_a_wrong_limit_qps_is_one_line_and_exit_status_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["bench", "merging", "--limit-qps", "100"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "surge: BenchError: --limit-qps applies to surge and failover, not merging"


def test_a_given_limit_is_offered_without_measuring_the_model(monkeypatch: pytest.MonkeyPatch) -> None:
    from pipeline.devtools.bench import surge
    from pipeline.settings import Settings

    def measured(*_: object) -> dict[str, float]:
        raise AssertionError("L was measured although it was given")

    monkeypatch.setattr(surge, "measure_limit", measured)
    holdout = [(f"how do I close account number {i}", "close_account") for i in range(60)]
    offered = surge.Offered.measure(
        "t", (holdout, set()), Settings(), 2, lambda lim: 0.5 * lim, "offering", given_qps=120.0
    )
    assert offered.limit_rps == 120.0 and offered.rate == 60.0
    assert offered.limit["given"] is True


def test_gateway_port() -> None:
    args = parse("gateway", "--port", "8080")
    assert (args.port, args.fn) == (8080, cli.cmd_gateway)
    assert parse("gateway").port is None


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["launch"],
        ["kafka", "restart"],
        ["kafka"],
        ["worker", "--role", "gpu"],
        ["send", "hi", "--priority", "urgent"],
        ["send", "hi", "--tier", "gold"],
        ["send", "hi", "--max-tokens", "many"],
        ["send"],
        ["faq", "test", "--data", "x.csv"],
        ["dedup", "train", "--pairs", "p.csv"],
        ["dedup", "eval"],
        ["bench", "latency"],
        ["bench"],
        ["demo", "--n", "lots"],
        ["gateway", "--port", "http"],
        ["kafka", "status", "--bogus"],
    ],
)
def test_rejects_unknown_choices_and_bad_values(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        parse(*argv)
    assert info.value.code == 2
    assert "usage: surge" in capsys.readouterr().err


def _run(*argv: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SURGE_")}
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_help_runs_in_a_subprocess() -> None:
    proc = _run("--help")
    assert proc.returncode == 0, proc.stderr
    for command in ["kafka", "worker", "send", "tail", "demo", "faq", "dedup", "bench", "gateway", "risk"]:
        assert command in proc.stdout


def test_kafka_status_on_an_empty_data_dir_says_not_running(tmp_path: Path) -> None:
    proc = _run("kafka", "status", "--data-dir", str(tmp_path))
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.strip() == "not running"
    assert list(tmp_path.iterdir()) == []  # a status check writes nothing


def test_kafka_stop_when_not_running_exits_0(tmp_path: Path) -> None:
    assert cli.main(["kafka", "stop", "--data-dir", str(tmp_path)]) == 0


def test_settings_error_exits_2_with_a_message(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SURGE_BASE_BATCH_SIZE", "64")
    monkeypatch.setenv("SURGE_MAX_BATCH_SIZE", "8")
    # send reads the settings before it touches a broker
    assert cli.main(["send", "hi", "--timeout-s", "1"]) == 2
    err = capsys.readouterr().err
    assert "SettingsError" in err and "base_batch_size=64" in err and "max_batch_size=8" in err


def test_risk_demo_escalation_flags_make_valid_settings_for_both_workers(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``surge risk demo --escalate-url``: both workers must accept the settings the demo gives them
    (a key, a budget with the wait 50 ms past it), or the demo stops at its first worker."""
    from pipeline.riskops import Escalate
    from pipeline.settings import Settings

    args = build_parser().parse_args(
        ["risk", "demo", "--escalate-url", "http://llm:8000/v1", "--escalate-model", "deepseek-chat"]
    )
    assert (args.escalate_url, args.escalate_model, args.escalate_budget_ms) == (
        "http://llm:8000/v1",
        "deepseek-chat",
        None,
    )
    env = Escalate(args.escalate_url, args.escalate_model, 800).env()
    assert env["SURGE_RISK_ESCALATION_KEY"] != Escalate("u").env()["SURGE_RISK_ESCALATION_KEY"]  # per run
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    risk = Settings.load(role="risk")
    assert risk.risk_escalation_enabled and risk.risk_escalation_budget_ms == 800
    assert risk.risk_escalation_wait_max_ms == 850
    requests = Settings.load(role="all", model="remote", remote_base_url="http://llm:8000/v1")
    assert requests.risk_escalation_replies == risk.risk_escalation_replies


# ---- surge send / tail as a user meets them ------------------------------------------------------
def test_send_refuses_a_request_a_worker_would_only_dead_letter_before_connecting(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """An empty user id got no reply at all (the worker dead-letters a record without ids), so
    ``surge send`` waited its whole timeout and ended in a TimeoutError traceback."""
    monkeypatch.setenv("SURGE_BROKER", "kafka://127.0.0.1:1")  # never reached: refused before
    assert cli.main(["send", "hello", "--user", ""]) == 2
    err = capsys.readouterr().err
    assert "InvalidRequestError" in err and "user_id" in err and "Traceback" not in err


def test_send_wants_a_timeout_above_zero(capsys: pytest.CaptureFixture[str]) -> None:
    for bad in ("0", "-1", "nan", "soon"):
        with pytest.raises(SystemExit) as exc:
            build_parser().parse_args(["send", "hi", "--timeout-s", bad])
        assert exc.value.code == 2
        assert "--timeout-s" in capsys.readouterr().err


@pytest.mark.parametrize("command", [["send", "hello"], ["tail"]])
def test_send_and_tail_say_in_one_line_that_the_broker_cannot_be_reached(
    command: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both printed a KafkaConnectionError traceback, then warnings about clients left open."""
    monkeypatch.setenv("SURGE_BROKER", f"kafka://127.0.0.1:{_closed_port()}")
    assert cli.main(command) == 2
    err = capsys.readouterr().err
    assert "BrokerError: cannot reach Kafka" in err and "Traceback" not in err
    assert "Unclosed" not in err


def _closed_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
