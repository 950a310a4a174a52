"""Unit tests of pipeline.settings: SURGE_* environment, frozen object, combination checks."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from pydantic import ValidationError

from pipeline.exceptions import SettingsError, SurgeError
from pipeline.settings import PRIORITIES, Settings


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts from the defaults, whatever SURGE_* the shell exported."""
    for name in list(os.environ):
        if name.upper().startswith("SURGE_"):
            monkeypatch.delenv(name)


def test_defaults_load_and_are_consistent() -> None:
    s = Settings.load()
    assert s.broker == "kafka://127.0.0.1:9092"
    assert s.topic_prefix == "surge."
    assert s.partitions == 8
    assert s.max_record_bytes == 1 << 20
    assert s.max_content_bytes == 32 << 10
    assert s.base_batch_size <= s.max_batch_size
    assert s.model == "faq"


def test_environment_overrides_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SURGE_MAX_BATCH_SIZE", "64")
    monkeypatch.setenv("SURGE_MAX_WAIT_MS", "2.5")
    monkeypatch.setenv("SURGE_SEMANTIC_THRESHOLD", "0.9")
    monkeypatch.setenv("SURGE_DEDUP_ENABLED", "false")
    monkeypatch.setenv("SURGE_TOPIC_PREFIX", "t1.")
    monkeypatch.setenv("SURGE_DATA_DIR", "/tmp/surge-x")
    monkeypatch.setenv("surge_partitions", "3")  # case-insensitive
    s = Settings.load()
    assert s.max_batch_size == 64
    assert s.max_wait_ms == 2.5
    assert s.semantic_threshold == 0.9
    assert s.dedup_enabled is False
    assert s.topic_prefix == "t1."
    assert s.data_dir == Path("/tmp/surge-x")
    assert s.partitions == 3


def test_overrides_beat_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SURGE_ROLE", "intake")
    assert Settings.load().role == "intake"
    assert Settings.load(role="inference").role == "inference"


def test_invalid_env_value_raises_settings_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SURGE_PARTITIONS", "zero")
    with pytest.raises(SettingsError, match="partitions"):
        Settings.load()
    monkeypatch.setenv("SURGE_PARTITIONS", "4")
    monkeypatch.setenv("SURGE_ROLE", "everything")
    with pytest.raises(SettingsError, match="role"):
        Settings.load()


def test_settings_error_is_a_surge_error() -> None:
    with pytest.raises(SurgeError):
        Settings.load(semantic_threshold=1.5)


def test_settings_are_frozen() -> None:
    s = Settings.load()
    with pytest.raises(ValidationError, match="frozen"):
        s.max_batch_size = 3  # type: ignore[misc]
    assert s.max_batch_size == 32


