"""Security of the edge (issue 11): API keys bound to a tenant, tier and highest priority; users
namespaced under their tenant; gateway edge cases; marked templates; the worker's web port; Kafka
TLS/SASL settings.

Pure parts first (no broker), then from outside: the official ``openai`` client and raw HTTP
against in-process gateways, real ``surge worker`` processes (echo model) and the real broker, and
last a second embedded broker with a SASL_PLAINTEXT listener that a worker and surge's clients
connect through.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import ssl
import subprocess
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from models.template import BUSY_ANSWER, TextTemplate, build_template
from pipeline import auth
from pipeline.admin import ensure_topics
from pipeline.app import WEB_VIEWS_OFF, create_app, faust_credentials
from pipeline.auth import ApiKey, KeyRing, parse_api_keys, tenant_user_id
from pipeline.client import SurgeClient
from pipeline.devtools.broker import EmbeddedKafka, free_port
from pipeline.exceptions import (
    ApiKeyConfigError,
    BrokerError,
    InvalidRequestError,
    PermissionDeniedError,
    SettingsError,
)
from pipeline.gateway import SERVED_FROM_HEADER, start_gateway
from pipeline.gateway_format import TEMPLATE_FINISH_REASON, build_request
from pipeline.kafka_security import client_options, ssl_context
from pipeline.records import InferenceReply
from pipeline.settings import Settings
from tests.conftest import Deployment

# ---- API keys, grants and user namespaces (pure) ----------------------------------------------------


def test_key_list_form_keeps_the_old_forms_and_adds_tier_and_max_priority() -> None:
    keys = parse_api_keys(" k1:acme:free:batch, k2:globex:premium:realtime ,k3:acme,k4,, k5:beta:premium")
    assert [(k.key, k.tenant, k.tier, k.max_priority) for k in keys] == [
        ("k1", "acme", "free", "batch"),
        ("k2", "globex", "premium", "realtime"),
        ("k3", "acme", "standard", "interactive"),
        ("k4", "default", "standard", "interactive"),
        ("k5", "beta", "premium", "interactive"),
    ]
    assert "k1" not in repr(keys[0]), "a key never shows in a repr (logs)"
    assert Settings(api_keys="k1:acme,k2").api_key_tenants() == {"k1": "acme", "k2": "default"}


def test_key_json_forms() -> None:
    as_list = parse_api_keys('[{"key": "k1", "tenant": "acme", "tier": "free", "max_priority": "batch"}]')
    as_map = parse_api_keys(
        '{"k1": {"tenant": "acme", "tier": "free", "max_priority": "batch"}, "k2": "beta"}'
    )
    assert as_list[0] == as_map[0] == ApiKey("k1", "acme", "free", "batch")
    assert as_map[1] == ApiKey("k2", "beta", "standard", "interactive")


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("k1:acme:gold", "entry 1: tier 'gold'"),
        ("k1:acme,k2:acme:free:urgent", "entry 2: max_priority 'urgent'"),
        ("k1:a/b", "entry 1: tenant 'a/b'"),
        ("k1:acme,k1:beta", "entry 2 repeats an earlier key"),
        ("k1:acme:free:batch:x", "has 5 fields"),
        ('[{"key": "k1", "tenant": "acme", "admin": true}]', "unknown fields ['admin']"),
        ("[1, 2", "does not parse"),
        ("secret with space:acme", "printable ASCII"),
    ],
)
def test_bad_key_config_fails_at_start_without_showing_the_key(text: str, needle: str) -> None:
    with pytest.raises(ApiKeyConfigError) as info:
        parse_api_keys(text)
    assert needle in info.value.message
    with pytest.raises(SettingsError) as info:
        Settings.load(api_keys=text)
    assert needle in str(info.value)
    assert "secret" not in str(info.value)


def test_a_key_may_lower_its_tier_and_priority_never_raise_them() -> None:
    key = ApiKey("k", "acme", tier="standard", max_priority="interactive")
    assert key.grant(None, None) == ("standard", "interactive")
    assert key.grant("free", "offline") == ("free", "offline")
    with pytest.raises(PermissionDeniedError) as info:
        key.grant("premium", None)
    assert (
        "tier up to 'standard', got 'premium'" in info.value.message
        and info.value.code == "permission_denied"
    )
    with pytest.raises(PermissionDeniedError) as info:
        key.grant(None, "realtime")
    assert "priority up to 'interactive', got 'realtime'" in info.value.message


def test_key_lookup_compares_every_key_in_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    ring = KeyRing(parse_api_keys("k-first:acme,k-second:beta,k-third:gamma"))
    calls: list[tuple[bytes, bytes]] = []
    compare = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return compare(a, b)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    for presented, tenant in (("k-first", "acme"), ("k-third", "gamma"), ("k-fir", None), ("ключ", None)):
        calls.clear()
        found = ring.lookup(presented)
        assert (found.tenant if found else None) == tenant
        assert len(calls) == 3, "every configured key is compared, also after a match"
        assert {len(a) for a, _ in calls} == {len(b) for _, b in calls} == {32}, "digests: no length leak"


def test_users_are_namespaced_under_their_tenant() -> None:
    assert tenant_user_id("acme", "alice") == "acme/alice"
    assert tenant_user_id("acme", "beta/alice") != tenant_user_id("beta", "alice"), "tenants hold no '/'"
    with pytest.raises(InvalidRequestError) as info:
        tenant_user_id("acme", "u" * 124)
    assert "at most 123 characters for tenant 'acme'" in info.value.message


BODY = {"messages": [{"role": "user", "content": "hello"}]}


def build(key: ApiKey, body: Any = None, headers: dict[str, str] | None = None) -> dict[str, Any]:
    raw = body if isinstance(body, bytes) else json.dumps(BODY if body is None else body).encode()
    return build_request(
        raw,
        headers or {},
        settings=Settings(model="echo"),
        request_id="r1",
        key=key,
        reply_to="surge.replies.gateway-x",
        created_at_ms=1,
    ).request


def test_the_request_carries_the_keys_tenant_tier_and_priority() -> None:
    free = ApiKey("k", "acme", tier="free", max_priority="interactive")
    req = build(free, {**BODY, "user": "bob", "tenant": "beta"})
    assert (req["tenant"], req["user_id"], req["tier"], req["priority"]) == (
        "acme",
        "acme/bob",
        "free",
        "interactive",
    )
    assert build(free, headers={"X-Surge-Priority": "batch"})["priority"] == "batch"
    for body, headers in (
        ({**BODY, "tier": "premium"}, {}),
        (BODY, {"X-Surge-Tier": "standard"}),
        (BODY, {"X-Surge-Priority": "realtime"}),
        ({**BODY, "priority": "realtime"}, {}),
    ):
        with pytest.raises(PermissionDeniedError):
            build(free, body, headers)


@pytest.mark.parametrize(
    ("raw", "headers", "needle"),
    [
        (b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", {}, "nests JSON"),
        (b'{"max_tokens": 1' + b"0" * 5000 + b', "messages": []}', {}, "cannot be read"),
        (None, {"X-Surge-Deadline-Ms": "\u00b2"}, "ASCII digits"),
        (None, {"X-Surge-Deadline-Ms": "\u0661\u0662\u0663"}, "ASCII digits"),
        (None, {"X-Surge-Deadline-Ms": "9" * 5000}, "ASCII digits"),
        (b'{"messages": [{"role": ["user"], "content": "hi"}]}', {}, "messages[0].role must be one of"),
        (b'{"messages": [{"role": {"a": 1}, "content": "hi"}]}', {}, "messages[0].role must be one of"),
        (None, {"X-Surge-Deadline-Ms": "0"}, "integer 1-604800000"),
        (None, {"X-Surge-Deadline-Ms": "999999999999"}, "integer 1-604800000"),
        (
            b'{"deadline_ms": 1' + b"0" * 400 + b', "messages": [{"role": "user", "content": "hi"}]}',
            {},
            "1-604800000",
        ),
    ],
)
def test_edge_case_bodies_and_headers_are_invalid_requests(
    raw: bytes | None, headers: dict, needle: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        build(ApiKey("k", "acme"), raw, headers)
    assert needle in info.value.message


# ---- templates (pure) ----------------------------------------------------------------------------


def test_the_template_is_a_busy_message_for_other_models_and_configurable() -> None:
    echo = build_template(Settings(model="echo"), model=TextTemplate("model"))
    assert isinstance(echo, TextTemplate) and echo.text == BUSY_ANSWER
    remote = Settings(model="remote", remote_base_url="http://127.0.0.1:1/v1")
    tmpl = build_template(remote, model=TextTemplate("model"))
    assert isinstance(tmpl, TextTemplate) and tmpl.text == BUSY_ANSWER and "card" not in tmpl.text
    out = tmpl.template_answer(None)  # type: ignore[arg-type]
    assert (out.answer, out.finish_reason) == (BUSY_ANSWER, "template")
    custom = build_template(
        Settings(model="echo", degrade_template="Busy: retry in 1 min"), TextTemplate("m")
    )
    assert isinstance(custom, TextTemplate) and custom.text == "Busy: retry in 1 min"
    assert build_template(Settings(model="echo", degrade_enabled=False), TextTemplate("m")) is None

    from models.faq import FAQAnswerer

    faq_model = TextTemplate("stands for the FAQ model")
    assert build_template(Settings(model="faq"), faq_model) is faq_model, "model=faq answers itself"
    assert isinstance(
        build_template(remote.model_copy(update={"degrade_template": "faq"}), faq_model), FAQAnswerer
    )


# ---- Kafka security settings (pure, with real certificate files) -------------------------------------


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A self-signed CA and a client certificate it signed, made with openssl."""
    d = tmp_path_factory.mktemp("certs")

    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    run(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=surge-test-ca",
    )
    run(
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "client.key",
        "-out",
        "client.csr",
        "-subj",
        "/CN=surge-client",
    )
    run(
        "x509",
        "-req",
        "-in",
        "client.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "client.pem",
        "-days",
        "2",
    )
    return {name: d / name for name in ("ca.pem", "client.pem", "client.key")}


