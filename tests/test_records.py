"""Unit tests of pipeline.records: the request rules (docs/architecture.md, "Records"), salvage, dead
letters."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from pydantic import ValidationError

from pipeline.exceptions import InvalidRequestError
from pipeline.records import (
    DeadLetter,
    ErrorInfo,
    InferenceReply,
    InferenceRequest,
    Message,
    Timings,
    WorkItem,
    deadletter_key,
    decode_request,
    encode,
    salvage_ids,
)

MAX_RECORD = 1 << 20
MAX_CONTENT = 32 << 10


def base(**over: Any) -> dict[str, Any]:
    rec: dict[str, Any] = {"request_id": "req-1", "user_id": "user-1", "prompt": "how do I top up my card"}
    rec.update(over)
    return {k: v for k, v in rec.items() if v is not _DROP}


_DROP = object()


def raw_of(rec: dict[str, Any]) -> bytes:
    return json.dumps(rec).encode("utf-8")


def decode(raw: bytes | None, key: bytes | None = b"user-1") -> InferenceRequest:
    return decode_request(raw, key, max_record_bytes=MAX_RECORD, max_content_bytes=MAX_CONTENT)


def rejected(rec: dict[str, Any] | bytes, key: bytes | None = b"user-1") -> str:
    """Decode a bad record; return the InvalidRequestError message (fails on any other outcome)."""
    raw = rec if isinstance(rec, bytes) else raw_of(rec)
    with pytest.raises(InvalidRequestError) as info:
        decode(raw, key)
    assert info.value.code == "invalid_request"
    return str(info.value)


# ---- valid records and defaults -------------------------------------------------------------------
def test_minimal_request_gets_the_documented_defaults() -> None:
    req = decode(raw_of(base()))
    assert req.tenant == "default"
    assert req.tier == "standard"
    assert req.priority == "interactive"
    assert req.max_tokens == 256
    assert req.temperature == 0.0
    assert req.logprobs is False
    assert req.cache is True
    assert req.deadline_ms is None and req.reply_to is None and req.created_at is None
    assert req.chat() == [Message(role="user", content="how do I top up my card")]
    assert req.text() == "how do I top up my card"


def test_text_is_the_last_user_message() -> None:
    msgs = [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "first question"},
        {"role": "assistant", "content": "an answer"},
        {"role": "user", "content": "second question"},
        {"role": "assistant", "content": "trailing"},
    ]
    req = decode(raw_of(base(prompt=_DROP, messages=msgs)))
    assert req.text() == "second question"
    assert len(req.chat()) == 5


def test_all_fields_at_their_limits_are_accepted() -> None:
    req = decode(
        raw_of(
            base(
                request_id="r" * 128,
                tier="premium",
                priority="realtime",
                max_tokens=4096,
                temperature=2.0,
                logprobs=True,
                deadline_ms=1,
                reply_to="my.replies_topic-1",
                cache=False,
                model="tiny",
                created_at=0,
            )
        )
    )
    assert req.request_id == "r" * 128
    assert (req.max_tokens, req.temperature, req.deadline_ms, req.created_at) == (4096, 2.0, 1, 0)
    assert req.reply_to == "my.replies_topic-1"


@pytest.mark.parametrize("tier", ["free", "standard", "premium"])
@pytest.mark.parametrize("priority", ["realtime", "interactive", "batch", "offline"])
def test_every_tier_and_priority_is_accepted(tier: str, priority: str) -> None:
    req = decode(raw_of(base(tier=tier, priority=priority)))
    assert (req.tier, req.priority) == (tier, priority)


# ---- field rules ----------------------------------------------------------------------------------
@pytest.mark.parametrize("field", ["request_id", "user_id"])
def test_ids_must_be_1_to_128_characters(field: str) -> None:
    assert field in rejected(base(**{field: ""}), key=None)
    assert field in rejected(base(**{field: "x" * 129}), key=None)
    assert field in rejected(base(**{field: _DROP}), key=None)
    assert field in rejected(base(**{field: 7}), key=None)


@pytest.mark.parametrize(
    ("field", "value"),
    [("tier", "gold"), ("priority", "urgent"), ("priority", "Realtime"), ("tier", None)],
)
def test_tier_and_priority_are_enums(field: str, value: Any) -> None:
    assert field in rejected(base(**{field: value}))


def test_messages_or_prompt_is_required() -> None:
    assert "one of messages or prompt is required" in rejected(base(prompt=_DROP))


def test_messages_and_prompt_together_are_rejected() -> None:
    msg = rejected(base(messages=[{"role": "user", "content": "hi there"}]))
    assert "not both" in msg


def test_empty_messages_are_rejected() -> None:
    assert "at least one message" in rejected(base(prompt=_DROP, messages=[]))


def test_blank_prompt_is_rejected() -> None:
    assert "prompt must not be empty" in rejected(base(prompt="   "))


def test_message_role_must_be_known_and_extra_fields_forbidden() -> None:
    assert "messages.0.role" in rejected(base(prompt=_DROP, messages=[{"role": "robot", "content": "x"}]))
    assert "messages.0.name" in rejected(
        base(prompt=_DROP, messages=[{"role": "user", "content": "x", "name": "n"}])
    )
    assert "surprise" in rejected(base(surprise=1))


@pytest.mark.parametrize("value", [0, 4097, -1, 5.0, "5", True])
def test_max_tokens_is_a_strict_int_from_1_to_4096(value: Any) -> None:
    assert "max_tokens" in rejected(base(max_tokens=value))


@pytest.mark.parametrize("value", [-0.1, 2.01, 100])
def test_temperature_is_between_0_and_2(value: float) -> None:
    assert "temperature" in rejected(base(temperature=value))


@pytest.mark.parametrize("raw_value", ["NaN", "Infinity", "-Infinity"])
def test_temperature_rejects_non_finite_json_numbers(raw_value: str) -> None:
    raw = b'{"request_id":"r","user_id":"user-1","prompt":"x","temperature":' + raw_value.encode() + b"}"
    assert "temperature" in rejected(raw)


@pytest.mark.parametrize("value", [0, -5, 1.5, "100"])
def test_deadline_ms_is_a_positive_int(value: Any) -> None:
    assert "deadline_ms" in rejected(base(deadline_ms=value))


@pytest.mark.parametrize("value", ["", "has space", "slash/topic", "café", "a" * 250, "abc\n", "x;y"])
def test_reply_to_must_be_a_topic_name(value: str) -> None:
    assert "reply_to" in rejected(base(reply_to=value))


@pytest.mark.parametrize("value", [-1, 1.5, "1700000000000"])
def test_created_at_is_non_negative_epoch_ms(value: Any) -> None:
    assert "created_at" in rejected(base(created_at=value))


@pytest.mark.parametrize("field", ["logprobs", "cache"])
def test_bool_flags_are_strict(field: str) -> None:
    assert field in rejected(base(**{field: "yes"}))
    assert field in rejected(base(**{field: 1}))


# ---- limits ---------------------------------------------------------------------------------------
def test_record_over_the_limit_names_its_size_and_the_limit() -> None:
    raw = raw_of(base(prompt="x" * 100, pad="y" * MAX_RECORD))
    msg = rejected(raw)
    assert f"record is {len(raw)} bytes" in msg
    assert f"the limit is {MAX_RECORD} bytes" in msg


def test_record_exactly_at_the_limit_passes_the_size_check() -> None:
    rec = base(prompt="x" * 100)
    raw = raw_of(rec)
    # pad with whitespace inside the JSON object: still valid JSON, exactly MAX_RECORD bytes
    raw = raw[:-1] + b" " * (MAX_RECORD - len(raw)) + b"}"
    assert len(raw) == MAX_RECORD
    assert decode(raw).prompt == "x" * 100


def test_content_over_the_limit_names_its_size_and_the_limit() -> None:
    msg = rejected(base(prompt="a" * (MAX_CONTENT + 1)))
    assert f"content is {MAX_CONTENT + 1} bytes" in msg and f"the limit is {MAX_CONTENT} bytes" in msg
    assert decode(raw_of(base(prompt="a" * MAX_CONTENT))).prompt == "a" * MAX_CONTENT


def test_content_limit_counts_utf8_bytes_not_characters() -> None:
    text = "é" * (MAX_CONTENT // 2 + 1)  # 2 bytes each: over the byte limit, under it in characters
    msg = rejected(base(prompt=text))
    assert f"content is {2 * len(text)} bytes" in msg


def test_content_limit_applies_to_every_message() -> None:
    msgs = [{"role": "system", "content": "s" * (MAX_CONTENT + 10)}, {"role": "user", "content": "short"}]
    assert f"content is {MAX_CONTENT + 10} bytes" in rejected(base(prompt=_DROP, messages=msgs))


def test_limits_are_configurable() -> None:
    raw = raw_of(base(prompt="x" * 100))
    with pytest.raises(InvalidRequestError, match="the limit is 50 bytes"):
        decode_request(raw, b"user-1", max_record_bytes=MAX_RECORD, max_content_bytes=50)
    with pytest.raises(InvalidRequestError, match="the limit is 64 bytes"):
        decode_request(raw, b"user-1", max_record_bytes=64, max_content_bytes=MAX_CONTENT)


# ---- key ------------------------------------------------------------------------------------------
def test_key_must_equal_user_id() -> None:
    msg = rejected(raw_of(base()), key=b"someone-else")
    assert "'someone-else'" in msg and "'user-1'" in msg


def test_a_key_that_is_not_utf_8_never_passes_for_a_user_id() -> None:
    """Keys compared after a lenient decoding let ``k\\x80``, ``k\\x81``, ... all pass as user
    ``k\\ufffd``: forty keys, forty partitions' buckets, four times the user's burst served."""
    rec = base(user_id="k\ufffd")
    for key in (b"k\x80", b"k\xa7", b"k\xff"):
        assert "differs from user_id" in rejected(raw_of(rec), key=key)
    assert decode(raw_of(rec), key="k\ufffd".encode()).user_id == "k\ufffd"


def test_a_deadline_past_a_week_or_a_date_past_the_year_2286_is_refused() -> None:
    """A 400-digit ``deadline_ms`` on an offline request passed validation and stopped every worker
    that read it (the scheduler's float arithmetic overflowed), again after each restart."""
    assert "deadline_ms" in rejected(base(priority="offline", deadline_ms=10**400))
    assert "deadline_ms" in rejected(base(deadline_ms=7 * 86_400_000 + 1))
    assert decode(raw_of(base(priority="offline", deadline_ms=7 * 86_400_000))).deadline_ms == 604_800_000
    assert "created_at" in rejected(base(created_at=10**13 + 1))
    item = {
        "request": base(),
        "priority": "offline",
        "tier": "standard",
        "reply_to": "surge.replies",
        "created_at_ms": 1,
        "arrival_ms": 1,
    }
    assert WorkItem.model_validate({**item, "deadline_at_ms": 10**13}).deadline_at_ms == 10**13
    with pytest.raises(ValidationError):  # on an internal topic, from a client with access to it
        WorkItem.model_validate({**item, "deadline_at_ms": 10**400})


def test_missing_key_is_accepted() -> None:
    assert decode(raw_of(base()), key=None).user_id == "user-1"


def test_non_ascii_key_matching_user_id_is_accepted() -> None:
    rec = base(user_id="用户-7")
    assert decode(raw_of(rec), key="用户-7".encode()).user_id == "用户-7"


# ---- undecodable records --------------------------------------------------------------------------
def test_no_value_is_rejected() -> None:
    with pytest.raises(InvalidRequestError, match="empty record"):
        decode(None)


def test_non_utf8_is_rejected_with_the_byte_offset() -> None:
    msg = rejected(b'{"prompt": "\xff\xfe"}')
    assert "not UTF-8" in msg and "at byte 12" in msg
    # the offset is the record's as sent, a byte order mark included
    assert "at byte 15" in rejected(b'\xef\xbb\xbf{"prompt": "\xff\xfe"}')


def test_a_leading_byte_order_mark_is_ignored() -> None:
    # RFC 8259 lets a parser ignore one; .NET and PowerShell producers write it
    assert decode(b"\xef\xbb\xbf" + raw_of(base())).request_id == "req-1"
    assert "not valid JSON" in rejected(b"\xef\xbb\xbf\xef\xbb\xbf" + raw_of(base()))  # one, not two


@pytest.mark.parametrize("raw", [b"", b"{", b"{'single': 'quotes'}", b'{"a": 1,}', b"not json"])
def test_non_json_is_rejected(raw: bytes) -> None:
    assert "not valid JSON" in rejected(raw)


@pytest.mark.parametrize(
    ("raw", "kind"), [(b"[1, 2]", "list"), (b'"text"', "str"), (b"42", "int"), (b"null", "NoneType")]
)
def test_non_object_json_is_rejected(raw: bytes, kind: str) -> None:
    assert f"must be a JSON object, got {kind}" in rejected(raw)


def test_deeply_nested_json_is_an_invalid_request_not_a_crash() -> None:
    # 100k nested arrays fit easily in 1 MiB; json.loads raises RecursionError on them
    rejected(b"[" * 100_000 + b"]" * 100_000)


def test_integer_with_too_many_digits_is_an_invalid_request_not_a_crash() -> None:
    # Python refuses to convert int literals over 4300 digits (ValueError, not JSONDecodeError)
    raw = b'{"request_id":"r","user_id":"user-1","prompt":"x","max_tokens":1' + b"0" * 5000 + b"}"
    rejected(raw)


@pytest.mark.parametrize("field", ["prompt", "messages"])
def test_lone_surrogate_in_content_is_an_invalid_request_not_a_crash(field: str) -> None:
    # valid JSON and valid UTF-8 bytes, but "\ud800" decodes to a str that cannot be encoded as UTF-8
    if field == "prompt":
        raw = b'{"request_id":"r","user_id":"user-1","prompt":"abc \\ud800"}'
    else:
        raw = b'{"request_id":"r","user_id":"user-1","messages":[{"role":"user","content":"\\ud800"}]}'
    rejected(raw)


def test_decode_never_raises_anything_but_invalid_request() -> None:
    bad: list[bytes] = [
        b"\x00\x01",
        b"{}",
        b'{"request_id": null, "user_id": null}',
        b'{"request_id": "r", "user_id": "user-1", "messages": "hello"}',
        b'{"request_id": "r", "user_id": "user-1", "messages": [null]}',
        b'{"request_id": "r", "user_id": "user-1", "messages": [{"role": "user"}]}',
        b'{"request_id": ["r"], "user_id": {"u": 1}, "prompt": 3}',
    ]
    for raw in bad:
        with pytest.raises(InvalidRequestError):
            decode(raw)


# ---- salvage_ids ----------------------------------------------------------------------------------
def test_salvage_ids_from_a_record_that_failed_validation() -> None:
    raw = raw_of({"request_id": "r9", "user_id": "u9", "max_tokens": -3, "reply_to": "my.replies"})
    with pytest.raises(InvalidRequestError):
        decode(raw, key=b"u9")
    assert salvage_ids(raw) == ("r9", "u9", "my.replies")


def test_salvage_ids_drops_an_invalid_reply_to_but_keeps_the_ids() -> None:
    for reply_to in ["bad topic", "", "x/y", 42, "a" * 250]:
        raw = raw_of({"request_id": "r9", "user_id": "u9", "reply_to": reply_to})
        assert salvage_ids(raw) == ("r9", "u9", None), reply_to


@pytest.mark.parametrize("reply_to", ["café", "²", "ответы"])
def test_salvage_ids_applies_the_request_topic_pattern_to_reply_to(reply_to: str) -> None:
    # the request rule is ^[A-Za-z0-9._-]+$ (Kafka's legal topic characters); a salvaged reply_to
    # outside it would send the error reply to a topic name Kafka rejects
    raw = raw_of({"request_id": "r9", "user_id": "u9", "reply_to": reply_to})
    with pytest.raises(InvalidRequestError):
        decode(raw, key=b"u9")
    assert salvage_ids(raw) == ("r9", "u9", None)


@pytest.mark.parametrize(
    "raw",
    [
        None,
        b"",
        b"\xff\xfe",
        b"{not json",
        b"[1]",
        b'{"user_id": "u"}',
        b'{"request_id": "r"}',
        b'{"request_id": "", "user_id": "u"}',
        b'{"request_id": 5, "user_id": "u"}',
        json.dumps({"request_id": "r" * 129, "user_id": "u"}).encode(),
    ],
)
def test_salvage_ids_returns_none_when_ids_cannot_be_read(raw: bytes | None) -> None:
    assert salvage_ids(raw) is None


@pytest.mark.parametrize(
    "raw",
    [
        # an integer past Python's 4,300-digit limit: json.loads refuses the whole record
        b'{"request_id": "r9", "user_id": "u9", "max_tokens": 1' + b"0" * 5000 + b"}",
        # bytes that are not UTF-8, in the prompt only
        b'{"request_id": "r9", "user_id": "u9", "prompt": "caf\xe9"}',
        # a byte order mark before a record that fails validation
        b'\xef\xbb\xbf{"request_id": "r9", "user_id": "u9", "max_tokens": -1}',
    ],
)
def test_salvage_ids_reads_the_ids_past_a_flaw_elsewhere_in_the_record(raw: bytes) -> None:
    with pytest.raises(InvalidRequestError):
        decode(raw, key=b"u9")
    assert salvage_ids(raw) == ("r9", "u9", None)


def test_salvage_ids_refuses_an_id_whose_bytes_are_not_utf8() -> None:
    # read leniently, the id would hold U+FFFD: not the id that was sent, so no reply names it
    assert salvage_ids(b'{"request_id": "r\xff9", "user_id": "u9"}') is None
    assert salvage_ids(b'{"request_id": "r9", "user_id": "u\xff9"}') is None


def test_salvage_ids_on_deeply_nested_json_returns_none() -> None:
    assert salvage_ids(b"[" * 100_000 + b"]" * 100_000) is None


# ---- dead letters ---------------------------------------------------------------------------------
def test_dead_letter_carries_base64_key_and_raw() -> None:
    raw = b"\xff not json \x00"
    dl = DeadLetter.of("surge.requests", 3, 41, "invalid_request", "not UTF-8", b"user-1", raw)
    assert (dl.source_topic, dl.partition, dl.offset, dl.reason) == (
        "surge.requests",
        3,
        41,
        "invalid_request",
    )
    assert base64.b64decode(dl.raw_b64) == raw
    assert dl.key_b64 is not None and base64.b64decode(dl.key_b64) == b"user-1"
    assert dl.raw_bytes == len(raw) and dl.raw_truncated is False
    assert dl.at_ms > 1_600_000_000_000
    again = DeadLetter.model_validate_json(encode(dl))
    assert again == dl


def test_dead_letter_without_key() -> None:
    dl = DeadLetter.of("t", 0, 0, "r", "m", None, b"x")
    assert dl.key_b64 is None
    assert "key_b64" not in json.loads(encode(dl))


def test_dead_letter_truncates_raw_beyond_the_limit_and_flags_it() -> None:
    raw = bytes(range(256)) * 4
    dl = DeadLetter.of("t", 0, 0, "r", "m", None, raw, max_raw_bytes=100)
    assert base64.b64decode(dl.raw_b64) == raw[:100]
    assert dl.raw_bytes == 1024 and dl.raw_truncated is True
    exact = DeadLetter.of("t", 0, 0, "r", "m", None, raw[:100], max_raw_bytes=100)
    assert exact.raw_truncated is False and base64.b64decode(exact.raw_b64) == raw[:100]


def test_a_record_near_the_broker_limit_in_its_key_gets_a_dead_letter_the_broker_accepts() -> None:
    # a default cluster refuses records over 1 MiB (message.max.bytes 1048588): a 900 KB key echoed in
    # the message, base64'd and used as the dead letter's own key made a 2.4 MB record, refused on
    # every try, and the worker stopped after its last attempt (and again on every redelivery)
    key, raw = b"k" * 900_000, b'{"request_id": "r", "user_id": "u", "prompt": "x"}'
    message = rejected(raw, key=key)
    assert len(message) < 300 and "(900000 bytes)" in message
    dl = DeadLetter.of("t", 0, 0, "invalid_request", message, key, raw, max_raw_bytes=600_000)
    assert len(encode(dl)) + len(deadletter_key(key)) < 10_000
    assert dl.key_bytes == 900_000 and dl.key_truncated is True
    assert dl.key_b64 is not None and base64.b64decode(dl.key_b64) == key[:1024]
    # and at the limits of everything at once
    worst = DeadLetter.of(
        "t", 0, 0, "internal", "m" * 1_000_000, key, b"r" * 1_000_000, max_raw_bytes=600_000
    )
    assert len(encode(worst)) + len(deadletter_key(key)) < 1_000_000
    assert worst.message.endswith("(998000 more characters)")
    small = DeadLetter.of("t", 0, 0, "r", "m", b"user-1", b"x")
    assert (small.key_bytes, small.key_truncated) == (6, False)


# ---- encode / replies -----------------------------------------------------------------------------
def test_encode_drops_none_fields() -> None:
    reply = InferenceReply(request_id="r", user_id="u", status="ok", answer="yes")
    data = json.loads(encode(reply))
    assert data["answer"] == "yes"
    for absent in ("error", "merged_into", "similarity", "logprobs", "finish_reason", "model_version"):
        assert absent not in data
    assert data["timings"] == {}
    assert data["degradation_level"] == 0


def test_inference_reply_round_trips() -> None:
    reply = InferenceReply(
        request_id="r1",
        user_id="u1",
        status="ok",
        answer="Top up in the app under Cards.",
        finish_reason="stop",
        logprobs=[-0.5, -1.25],
        served_from="merged",
        merged_into="r0",
        similarity=0.93,
        degradation_level=1,
        model_version="faq-1",
        priority="realtime",
        timings=Timings(queued_ms=1.5, inference_ms=20.0, total_ms=25.0, batch_size=4),
    )
    assert InferenceReply.model_validate_json(encode(reply)) == reply
    err = InferenceReply(
        request_id="r2",
        user_id="u1",
        status="error",
        error=ErrorInfo(code="rate_limited", message="slow down", retry_after_ms=250),
    )
    back = InferenceReply.model_validate_json(encode(err))
    assert back == err and back.error is not None and back.error.retry_after_ms == 250


def test_request_round_trips_through_encode() -> None:
    req = decode(raw_of(base(priority="batch", deadline_ms=900, created_at=1_700_000_000_000)))
    assert decode(encode(req)) == req
    assert "messages" not in json.loads(encode(req))


@pytest.mark.parametrize("field", ["request_id", "user_id"])
def test_salvage_ids_refuses_an_id_that_utf8_cannot_write(field: str) -> None:
    # "\ud800" is valid JSON that decodes to a lone surrogate: as the key or body of an error reply it
    # cannot be encoded, and the record would stop the worker on every redelivery
    ids = {"request_id": "r9", "user_id": "u9", field: "x\ud800"}
    raw = json.dumps({**ids, "max_tokens": -3}).encode()
    assert b"\\ud800" in raw
    with pytest.raises(InvalidRequestError):
        decode(raw, key=b"u9")
    assert salvage_ids(raw) is None