# ---- invalid combinations: the message names both values ----------------------------------------
def test_base_batch_size_above_max_batch_size(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SURGE_BASE_BATCH_SIZE", "40")
    with pytest.raises(SettingsError) as info:
        Settings.load(max_batch_size=16)
    assert "base_batch_size=40" in str(info.value) and "max_batch_size=16" in str(info.value)
    assert Settings.load(base_batch_size=16, max_batch_size=16).base_batch_size == 16


@pytest.mark.parametrize(
    ("realtime", "interactive", "batch", "named"),
    [
        (600, 500, 5000, ("deadline_realtime_ms=600", "deadline_interactive_ms=500")),
        (200, 6000, 5000, ("deadline_interactive_ms=6000", "deadline_batch_ms=5000")),
    ],
)
def test_deadlines_must_not_shrink_with_priority(
    realtime: int, interactive: int, batch: int, named: tuple[str, str]
) -> None:
    with pytest.raises(SettingsError) as info:
        Settings.load(
            deadline_realtime_ms=realtime, deadline_interactive_ms=interactive, deadline_batch_ms=batch
        )
    for part in named:
        assert part in str(info.value)


def test_equal_deadlines_are_allowed() -> None:
    s = Settings.load(deadline_realtime_ms=300, deadline_interactive_ms=300, deadline_batch_ms=300)
    assert [s.deadline_ms(p) for p in PRIORITIES[:3]] == [300, 300, 300]


def test_offline_deadline_shorter_than_batch_is_rejected() -> None:
    # offline is the least urgent class: a (non-zero) offline deadline shorter than the batch one
    # shrinks with priority just as interactive < realtime would
    with pytest.raises(SettingsError) as info:
        Settings.load(deadline_batch_ms=5000, deadline_offline_ms=100)
    assert "deadline_offline_ms=100" in str(info.value) and "deadline_batch_ms=5000" in str(info.value)


def test_model_hf_needs_model_path() -> None:
    with pytest.raises(SettingsError) as info:
        Settings.load(model="hf")
    assert "model='hf'" in str(info.value) and "model_path" in str(info.value)
    assert Settings.load(model="hf", model_path="/models/tiny").model_path == "/models/tiny"


def test_model_remote_needs_remote_base_url() -> None:
    with pytest.raises(SettingsError) as info:
        Settings.load(model="remote")
    assert "model='remote'" in str(info.value) and "remote_base_url" in str(info.value)
    s = Settings.load(model="remote", remote_base_url="http://127.0.0.1:8001/v1")
    assert s.remote_base_url == "http://127.0.0.1:8001/v1"


# ---- derived values -------------------------------------------------------------------------------
def test_deadline_ms_per_class_and_none_for_zero_offline() -> None:
    s = Settings.load()
    assert s.deadline_ms("realtime") == s.deadline_realtime_ms == 200
    assert s.deadline_ms("interactive") == 500
    assert s.deadline_ms("batch") == 5000
    assert s.deadline_offline_ms == 0 and s.deadline_ms("offline") is None
    assert Settings.load(deadline_offline_ms=60_000).deadline_ms("offline") == 60_000


def test_api_key_tenants(monkeypatch: pytest.MonkeyPatch) -> None:
    assert Settings.load().api_key_tenants() == {}
    monkeypatch.setenv("SURGE_API_KEYS", "k1:acme, k2:globex ,k3,, k4:")
    assert Settings.load().api_key_tenants() == {
        "k1": "acme",
        "k2": "globex",
        "k3": "default",
        "k4": "default",
    }


def test_bootstrap_servers_strip_the_scheme(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SURGE_BROKER", "kafka://a:1,kafka://b:2")
    assert Settings.load().bootstrap_servers == "a:1,b:2"
    assert Settings.load(broker="h1:9092").bootstrap_servers == "h1:9092"
    assert Settings.load().bootstrap_servers == "a:1,b:2"  # cached per object, not per class


def test_every_field_is_documented() -> None:
    undocumented = [name for name, f in Settings.model_fields.items() if not (f.description or "").strip()]
    assert undocumented == []
    assert len(Settings.model_fields) > 40


def test_the_readme_settings_table_says_what_each_field_says() -> None:
    """A row per field, its description word for word: the README is where an operator looks a
    setting up, and a description changed in code only had left its row behind (four had drifted)."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    rows = {
        m.group(1): m.group(2)
        for m in re.finditer(r"^\| `SURGE_([A-Z0-9_]+)` \| .*? \| (.*) \|$", readme, re.MULTILINE)
    }
    missing = [name for name in Settings.model_fields if name.upper() not in rows]
    assert missing == []
    differ = [name for name, f in Settings.model_fields.items() if rows[name.upper()] != f.description]
    assert differ == []


def test_settings_defaults_are_the_pure_configs_defaults() -> None:
    """Each default is defined once, in the pure module; Settings takes it from there."""
    from pipeline.degrade import DegradeConfig
    from pipeline.ratelimit import RateLimitConfig, TierLimits
    from pipeline.scheduler import SchedulerConfig

    s = Settings.load()
    sched = SchedulerConfig()
    assert {p: s.deadline_ms(p) for p in PRIORITIES} == {p.value: ms for p, ms in sched.deadline_ms.items()}
    assert set(sched.queue_limit.values()) == {s.queue_limit_per_class}
    assert (sched.max_batch_size, sched.base_batch_size, sched.max_wait_ms) == (
        s.max_batch_size,
        s.base_batch_size,
        s.max_wait_ms,
    )
    deg = DegradeConfig()
    assert (deg.up_queue_depth, deg.down_queue_depth, deg.up_miss_rate, deg.down_miss_rate) == (
        s.degrade_up_queue_depth,
        s.degrade_down_queue_depth,
        s.degrade_up_miss_rate,
        s.degrade_down_miss_rate,
    )
    assert (deg.cooldown_ms, deg.max_tokens_cap) == (s.degrade_cooldown_ms, s.degrade_max_tokens_cap)
    rl = RateLimitConfig()
    assert dict(rl.users) == {
        "free": TierLimits(s.user_rate_per_s_free, s.user_burst_free),
        "standard": TierLimits(s.user_rate_per_s_standard, s.user_burst_standard),
        "premium": TierLimits(s.user_rate_per_s_premium, s.user_burst_premium),
    }
    assert rl.tenant == TierLimits(s.tenant_rate_per_s, s.tenant_burst)


def test_a_poll_cannot_overfill_a_paused_stream_buffer() -> None:
    """Faust hands a poll's records to the streams in order and waits on a full stream buffer, so a
    reader blocked on admission (a lower class) would hold real-time records behind it: the buffer
    must hold what can still arrive after the pause at 80 % (two polls in flight)."""
    from pipeline.app import create_app

    s = Settings.load()
    assert s.stream_buffer_max_records >= 10 * s.max_poll_records
    app = create_app(s)
    assert app.conf.broker_max_poll_records == s.max_poll_records
    assert app.conf.stream_buffer_maxsize == s.stream_buffer_max_records
    with pytest.raises(SettingsError, match="10 x max_poll_records"):
        Settings.load(stream_buffer_max_records=256, max_poll_records=200)


def test_a_survivor_hears_of_a_dead_member_within_a_second_of_its_session_expiring() -> None:
    """The group coordinator tells the other members of a rebalance in a heartbeat reply: the
    heartbeat interval bounds how long after the session timeout a survivor takes a killed worker's
    partitions (issue: served again within session timeout + 3 s)."""
    from pipeline.app import create_app

    app = create_app(Settings.load())
    assert app.conf.broker_session_timeout == 6.0
    assert app.conf.broker_heartbeat_interval <= 1.0
    short = create_app(Settings.load(session_timeout_s=4))
    assert short.conf.broker_heartbeat_interval <= 0.4


def test_escalation_needs_a_key_and_the_risk_role_is_a_group_of_its_own() -> None:
    with pytest.raises(SettingsError, match="risk_escalation_key"):
        Settings.load(risk_escalation_enabled=True)
    s = Settings.load(risk_escalation_enabled=True, risk_escalation_key="k" * 32)
    assert s.risk_escalation_replies == "surge.replies.risk"
    assert "k" * 32 not in repr(s)  # a secret
    # a reply topic the request path would refuse: every escalation would go unanswered
    for name in ("surge.risk.decisions", "elsewhere"):
        with pytest.raises(SettingsError, match="risk_escalation_reply_topic"):
            Settings.load(
                risk_escalation_enabled=True, risk_escalation_key="k", risk_escalation_reply_topic=name
            )
    # a risk worker must not share the request path's consumer group (docs/architecture.md,
    # "Risk: the chain"): Faust's assignor hands every member the leader's global tables
    assert Settings.load(role="risk").group_id == "surge-risk"
    assert {Settings.load(role=r).group_id for r in ("all", "intake", "inference")} == {"surge"}


@pytest.mark.parametrize(
    ("env", "named"),
    [
        # each loaded, and failed later: at the worker's start with a traceback naming no setting,
        # in every command, or never (a miss rate of 2 is never reached)
        ({"SURGE_REPLY_TOPIC_PATTERN": "surge.replies(["}, "reply_topic_pattern"),
        ({"SURGE_DEGRADE_UP_QUEUE_DEPTH": "64,128,256"}, "degrade_up_queue_depth"),
        (
            {"SURGE_DEGRADE_UP_QUEUE_DEPTH": "[256,128,64]", "SURGE_DEGRADE_DOWN_QUEUE_DEPTH": "[16,8,4]"},
            "degrade_up_queue_depth thresholds must increase",
        ),
        ({"SURGE_DEGRADE_UP_MISS_RATE": "[2,5,9]"}, "degrade_up_miss_rate"),
        ({"SURGE_MAX_CONTENT_BYTES": str(2 << 20)}, "max_content_bytes"),
    ],
)
def test_settings_a_worker_could_not_use_are_refused_at_load_naming_them(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], named: str
) -> None:
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SettingsError, match=re.escape(named)):
        Settings.load()