def test_security_settings_are_checked_at_start(certs: dict[str, Path]) -> None:
    with pytest.raises(SettingsError, match="needs kafka_sasl_username and kafka_sasl_password"):
        Settings.load(kafka_security_protocol="SASL_SSL", kafka_sasl_username="u")
    with pytest.raises(SettingsError, match="does not use TLS"):
        Settings.load(kafka_ssl_cafile=certs["ca.pem"])
    with pytest.raises(SettingsError, match="needs kafka_ssl_certfile"):
        Settings.load(kafka_security_protocol="SSL", kafka_ssl_keyfile=certs["client.key"])
    s = Settings.load(
        kafka_security_protocol="SSL", kafka_ssl_cafile=certs["client.key"].parent / "missing.pem"
    )
    with pytest.raises(SettingsError, match=r"missing\.pem"):
        ssl_context(s)
    assert "secret" not in repr(
        Settings.load(
            kafka_security_protocol="SASL_PLAINTEXT", kafka_sasl_username="u", kafka_sasl_password="secret"
        )
    )


def test_plaintext_needs_no_credentials() -> None:
    s = Settings()
    assert client_options(s) == {"security_protocol": "PLAINTEXT"}
    assert faust_credentials(s) is None and ssl_context(s) is None


def test_sasl_ssl_builds_the_tls_context_and_both_clients_credentials(certs: dict[str, Path]) -> None:
    from faust.auth import SASLCredentials, SSLCredentials

    s = Settings.load(
        kafka_security_protocol="SASL_SSL",
        kafka_sasl_mechanism="SCRAM-SHA-512",
        kafka_sasl_username="surge",
        kafka_sasl_password="pw",
        kafka_ssl_cafile=certs["ca.pem"],
        kafka_ssl_certfile=certs["client.pem"],
        kafka_ssl_keyfile=certs["client.key"],
    )
    ctx = ssl_context(s)
    assert isinstance(ctx, ssl.SSLContext)
    assert ctx.verify_mode == ssl.CERT_REQUIRED and ctx.check_hostname
    assert [dict(x[0] for x in c["subject"]) for c in ctx.get_ca_certs()] == [{"commonName": "surge-test-ca"}]
    opts = client_options(s)
    assert opts["security_protocol"] == "SASL_SSL" and opts["sasl_mechanism"] == "SCRAM-SHA-512"
    assert (opts["sasl_plain_username"], opts["sasl_plain_password"]) == ("surge", "pw")
    assert isinstance(opts["ssl_context"], ssl.SSLContext)
    creds = faust_credentials(s)
    assert isinstance(creds, SASLCredentials)
    assert (creds.protocol.value, creds.mechanism.value, creds.username, creds.password) == (
        "SASL_SSL",
        "SCRAM-SHA-512",
        "surge",
        "pw",
    )
    assert isinstance(creds.ssl_context, ssl.SSLContext)

    tls = Settings.load(
        kafka_security_protocol="SSL", kafka_ssl_cafile=certs["ca.pem"], kafka_ssl_check_hostname=False
    )
    creds = faust_credentials(tls)
    assert isinstance(creds, SSLCredentials) and creds.protocol.value == "SSL"
    assert creds.context.check_hostname is False
    assert client_options(tls)["security_protocol"] == "SSL" and "sasl_mechanism" not in client_options(tls)


