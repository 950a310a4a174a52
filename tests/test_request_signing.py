"""Signed records on the request topic (docs/architecture.md, "Tenant isolation"): a record written
straight to ``surge.requests`` names an API key and carries an HMAC of its value; the intake serves it
as that key's tenant, with at most that key's tier and priority.

Pure parts first (signing, verifying, the grant, the escalation signer, the replay's re-signing), then
one real worker on the real broker with ``SURGE_API_KEYS`` set.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
from typing import Any

import openai
import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from pipeline.auth import (
    ESCALATION_KEY_ID,
    KEY_ID_HEADER,
    REPLY_SIGNATURE_HEADER,
    SIGNATURE_HEADER,
    ApiKey,
    KeyRing,
    authorize,
    check_signed_date,
    escalation_signer,
    escalation_signer_of,
    header_list,
    parse_api_keys,
    reply_signed_by,
    request_signers,
    resign,
    sign,
    sign_reply,
)
from pipeline.exceptions import (
    InvalidRequestError,
    RequestSignatureError,
    SettingsError,
    StaleSignedRequestError,
)
from pipeline.gateway import start_gateway
from pipeline.records import DeadLetter, InferenceRequest, decode_request, now_ms
from pipeline.replay import plan
from pipeline.replyto import ReplyToPolicy
from pipeline.settings import Settings
from pipeline.topics import TopicNames
from tests.conftest import RELAXED, request

KEYS = "k-acme:acme:standard:interactive,k-beta:beta:premium:realtime"
ACME, BETA = parse_api_keys(KEYS)
RING = KeyRing([ACME, BETA])
ESCALATION_KEY = "escalation-key-0123456789abcdef"


def value_of(**fields: Any) -> bytes:
    return json.dumps({"request_id": "r-1", "user_id": "u1", "prompt": "hi", **fields}).encode()


def req_of(raw: bytes) -> InferenceRequest:
    return decode_request(raw, None, max_record_bytes=1 << 20, max_content_bytes=1 << 20)


# ---- signing and verifying (pure) ------------------------------------------------------------------


def test_a_signature_is_the_hmac_of_the_exact_value_under_the_keys_hashed_id() -> None:
    value = value_of()
    headers = sign(ACME, value)
    assert [name for name, _ in headers] == [KEY_ID_HEADER, SIGNATURE_HEADER]
    key_id, sig = dict(headers)[KEY_ID_HEADER], dict(headers)[SIGNATURE_HEADER]
    assert key_id == ("key-" + hashlib.sha256(b"k-acme").hexdigest()[:16]).encode() == ACME.key_id.encode()
    assert sig == hmac.new(b"k-acme", value, hashlib.sha256).hexdigest().encode()
    assert b"k-acme" not in key_id, "the key itself never travels"
    assert RING.verify(headers, value) is ACME
    assert RING.verify(tuple(headers), value) is ACME, "aiokafka hands headers over as a tuple"
    assert RING.verify(dict(headers), value) is ACME
    assert RING.verify([(KEY_ID_HEADER, key_id), (SIGNATURE_HEADER, sig.upper())], value) is ACME
    with pytest.raises(ValueError, match="anonymous"):
        sign(ApiKey(""), value)


@pytest.mark.parametrize(
    ("headers", "needle"),
    [
        (None, "not signed"),
        ([], "not signed"),
        ([("traceparent", b"00-ab")], "not signed"),
        ([(KEY_ID_HEADER, ACME.key_id.encode())], f"no '{SIGNATURE_HEADER}' header"),
        ([(SIGNATURE_HEADER, b"00")], f"no '{KEY_ID_HEADER}' header"),
        (sign(ACME, value_of()) + sign(BETA, value_of()), f"2 '{KEY_ID_HEADER}' headers"),
        ([*sign(ACME, value_of()), ("Surge-Signature", b"ab")], f"2 '{SIGNATURE_HEADER}' headers"),
        ([(KEY_ID_HEADER, None), (SIGNATURE_HEADER, b"ab")], "must hold bytes"),
        ([(KEY_ID_HEADER, 7), (SIGNATURE_HEADER, b"ab")], "must hold bytes"),
        ([(KEY_ID_HEADER, b"key-0123456789abcdef"), (SIGNATURE_HEADER, b"ab")], "'key-0123456789abcdef'"),
        (sign(ApiKey("k-elsewhere"), value_of()), "unknown key id"),
        (sign(ApiKey("k-acme"), value_of(prompt="another")), "does not match the record's value"),
        (
            [(KEY_ID_HEADER, ACME.key_id.encode()), dict(sign(BETA, value_of())).popitem()],
            "does not match",
        ),
        ([("x",), 5, (KEY_ID_HEADER,)], "not signed"),
    ],
)
def test_a_record_not_signed_right_is_refused_saying_what_is_wrong_and_how_to_sign(
    headers: Any, needle: str
) -> None:
    with pytest.raises(RequestSignatureError) as info:
        RING.verify(headers, value_of())
    assert needle in info.value.message
    assert info.value.code == "invalid_request", "the record format's code for a refused record"
    assert isinstance(info.value, InvalidRequestError)
    assert "k-acme" not in info.value.message and "k-beta" not in info.value.message
    if "not signed" in needle or "no '" in needle or "unknown" in needle or "match" in needle:
        assert "HMAC-SHA256" in info.value.message, "the message says how to sign"


def test_a_key_put_in_the_id_header_by_mistake_is_never_echoed() -> None:
    with pytest.raises(RequestSignatureError) as info:
        RING.verify([(KEY_ID_HEADER, b"k-acme"), (SIGNATURE_HEADER, b"ab")], value_of())
    assert "k-acme" not in info.value.message and "not of the form key-" in info.value.message


def test_a_tampered_value_fails_even_by_one_byte() -> None:
    value = value_of(tenant="acme")
    headers = sign(ACME, value)
    assert RING.verify(headers, value) is ACME
    for tampered in (value_of(tenant="beta"), value + b" ", value.replace(b'"hi"', b'"hI"')):
        with pytest.raises(RequestSignatureError, match="does not match"):
            RING.verify(headers, tampered)


def test_a_reply_passes_only_for_the_key_that_signed_its_request() -> None:
    """A worker signs each reply with its request's key (:func:`sign_reply`); a client checks it
    with the key it signed the request with. Another key, another byte, a request's signature, a
    header missing or given twice: each fails."""
    reply = b'{"request_id": "r-1", "user_id": "u1", "status": "ok", "answer": "yes"}'
    headers = sign_reply(ACME, reply)
    assert dict(headers)[KEY_ID_HEADER] == ACME.key_id.encode()
    assert reply_signed_by(ACME, headers, reply)
    assert reply_signed_by(ACME, [(n.upper(), v) for n, v in headers], reply)  # names without case
    assert not reply_signed_by(BETA, headers, reply)
    assert not reply_signed_by(BETA, sign_reply(ACME, reply), reply)
    assert not reply_signed_by(ACME, sign_reply(BETA, reply), reply)
    assert not reply_signed_by(ACME, headers, reply[:-1] + b" }")
    assert not reply_signed_by(ACME, sign(ACME, reply), reply)  # a request's signature is no reply's
    assert not reply_signed_by(ACME, None, reply)
    assert not reply_signed_by(ACME, [headers[1]], reply)
    assert not reply_signed_by(ACME, [*headers, headers[1]], reply)
    assert not reply_signed_by(ACME, [headers[0], (REPLY_SIGNATURE_HEADER, None)], reply)
    # the label keeps the two signatures apart: a request's HMAC of the same bytes never matches
    assert dict(headers)[REPLY_SIGNATURE_HEADER] != dict(sign(ACME, reply))[SIGNATURE_HEADER]


def test_header_list_keeps_well_formed_pairs_for_a_forward() -> None:
    headers = [*sign(ACME, b"v"), ("odd", None), (b"bytes-name", b"x"), ("ok", bytearray(b"y"))]
    assert header_list(headers) == [*sign(ACME, b"v"), ("ok", b"y")]
    assert header_list(None) is None and header_list([]) is None


# ---- what a signed record is served as (pure) --------------------------------------------------------


def test_a_signed_record_is_served_as_its_keys_tenant_tier_and_priority() -> None:
    served = authorize(req_of(value_of()), ACME)
    assert (served.tenant, served.tier, served.priority) == ("acme", "standard", "interactive")
    premium = authorize(req_of(value_of(tenant="beta")), BETA)
    assert (premium.tenant, premium.tier, premium.priority) == ("beta", "premium", "realtime")
    lowered = authorize(req_of(value_of(tier="free", priority="batch")), BETA)
    assert (lowered.tenant, lowered.tier, lowered.priority) == ("beta", "free", "batch")
    original = req_of(value_of())
    assert authorize(original, BETA).digest == original.digest, "the digest covers what is asked"


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"tenant": "beta"}, "tenant 'beta' is not the tenant of the signing key ('acme')"),
        ({"tenant": "default"}, "tenant 'default' is not the tenant"),
        ({"tier": "premium"}, "tier up to 'standard', got 'premium'"),
        ({"priority": "realtime"}, "priority up to 'interactive', got 'realtime'"),
    ],
)
def test_a_signed_record_cannot_claim_another_tenant_or_raise_its_class(
    fields: dict[str, str], needle: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        authorize(req_of(value_of(**fields)), ACME)
    assert needle in info.value.message and info.value.code == "invalid_request"


# ---- the risk workers' signer and the settings (pure) ------------------------------------------------


def test_the_escalation_signer_is_premium_realtime_of_its_tenant_under_a_derived_secret() -> None:
    signer = escalation_signer("the-escalation-key", "risk")
    assert (signer.key_id, signer.tenant, signer.tier, signer.max_priority) == (
        ESCALATION_KEY_ID,
        "risk",
        "premium",
        "realtime",
    )
    assert signer.key != "the-escalation-key", "request ids and signatures use different secrets"
    assert signer == escalation_signer("the-escalation-key", "risk"), "the same on every worker"
    s = Settings(api_keys=KEYS, risk_escalation_key="the-escalation-key")
    assert escalation_signer_of(s) == signer and escalation_signer_of(Settings()) is None
    ring = request_signers(s)
    assert ring is not None
    record = {"request_id": "risk-1", "user_id": "acct-1", "tenant": "risk", "prompt": "case"}
    value = json.dumps({**record, "tier": "premium", "priority": "realtime"}).encode()
    key = ring.verify(sign(signer, value), value)
    assert key is signer or key == signer
    served = authorize(req_of(value), key)
    assert (served.tenant, served.tier, served.priority) == ("risk", "premium", "realtime")
    forged = escalation_signer("a guess", "risk")
    with pytest.raises(RequestSignatureError, match="does not match"):
        ring.verify(sign(forged, value), value)
    keys_only = request_signers(Settings(api_keys=KEYS))
    assert keys_only is not None and keys_only.by_id(ESCALATION_KEY_ID) is None
    assert request_signers(Settings(risk_escalation_key="the-escalation-key")) is None, "open: no ring"
    assert ring.lookup(signer.key) is not None and KeyRing(parse_api_keys(KEYS)).lookup(signer.key) is None


def test_a_signed_request_is_taken_only_near_the_time_its_signature_dates_it() -> None:
    """A signed record copied off the topic and written again later keeps its signature and its
    created_at but gets a new append time from the broker: past the age limit it is refused, naming
    both times and the limit; one without created_at cannot be dated and is refused too."""
    appended = 1_800_000_000_000
    check_signed_date(appended - 299_999, appended, 300_000)  # sent, retried, appended within the limit
    check_signed_date(appended + 2_000, appended, 300_000)  # a client clock a little ahead
    with pytest.raises(StaleSignedRequestError) as info:
        check_signed_date(appended - 3_600_000, appended, 300_000)  # an hour-old capture written again
    err = info.value
    assert (err.code, err.age_ms, err.max_age_ms) == ("invalid_request", 3_600_000, 300_000)
    assert isinstance(err, InvalidRequestError), "refused like any invalid record: reply and dead letter"
    assert f"created_at={appended - 3_600_000}" in err.message and "3600.0 s before" in err.message
    assert (
        str(appended) in err.message
        and "300 s" in err.message
        and "SURGE_SIGNED_REQUEST_MAX_AGE_S" in err.message
    )
    with pytest.raises(StaleSignedRequestError, match=r"400\.0 s after"):
        check_signed_date(appended + 400_000, appended, 300_000)  # dated ahead to outlive the limit
    with pytest.raises(InvalidRequestError, match="must carry created_at"):
        check_signed_date(None, appended, 300_000)
    # the limit off: any date, and none
    check_signed_date(None, appended, 0)
    check_signed_date(0, appended, 0)


def test_the_age_limit_of_signed_requests_stays_within_the_reply_books_memory() -> None:
    """Within the age limit a copy written again must still meet the reply its original got."""
    assert Settings(api_keys=KEYS).signed_request_max_age_s == 300.0
    with pytest.raises(SettingsError, match="signed_request_max_age_s=7200 exceeds reply_record_ttl_s=3600"):
        Settings.load(api_keys=KEYS, signed_request_max_age_s="7200")
    # unsigned deployments do not date records: a short reply memory is theirs to choose
    assert Settings.load(reply_record_ttl_s="1").requests_signed is False


def test_the_setting_signs_where_keys_are_set_and_refuses_signed_without_keys() -> None:
    assert Settings().requests_signed is False
    assert Settings(api_keys=KEYS).requests_signed is True
    assert Settings(api_keys=KEYS, kafka_request_auth="open").requests_signed is False
    with pytest.raises(SettingsError, match="kafka_request_auth='signed' needs api_keys"):
        Settings.load(kafka_request_auth="signed")
    with pytest.raises(SettingsError, match="kafka_request_auth"):
        Settings.load(kafka_request_auth="maybe")
    open_copy = Settings(api_keys=KEYS).model_copy(update={"kafka_request_auth": "open"})
    assert open_copy.requests_signed is False, "computed each time: a copy never carries a stale value"


def test_no_api_key_may_share_the_escalation_tenant() -> None:
    """With escalation on, a key of the escalation tenant would share its rate-limit buckets and
    cache scope: a client flooding them had every escalation answered rate_limited. Refused at start,
    naming the entry; without the escalation key, any tenant goes."""
    keys = KEYS + ",k-risky:risk"
    with pytest.raises(SettingsError, match=r"api_keys entries \[3\] have tenant 'risk'"):
        Settings.load(api_keys=keys, risk_escalation_key=ESCALATION_KEY)
    with pytest.raises(SettingsError, match="tenant 'fraud'"):
        Settings.load(
            api_keys=KEYS + ",k-f:fraud", risk_escalation_key=ESCALATION_KEY, risk_escalation_tenant="fraud"
        )
    assert Settings.load(api_keys=keys).requests_signed
    assert Settings.load(api_keys=KEYS, risk_escalation_key=ESCALATION_KEY).requests_signed


# ---- a replay's copy of a signed record (pure) -------------------------------------------------------


POLICY = ReplyToPolicy(TopicNames("surge."), "surge", r"surge\.replies\..*")


def test_a_replayed_copy_is_signed_again_with_the_same_key() -> None:
    value = value_of(reply_to="surge.replies.mine")
    headers = [("traceparent", b"00-ab"), *sign(ACME, value)]
    copy = plan.rewrite_request(value, "surge.replay-x.replies", POLICY, headers, RING)
    assert json.loads(copy.value)["reply_to"] == "surge.replay-x.replies"
    assert copy.headers[0] == ("traceparent", b"00-ab"), "other headers kept, in order"
    assert RING.verify(copy.headers, copy.value) is ACME
    assert [n for n, _ in copy.headers].count(SIGNATURE_HEADER) == 1


def test_a_replayed_copy_of_a_record_live_refused_stays_refused() -> None:
    value = value_of()
    forged = sign(ApiKey("k-acme"), value_of(prompt="something else"))
    copy = plan.rewrite_request(value, "surge.replay-x.replies", POLICY, forged, RING)
    assert copy.headers == tuple(forged), "copied as is"
    with pytest.raises(RequestSignatureError):
        RING.verify(copy.headers, copy.value)
    unsigned = plan.rewrite_request(value, "surge.replay-x.replies", POLICY, None, RING)
    assert unsigned.headers == ()
    as_written = plan.rewrite_request(value, "surge.replay-x.replies", POLICY, sign(ACME, value), None)
    assert as_written.headers == tuple(sign(ACME, value)), "live takes records as written: untouched"
    assert plan.resigned(sign(ACME, value), value, b"{}", RING) == tuple(resign(None, ACME, b"{}"))


async def test_the_escalation_reader_takes_only_replies_its_signer_signed() -> None:
    """Where requests are signed, a tenant's request naming the escalation reply topic and an
    escalation's request id gets a reply signed with that tenant's key: the risk worker's reader
    drops it (``unknown_reply``) and the escalation still waits for its own."""
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry

    from agents.risk_escalation import Escalations
    from pipeline.metrics import create_risk_metrics

    settings = Settings.load(api_keys=KEYS, risk_escalation_key=ESCALATION_KEY)
    signer = escalation_signer_of(settings)
    assert signer is not None
    esc = Escalations(SimpleNamespace(settings=settings), create_risk_metrics(CollectorRegistry()))  # type: ignore[arg-type]
    waiting = esc.waiting["risk-1"] = asyncio.get_running_loop().create_future()
    reply = b'{"request_id": "risk-1", "user_id": "acme/x", "status": "ok", "answer": "APPROVE"}'
    for headers in (sign_reply(ACME, reply), None, sign(signer, reply)):
        esc._deliver(reply, headers)
    assert esc.unknown_replies == 3 and not waiting.done()
    esc._deliver(reply, sign_reply(signer, reply))
    assert waiting.done() and waiting.result()["answer"] == "APPROVE"
    # unsigned deployments take replies as they come (no worker signs them there)
    open_esc = Escalations(
        SimpleNamespace(settings=Settings.load(risk_escalation_key=ESCALATION_KEY)),  # type: ignore[arg-type]
        create_risk_metrics(CollectorRegistry()),
    )
    taken = open_esc.waiting["risk-1"] = asyncio.get_running_loop().create_future()
    open_esc._deliver(reply, None)
    assert taken.done()


# ---- one real worker on the real broker --------------------------------------------------------------


@pytest.mark.integration
async def test_a_worker_with_keys_serves_only_records_signed_within_their_keys_grant(deployment) -> None:
    d = deployment(
        api_keys=KEYS,
        risk_escalation_key=ESCALATION_KEY,
        rate_limit_enabled="false",
        cache_enabled="false",
        # real-time cases too: this test is about who signs, not about 200 ms under a loaded CI
        # machine (the escalation case once missed it by 2 ms)
        deadline_realtime_ms="60000",
        **RELAXED,
    )
    d.worker()
    c = await d.client()
    risk_signer = escalation_signer_of(d.settings)
    assert risk_signer is not None

    def signed(rid: str, key: ApiKey, **fields: Any) -> tuple[bytes, list[tuple[str, bytes]]]:
        body = request(rid, "u-sig", reply_to=d.topics.replies, **{"created_at": now_ms(), **fields})
        if body["created_at"] is None:
            del body["created_at"]
        value = json.dumps(body).encode()
        return value, sign(key, value)

    def signed_to(topic: str, rid: str, key: ApiKey, text: str) -> tuple[bytes, list[tuple[str, bytes]]]:
        value = json.dumps(request(rid, "u-sig", text, reply_to=topic, created_at=now_ms())).encode()
        return value, sign(key, value)

    # a reply topic of tenant beta's own: a producer holding no key names it, with the request_id of a
    # request beta has in flight, to have beta's client take a forged refusal for its answer
    victim = d.topics.replies + ".beta"
    admin = AIOKafkaAdminClient(bootstrap_servers=d.bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(victim, 1, 1)])
    finally:
        await admin.close()
    cases: dict[str, tuple[bytes | None, bytes, list[tuple[str, bytes]] | None]] = {
        "unsigned": (b"u-sig", json.dumps(request("unsigned", "beta/bob", reply_to=victim)).encode(), None),
        "claims-beta": (b"u-sig", *signed("claims-beta", ACME, tenant="beta")),
        "too-high": (b"u-sig", *signed("too-high", ACME, priority="realtime")),
        "ok-no-tenant": (b"u-sig", *signed("ok-no-tenant", ACME)),
        "ok-forwarded": (None, *signed("ok-forwarded", BETA, priority="realtime")),
        # as the risk workers sign an escalation (agents/risk_escalation.py)
        "ok-escalation": (
            b"u-sig",
            *signed("ok-escalation", risk_signer, tenant="risk", priority="realtime"),
        ),
        "forged-escalation": (
            b"u-sig",
            *signed("forged-escalation", escalation_signer("a guess", "risk"), tenant="risk"),
        ),
        # what a copy of a record acme signed an hour ago, written again now, looks like to the intake
        "stale": (b"u-sig", *signed("stale", ACME, created_at=now_ms() - 3_600_000)),
        "undated": (b"u-sig", *signed("undated", ACME, created_at=None)),
    }
    futures = {rid: c.expect(f"r-{rid}") for rid in cases}
    for key, value, headers in cases.values():
        await c.send_raw(key, value, headers)
    replies = dict(zip(futures, await d.replies(list(futures.values()), 60), strict=True))

    for rid in ("ok-no-tenant", "ok-forwarded", "ok-escalation"):
        assert replies[rid].status == "ok", (rid, replies[rid].error)
    assert replies["ok-forwarded"].priority == "realtime", "forwarded with its headers, served as beta's"
    expected = {
        "unsigned": "not signed",
        "claims-beta": "tenant 'beta' is not the tenant of the signing key ('acme')",
        "too-high": "priority up to 'interactive', got 'realtime'",
        "forged-escalation": "does not match the record's value for key id 'escalation'",
        "stale": "s before the broker appended its record",
        "undated": "a signed request must carry created_at",
    }
    for rid, needle in expected.items():
        err = replies[rid].error
        assert replies[rid].status == "error" and err is not None, rid
        assert err.code == "invalid_request" and needle in err.message, (rid, err)
    letters = [DeadLetter.model_validate_json(r.value) for r in await d.read_topic(d.topics.deadletter, 6)]
    assert sorted(dl.reason for dl in letters) == ["invalid_request"] * 6
    assert any("not signed" in dl.message for dl in letters)
    assert any("SURGE_SIGNED_REQUEST_MAX_AGE_S" in dl.message for dl in letters)
    # the unsigned record's refusal went to the default replies topic (where it was awaited), not the
    # topic it named: nobody vouches for an unsigned record's reply_to
    assert await d.read_topic(victim, 0, timeout_s=2) == []
    # each reply to a signed record is signed back with its key (the refusals after the signature
    # verified too, forwarded records' from the work item); the unsigned record's refusal is not
    raw = {json.loads(r.value)["request_id"]: r for r in await d.read_topic(d.topics.replies, 9)}
    signers = {
        "ok-no-tenant": ACME,
        "ok-forwarded": BETA,
        "ok-escalation": risk_signer,
        "claims-beta": ACME,
        "too-high": ACME,
        "stale": ACME,
        "undated": ACME,
    }
    for rid, key in signers.items():
        record = raw[f"r-{rid}"]
        assert reply_signed_by(key, record.headers, record.value), rid
        assert not reply_signed_by(BETA if key is ACME else ACME, record.headers, record.value), rid
    assert not any(n == REPLY_SIGNATURE_HEADER for n, _ in raw["r-unsigned"].headers)

    # tenant acme, signed within its grant, names beta's reply topic and the request_id of a request
    # beta has in flight: its reply lands there first, under beta's id, signed with acme's key; beta's
    # client drops it and takes its own reply when it comes
    beta = await d.client(reply_topic=victim, signer=BETA)
    awaited = beta.expect("r-inflight", BETA)
    await c.send_raw(b"u-sig", *signed_to(victim, "inflight", ACME, "acme's own question"))
    forged = await d.read_topic(victim, 1)
    assert json.loads(forged[0].value)["request_id"] == "r-inflight"
    # the victim topic has one partition: beta's reader meets acme's reply before its own
    await beta.submit(request("inflight", "u-beta", "beta's own question", reply_to=victim))
    (answer,) = await d.replies([awaited], 60)
    assert beta.unverified == 1, "acme's reply under beta's request id was not dropped"
    assert answer.status == "ok" and answer.answer == "beta's own question", answer

    # a copy of a signed record written again within the age limit meets the reply its original got,
    # sent again unchanged: no second model call, no second answer
    await c.send_raw(*cases["ok-no-tenant"])
    deadline = asyncio.get_running_loop().time() + 30
    while True:
        again = [r for r in await d.read_topic(d.topics.replies, 11) if b'"r-ok-no-tenant"' in r.value]
        if len(again) >= 2 or asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.2)
    assert len(again) == 2 and again[0].value == again[1].value, [r.value for r in again]

    # the gateway signs with its caller's key: a worker that wants signed records serves it
    gw = await start_gateway(d.settings, host="127.0.0.1", port=0)
    try:
        client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="k-beta", max_retries=0, timeout=60)
        resp = await client.chat.completions.create(
            model="echo",
            messages=[{"role": "user", "content": "keyed hello"}],
            extra_headers={"X-Surge-Priority": "realtime"},
        )
        await client.close()
    finally:
        await gw.stop()
    assert resp.choices[0].message.content == "keyed hello"


def test_the_readmes_signing_example_signs_what_the_intake_verifies() -> None:
    """The README shows producers how to sign with nothing but hashlib and hmac: its ``signed``
    function, run as printed, must make headers the intake accepts for the key it was given."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    block = readme.split("```python\n", 1)[1].split("```", 1)[0]
    source = "\n".join(line[2:] if line.startswith("  ") else line for line in block.splitlines())
    definition = source[source.index("def signed(") : source.index("def reply_is_mine(")]
    scope: dict[str, Any] = {"hashlib": hashlib, "hmac": hmac, "json": json}
    exec(definition, scope)
    value, headers = scope["signed"](ACME.key, request("readme", "alice"))
    assert RING.verify(headers, value) == ACME
    with pytest.raises(RequestSignatureError):
        RING.verify(headers, value + b" ")
    # and its ``reply_is_mine`` accepts what a worker signs back with that key, nothing else
    checker = source[source.index("def reply_is_mine(") : source.index("request_id = ")]
    exec(checker, scope)
    mine = scope["reply_is_mine"]
    reply = b'{"request_id": "readme", "status": "ok"}'
    assert mine(ACME.key, reply, sign_reply(ACME, reply))
    assert not mine(ACME.key, reply, sign_reply(BETA, reply))
    assert not mine(ACME.key, reply + b" ", sign_reply(ACME, reply))
    assert not mine(ACME.key, reply, sign(ACME, reply))  # a request's signature is no reply's