def test_the_faust_app_gets_the_credentials_and_no_builtin_views(tmp_path: Path) -> None:
    s = Settings.load(
        data_dir=tmp_path,
        kafka_security_protocol="SASL_PLAINTEXT",
        kafka_sasl_username="surge",
        kafka_sasl_password="pw",
    )
    app = create_app(s)
    assert app.conf.broker_credentials.username == "surge"
    assert app.conf.broker_credentials.protocol.value == "SASL_PLAINTEXT"
    assert all(getattr(app.conf, name) is False for name in WEB_VIEWS_OFF)


# ---- from outside: real workers, real gateways, the real broker --------------------------------------

KEYS = "k-free:acme:free:interactive,k-beta:beta:free:interactive,k-top:acme:premium:realtime,k-old:acme"


class Stack:
    def __init__(self, main: Deployment, slow: Deployment) -> None:
        self.main, self.slow = main, slow


@pytest.fixture(scope="module")
def stack(kafka: EmbeddedKafka, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("security")
    main = Deployment(
        kafka,
        tmp / "main",
        api_keys=KEYS,
        dedup_enabled="false",
        cache_enabled="false",
        degrade_enabled="false",
        user_rate_per_s_free="0.05",
        user_burst_free="1",
        deadline_realtime_ms="30000",
        deadline_interactive_ms="30000",
        deadline_batch_ms="30000",
    )
    slow = Deployment(
        kafka,
        tmp / "slow",
        api_keys=KEYS,
        dedup_enabled="false",
        cache_enabled="false",
        rate_limit_enabled="false",
        echo_delay_ms="300",
        max_batch_size="2",
        base_batch_size="1",
        degrade_up_queue_depth="[2,4,6]",
        degrade_down_queue_depth="[1,3,5]",
        degrade_cooldown_ms="120000",
        degrade_template="Busy now: please try again in a minute.",
        deadline_interactive_ms="60000",
        deadline_batch_ms="120000",
    )
    try:
        for d in (main, slow):
            d.worker(wait=False)
        for d in (main, slow):
            d.workers[0].wait_ready()
        yield Stack(main, slow)
    finally:
        for d in (main, slow):
            for w in d.workers:
                w.stop()


def openai_client(url: str, key: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30)


def ask(text: str, **kw: Any) -> dict[str, Any]:
    return {"model": "echo", "messages": [{"role": "user", "content": text}], **kw}


async def requests_of(d: Deployment, texts: set[str]) -> dict[str, dict[str, Any]]:
    """The records on the request topic whose question is one of ``texts``, by question (with the key)."""
    out: dict[str, dict[str, Any]] = {}
    for record in await d.read_topic(d.topics.requests, min_count=1, timeout_s=5):
        value = json.loads(record.value)
        text = value.get("prompt") or value["messages"][-1]["content"]
        if text in texts:
            out[text] = {**value, "_key": record.key.decode()}
    return out


@pytest.mark.integration
async def test_a_key_cannot_raise_its_tier_or_priority(stack: Stack) -> None:
    gw = await start_gateway(stack.main.settings, host="127.0.0.1", port=0)
    free, top = openai_client(gw.url, "k-free"), openai_client(gw.url, "k-top")
    try:
        for kw in (
            {"extra_headers": {"X-Surge-Priority": "realtime"}},
            {"extra_headers": {"X-Surge-Tier": "premium"}},
            {"extra_body": {"tier": "premium", "priority": "realtime"}},
        ):
            with pytest.raises(openai.PermissionDeniedError) as info:
                await free.chat.completions.create(**ask("let me jump the queue", user="sec-raise"), **kw)
            assert info.value.status_code == 403 and info.value.code == "permission_denied"
            assert "this API key may use" in info.value.message
        lowered = await free.chat.completions.create(
            **ask("a free batch question", user="sec-lower"), extra_headers={"X-Surge-Priority": "batch"}
        )
        assert lowered.model_extra["surge"]["priority"] == "batch"  # type: ignore[index]
        fast = await top.chat.completions.create(
            **ask("a premium realtime question", user="sec-top"),
            extra_headers={"X-Surge-Priority": "realtime"},
        )
        assert fast.model_extra["surge"]["priority"] == "realtime"  # type: ignore[index]
    finally:
        await free.close()
        await top.close()
        await gw.stop()
    records = await requests_of(
        stack.main, {"let me jump the queue", "a free batch question", "a premium realtime question"}
    )
    assert "let me jump the queue" not in records, "a refused request is never produced"
    low, high = records["a free batch question"], records["a premium realtime question"]
    assert (low["tenant"], low["tier"], low["priority"]) == ("acme", "free", "batch")
    assert (high["tenant"], high["tier"], high["priority"]) == ("acme", "premium", "realtime")


@pytest.mark.integration
async def test_users_are_per_tenant_so_no_one_drains_anothers_bucket(stack: Stack) -> None:
    gw = await start_gateway(stack.main.settings, host="127.0.0.1", port=0)
    acme, beta = openai_client(gw.url, "k-free"), openai_client(gw.url, "k-beta")
    try:
        # beta names acme's user: it gets its own bucket (beta/victim), acme's stays full
        first = await beta.chat.completions.create(**ask("beta asks as victim", user="victim"))
        assert first.choices[0].message.content == "beta asks as victim"
        own = await acme.chat.completions.create(**ask("acme victim asks", user="victim"))
        assert own.choices[0].message.content == "acme victim asks", "beta did not drain acme's bucket"
        with pytest.raises(openai.RateLimitError) as info:  # acme/victim's own bucket: burst 1
            await acme.chat.completions.create(**ask("acme victim asks again", user="victim"))
        assert "'acme/victim'" in info.value.message
        # naming another tenant's namespace stays in one's own
        spoof = await acme.chat.completions.create(**ask("acme spoofs beta", user="beta/victim"))
        assert spoof.choices[0].message.content == "acme spoofs beta"
    finally:
        await acme.close()
        await beta.close()
        await gw.stop()
    records = await requests_of(stack.main, {"beta asks as victim", "acme victim asks", "acme spoofs beta"})
    assert {t: (r["user_id"], r["_key"], r["tenant"]) for t, r in records.items()} == {
        "beta asks as victim": ("beta/victim", "beta/victim", "beta"),
        "acme victim asks": ("acme/victim", "acme/victim", "acme"),
        "acme spoofs beta": ("acme/beta/victim", "acme/beta/victim", "acme"),
    }


async def raw_http(port: int, head: str, body: bytes = b"", timeout_s: float = 5.0) -> tuple[int, bytes]:
    """One HTTP/1.1 exchange on a fresh connection, bytes as given (non-ASCII headers included)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(head.encode("utf-8") + b"\r\n" + body)
        await writer.drain()
        return await asyncio.wait_for(_read_response(reader), timeout_s)
    finally:
        writer.close()


async def _read_response(reader: asyncio.StreamReader) -> tuple[int, bytes]:
    status = int((await reader.readline()).split()[1])
    length = 0
    while (line := await reader.readline()) not in (b"\r\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        if name.strip().lower() == "content-length":
            length = int(value)
    return status, await reader.readexactly(length)


def head(path: str, length: int, key: str = "k-old", **headers: str) -> str:
    lines = [
        f"POST {path} HTTP/1.1",
        "Host: x",
        "Content-Type: application/json",
        f"Authorization: Bearer {key}",
        f"Content-Length: {length}",
    ]
    lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    return "\r\n".join(lines) + "\r\n"


@pytest.mark.integration
async def test_edge_cases_over_http_are_400_or_401_not_500(stack: Stack) -> None:
    gw = await start_gateway(stack.main.settings, host="127.0.0.1", port=0)
    path = "/v1/chat/completions"
    ok_body = json.dumps(ask("edge case question", user="sec-edge")).encode()
    try:
        cases = [
            (b'{"messages": ' + b"[" * 200_000 + b"]" * 200_000 + b"}", {}, 400, "nests JSON"),
            (b'{"max_tokens": 1' + b"0" * 5000 + b', "messages": []}', {}, 400, "cannot be read"),
            (ok_body, {"X_Surge_Deadline_Ms": "\u00b2"}, 400, "ASCII digits"),
            (ok_body, {"X_Surge_Deadline_Ms": "\u0661\u0662\u0663"}, 400, "ASCII digits"),
            (ok_body, {"X_Surge_Deadline_Ms": "9" * 5000}, 400, "ASCII digits"),
        ]
        for body, headers, status, needle in cases:
            got, raw = await raw_http(gw.port, head(path, len(body), **headers), body, timeout_s=20)
            assert (got, needle in raw.decode()) == (status, True), raw[:300]
        got, raw = await raw_http(gw.port, head(path, len(ok_body), key="клю\u00e7"), ok_body)
        assert got == 401 and b"invalid API key" in raw
        got, raw = await raw_http(gw.port, head(path, len(ok_body)), ok_body)
        assert got == 200 and json.loads(raw)["choices"][0]["message"]["content"] == "edge case question"
    finally:
        await gw.stop()


@pytest.mark.integration
async def test_the_in_flight_bound_applies_before_the_body_is_read(stack: Stack) -> None:
    gw = await start_gateway(stack.main.settings, host="127.0.0.1", port=0, max_in_flight=1)
    path = "/v1/chat/completions"
    body = json.dumps(ask("a full request", user="sec-bound")).encode()
    # a slow upload: headers and a part of the body, the rest never comes
    _, writer = await asyncio.open_connection("127.0.0.1", gw.port)
    writer.write(head(path, 1000).encode() + b"\r\n" + b'{"messages": ')
    await writer.drain()
    try:
        await asyncio.sleep(0.3)
        t0 = time.monotonic()
        status, raw = await raw_http(gw.port, head(path, len(body)), body)
        assert status == 503, raw[:300]
        assert "1 requests in flight; the limit is 1" in json.loads(raw)["error"]["message"]
        # another upload is refused at its headers, without waiting for its body
        status, raw = await raw_http(gw.port, head(path, 1000), b"", timeout_s=3)
        assert status == 503 and time.monotonic() - t0 < 5
    finally:
        writer.close()
    for _ in range(50):  # the abandoned upload leaves the bound
        if gw._in_flight == 0:
            break
        await asyncio.sleep(0.1)
    try:
        status, raw = await raw_http(gw.port, head(path, len(body)), body, timeout_s=20)
        assert status == 200, raw[:300]
    finally:
        await gw.stop()


@pytest.mark.integration
async def test_a_template_answer_is_marked_where_an_openai_client_sees_it(stack: Stack) -> None:
    d = stack.slow
    c = await d.client(signer=ApiKey("k-old"))  # the workers have keys: records must be signed
    backlog = [
        {
            "request_id": f"flood-{i}",
            "user_id": f"flood-{i % 5}",
            "prompt": f"backlog {i}",
            "priority": "batch",
        }
        for i in range(40)
    ]
    flood = [await c.submit(r) for r in backlog]
    await c.producer.flush()
    deadline = time.monotonic() + 60
    while "surge_degradation_level 3.0" not in d.workers[0].metrics():
        assert time.monotonic() < deadline, "the worker never reached level 3"
        await asyncio.sleep(0.2)
    gw = await start_gateway(d.settings, host="127.0.0.1", port=0)
    client = openai_client(gw.url, "k-old")
    try:
        raw = await client.chat.completions.with_raw_response.create(
            **ask("what is the fee for a transfer abroad", user="sec-template"),
            extra_headers={"X-Surge-Priority": "batch"},
        )
        resp = raw.parse()
        assert raw.headers[SERVED_FROM_HEADER] == "template"
        assert resp.choices[0].finish_reason == TEMPLATE_FINISH_REASON == "content_filter"
        assert resp.choices[0].message.content == "Busy now: please try again in a minute."
        surge = resp.model_extra["surge"]  # type: ignore[index]
        assert surge["served_from"] == "template" and surge["template"] is True
        assert surge["finish_reason"] == "template" and surge["degradation_level"] == 3

        stream = await client.chat.completions.create(
            **ask("and the fee for a card replacement", user="sec-template"),
            stream=True,
            extra_headers={"X-Surge-Priority": "batch"},
        )
        finals = [
            ch.choices[0].finish_reason async for ch in stream if ch.choices and ch.choices[0].finish_reason
        ]
        assert finals == ["content_filter"]

        model = await client.chat.completions.with_raw_response.create(
            **ask("a standard interactive question", user="sec-template")
        )
        assert (
            model.headers[SERVED_FROM_HEADER] == "model" and model.parse().choices[0].finish_reason == "stop"
        )
    finally:
        await client.close()
        await gw.stop()
        await d.replies(flood, 120)


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


@pytest.mark.integration
async def test_the_worker_web_port_serves_no_table_or_internal_views(stack: Stack) -> None:
    d = stack.main
    c = await d.client(signer=ApiKey("k-old"))  # the workers have keys: records must be signed
    reply = await c.request(
        {"request_id": "web-1", "user_id": "acme/web-user", "prompt": "my secret question"}
    )
    assert reply.status == "ok"
    base = f"http://127.0.0.1:{d.workers[0].web_port}"
    for path in ("/metrics", "/status", "/healthz"):
        assert http_get(base + path)[0] == 200, path
    for path in (
        "/table/",
        "/table/ratelimit/",
        "/table/ratelimit/acme%2Fweb-user/",
        "/table/answers/",
        "/router/",
        "/router/ratelimit/get/?key=acme/web-user",
        "/assignment/",
        "/graph/",
        "/stats/",
        "/performance/",
    ):
        status, body = http_get(base + path)
        assert status == 404, (path, status, body[:200])
        assert "web-user" not in body and "ratelimit" not in body
    status, body = http_get(base + "/")
    assert status == 200 and json.loads(body) == {"status": "OK"}, "Faust's plain index, nothing more"


# ---- a broker that wants SASL: a worker, the admin client and SurgeClient authenticate ----------------


class SaslKafka(EmbeddedKafka):
    """The embedded broker with one more listener, SASL_PLAINTEXT with the PLAIN mechanism."""

    def __init__(self, data_dir: Path, users: dict[str, str], **kw: Any) -> None:
        super().__init__(data_dir, **kw)
        self.users = users
        self.sasl_port = free_port()

    def _write_config(self, port: int, controller_port: int) -> Path:
        # chosen before the broker's own two ports: free_port() may hand out one of those again
        # (CI once got CONTROLLER and SASL_PLAINTEXT on the same port, and the broker refused to format)
        while self.sasl_port in (port, controller_port):
            self.sasl_port = free_port()
        path = super()._write_config(port, controller_port)
        cfg = dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)
        sasl = f"SASL_PLAINTEXT://{self.host}:{self.sasl_port}"
        jaas = " ".join(f'user_{u}="{p}"' for u, p in self.users.items())
        cfg.update(
            {
                "listeners": f"{cfg['listeners']},{sasl}",
                "advertised.listeners": f"{cfg['advertised.listeners']},{sasl}",
                "listener.security.protocol.map": f"{cfg['listener.security.protocol.map']},SASL_PLAINTEXT:SASL_PLAINTEXT",
                "sasl.enabled.mechanisms": "PLAIN",
                "listener.name.sasl_plaintext.plain.sasl.jaas.config": f"org.apache.kafka.common.security.plain.PlainLoginModule required {jaas};",
            }
        )
        path.write_text("".join(f"{k}={v}\n" for k, v in cfg.items()))
        return path


def test_the_sasl_listener_never_shares_a_port_with_the_broker_s_own(tmp_path: Path) -> None:
    broker = SaslKafka(tmp_path / "kafka", users={"surge": "s3cret"})
    broker.data_dir.mkdir(parents=True)
    port, cport = free_port(), free_port()
    broker.sasl_port = cport  # what free_port() handed out once in CI
    cfg = broker._write_config(port, cport).read_text()
    listeners = next(line for line in cfg.splitlines() if line.startswith("listeners="))
    ports = [int(x.rsplit(":", 1)[1]) for x in listeners.split("=", 1)[1].split(",")]
    assert len(ports) == 3 and len(set(ports)) == 3, listeners


@pytest.mark.integration
async def test_worker_and_clients_connect_through_sasl(tmp_path: Path) -> None:
    broker = SaslKafka(tmp_path / "kafka", users={"surge": "s3cret"}, partitions=2, heap_mb=384)
    broker.start()
    d = Deployment(
        broker,
        tmp_path / "d",
        partitions="2",
        dedup_enabled="false",
        cache_enabled="false",
        degrade_enabled="false",
    )
    d.env.update(
        {
            "SURGE_BROKER": f"kafka://127.0.0.1:{broker.sasl_port}",
            "SURGE_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
            "SURGE_KAFKA_SASL_USERNAME": "surge",
            "SURGE_KAFKA_SASL_PASSWORD": "s3cret",
        }
    )
    try:
        s = d.settings
        wrong = s.model_copy(update={"kafka_sasl_password": type(s.kafka_sasl_password)("wrong")})
        with pytest.raises(BrokerError):
            await ensure_topics(wrong, timeout_s=10)
        await ensure_topics(s)
        d.worker()
        async with SurgeClient(
            s.bootstrap_servers,
            requests_topic=d.topics.requests,
            reply_topic=d.topics.replies,
            security=client_options(s),
        ) as c:
            reply: InferenceReply = await c.request(
                {"request_id": uuid.uuid4().hex, "user_id": "t/u", "prompt": "through SASL"}, timeout_s=60
            )
        assert reply.status == "ok" and reply.answer == "through SASL"
    finally:
        for w in d.workers:
            w.stop()
        broker.stop()
