"""The record formats (docs/architecture.md, "Records"): JSON, UTF-8, validated with pydantic.

Decoding never raises anything but :class:`InvalidRequestError`, whose message says what was
wrong and what the limit is; :func:`salvage_ids` recovers ``request_id``/``user_id`` from a record
that failed validation so that it can still get an error reply.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import time
from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from pipeline.exceptions import InvalidRequestError
from pipeline.terms import Priority, Tier  # defined there; still importable from here

Id = Annotated[str, Field(min_length=1, max_length=128)]
#: longest deadline a client may give (``deadline_ms``): a week. Unbounded, a 400-digit deadline
#: passed validation and stopped every worker that read it, in each float conversion of its time.
MAX_DEADLINE_MS = 7 * 86_400_000
#: latest time (epoch ms) a record may carry: the year 2286
MAX_TIME_MS = 10**13
_TOPIC_RE = re.compile(r"[A-Za-z0-9._-]+")
#: a UTF-8 byte order mark: RFC 8259 (section 8.1) lets a parser ignore one at the start of a JSON
#: text, and some producers write it (.NET's UTF8Encoding with its preamble, PowerShell)
UTF8_BOM = b"\xef\xbb\xbf"


def without_bom(raw: bytes) -> bytes:
    """``raw`` without a leading UTF-8 byte order mark: what every record decoder parses."""
    return raw[len(UTF8_BOM) :] if raw.startswith(UTF8_BOM) else raw


def now_ms() -> int:
    """Wall-clock epoch milliseconds (the unit of every timestamp in the records)."""
    return int(time.time() * 1000)


class Message(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    role: Literal["system", "user", "assistant", "tool"]
    content: str


class InferenceRequest(BaseModel):
    """What producers write to ``surge.requests``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    request_id: Id
    user_id: Id
    tenant: Annotated[str, Field(min_length=1, max_length=128)] = "default"
    tier: Tier = Tier.STANDARD
    priority: Priority = Priority.INTERACTIVE
    messages: list[Message] | None = None
    prompt: str | None = None
    max_tokens: Annotated[int, Field(ge=1, le=4096, strict=True)] = 256
    temperature: Annotated[float, Field(ge=0, le=2)] = 0.0
    logprobs: Annotated[bool, Field(strict=True)] = False
    deadline_ms: Annotated[int, Field(gt=0, le=MAX_DEADLINE_MS, strict=True)] | None = None
    reply_to: Annotated[str, Field(min_length=1, max_length=249, pattern=r"^[A-Za-z0-9._-]+$")] | None = None
    cache: Annotated[bool, Field(strict=True)] = True
    model: Annotated[str, Field(max_length=256)] | None = None
    created_at: Annotated[int, Field(ge=0, le=MAX_TIME_MS, strict=True)] | None = None

    @field_validator("messages")
    @classmethod
    def _messages_not_empty(cls, v: list[Message] | None) -> list[Message] | None:
        if v is not None and not v:
            raise ValueError("messages must hold at least one message")
        return v

    @model_validator(mode="after")
    def _prompt_or_messages(self) -> InferenceRequest:
        if self.messages is None and self.prompt is None:
            raise ValueError("one of messages or prompt is required")
        if self.messages is not None and self.prompt is not None:
            raise ValueError("give messages or prompt, not both")
        if self.prompt is not None and not self.prompt.strip():
            raise ValueError("prompt must not be empty")
        return self

    @cached_property
    def digest(self) -> str:
        """sha256 hex of what the request asks (its conversation, model and generation parameters,
        ``cache``): part of its reply-book key (:func:`pipeline.keys.reply_key`), so that a reply
        recorded for one request is re-sent only for the same request. Without it, anyone who could
        guess a client's request_id could send a question of their own under it first and have
        their answer re-sent, for an hour, in place of the answer to the client's own question
        (docs/architecture.md, "Guarantees"). Times, deadlines, class and tier are left out: a
        client retrying asks the same with a new ``created_at``."""
        payload = json.dumps(
            [
                [[m.role, m.content] for m in self.chat()],
                self.model,
                self.max_tokens,
                self.temperature,
                self.logprobs,
                self.cache,
            ],
            ensure_ascii=False,
        )
        return hashlib.sha256(payload.encode("utf-8", "surrogatepass")).hexdigest()

    def chat(self) -> list[Message]:
        """The conversation, with ``prompt`` turned into one user message."""
        return (
            self.messages if self.messages is not None else [Message(role="user", content=self.prompt or "")]
        )

    def text(self) -> str:
        """The last user message: what caches and dedup compare (within a scope that covers the rest
        of the conversation, see :meth:`context`)."""
        for m in reversed(self.chat()):
            if m.role == "user":
                return m.content
        return self.chat()[-1].content

    def context(self) -> list[tuple[str, str]]:
        """The conversation as (role, content) with the message :meth:`text` compares replaced by a
        marker, ``("?" + its role, "")``, where it stood: the part that cache and merge scopes cover,
        so a different system prompt or history never shares, nor the same messages in another
        order (a question before or after an assistant's greeting), nor the same text from another
        role (a lone system message against a lone user one). Without the marker each of those pairs
        had one scope and one exact key, and one user's crafted conversation could fill the cache
        for the others of its tenant (docs/architecture.md, "Caches and scopes")."""
        chat = self.chat()
        at = next((i for i in range(len(chat) - 1, -1, -1) if chat[i].role == "user"), len(chat) - 1)
        return [(f"?{m.role}", "") if j == at else (m.role, m.content) for j, m in enumerate(chat)]


class WorkItem(BaseModel):
    """A validated request on its way to the inference agent (``surge.work.<priority>``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    request: InferenceRequest
    priority: Priority
    tier: Tier
    reply_to: str
    created_at_ms: Annotated[int, Field(ge=0, le=MAX_TIME_MS)]
    arrival_ms: Annotated[int, Field(ge=0, le=MAX_TIME_MS)]
    #: None for a class without a deadline (offline); ``encode`` drops it, so it must default
    deadline_at_ms: Annotated[int, Field(ge=0, le=MAX_TIME_MS + MAX_DEADLINE_MS)] | None = None
    cache_key: str | None = None
    #: the client shortened the class deadline (``deadline_ms``) or dated its request before it
    #: reached the broker: a miss of such a request says nothing about the pipeline's load, so it is
    #: left out of the degradation controller's miss rate (docs/architecture.md, "Degradation")
    client_deadline: bool = False
    #: the id of the API key the request was signed with (None: unsigned, ``kafka_request_auth``
    #: open): its reply is signed with the same key (docs/architecture.md, "Tenant isolation")
    key_id: str | None = None


class ErrorInfo(BaseModel):
    model_config = ConfigDict(frozen=True)

    code: Literal[
        "invalid_request", "rate_limited", "overloaded", "deadline_exceeded", "model_error", "internal"
    ]
    message: str
    retry_after_ms: int | None = None


class Timings(BaseModel):
    model_config = ConfigDict(frozen=True)

    queued_ms: float | None = None
    inference_ms: float | None = None
    total_ms: float | None = None
    batch_size: int | None = None


class InferenceReply(BaseModel):
    """One reply per request, on the request's ``reply_to`` topic, keyed by ``user_id``."""

    model_config = ConfigDict(frozen=True)

    request_id: str
    user_id: str
    status: Literal["ok", "error"]
    answer: str | None = None
    finish_reason: Literal["stop", "length", "template"] | None = None
    logprobs: list[float] | None = None
    error: ErrorInfo | None = None
    served_from: Literal["model", "cache", "merged", "template"] | None = None
    merged_into: str | None = None
    similarity: float | None = None
    degradation_level: int = 0
    model_version: str | None = None
    priority: Priority | None = None
    timings: Timings = Timings()

    @field_validator("similarity")
    @classmethod
    def _four_decimals(cls, v: float | None) -> float | None:
        """Similarity to four decimals, whichever stage answered (a remembered merge repeats it)."""
        return None if v is None else round(v, 4)


class DeadLetter(BaseModel):
    """A record surge could not process, for operators (``surge.deadletter``)."""

    model_config = ConfigDict(frozen=True)

    source_topic: str
    partition: int
    offset: int
    reason: str
    message: str
    key_b64: str | None
    raw_b64: str
    raw_bytes: int
    raw_truncated: bool = False
    #: the original key's length, and whether key_b64 (and the dead letter's own key) were cut
    key_bytes: int | None = None
    key_truncated: bool = False
    at_ms: int

    @classmethod
    def of(
        cls,
        topic: str,
        partition: int,
        offset: int,
        reason: str,
        message: str,
        key: bytes | None,
        raw: bytes,
        max_raw_bytes: int = 1 << 20,
    ) -> DeadLetter:
        """A dead letter for one record; raw bytes beyond ``max_raw_bytes``, key bytes beyond
        :data:`DEADLETTER_KEY_BYTES` and message characters beyond :data:`DEADLETTER_MESSAGE_CHARS` are
        cut (the first two flagged), so that a record's size can never make its dead letter too
        large for the broker."""
        return cls(
            source_topic=topic,
            partition=partition,
            offset=offset,
            reason=reason,
            message=cut_text(message, DEADLETTER_MESSAGE_CHARS),
            key_b64=base64.b64encode(deadletter_key(key)).decode() if key is not None else None,
            raw_b64=base64.b64encode(raw[:max_raw_bytes]).decode(),
            raw_bytes=len(raw),
            raw_truncated=len(raw) > max_raw_bytes,
            key_bytes=len(key) if key is not None else None,
            key_truncated=key is not None and len(key) > DEADLETTER_KEY_BYTES,
            at_ms=now_ms(),
        )


#: key bytes kept in a dead letter (and as its own key): a request's key is its user_id (at most 128
#: characters), and a key of up to the broker's record limit must not make the dead letter too large
DEADLETTER_KEY_BYTES = 1024
#: characters of the reason's message kept in a dead letter
DEADLETTER_MESSAGE_CHARS = 2000


def deadletter_key(key: bytes) -> bytes:
    """The key a dead letter carries (and is written with): the original, cut to its first
    :data:`DEADLETTER_KEY_BYTES` bytes."""
    return key[:DEADLETTER_KEY_BYTES]


def cut_text(text: str, limit: int) -> str:
    """``text``, or its first ``limit`` characters and how many more there were."""
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit} more characters)"


def describe(exc: ValidationError) -> str:
    """The first five validation errors of a record, ``field: what is wrong`` each (every decoder's
    error message)."""
    parts = []
    for err in exc.errors()[:5]:
        loc = ".".join(str(p) for p in err["loc"]) or "record"
        parts.append(f"{loc}: {err['msg']}")
    return "; ".join(parts)


def decode_request(
    raw: bytes | None, key: bytes | None, *, max_record_bytes: int, max_content_bytes: int
) -> InferenceRequest:
    """Decode and validate one request record; raises :class:`InvalidRequestError` only."""
    raw = check_size(raw, max_record_bytes, InvalidRequestError)
    text = without_bom(raw)
    try:
        data: Any = json.loads(text.decode("utf-8"))
    except UnicodeDecodeError as exc:
        at = exc.start + len(raw) - len(text)  # the offset in the record as sent, BOM included
        raise InvalidRequestError(f"record is not UTF-8 text: {exc.reason} at byte {at}") from exc
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(
            f"record is not valid JSON: {exc.msg} at line {exc.lineno} col {exc.colno}"
        ) from exc
    except RecursionError as exc:
        raise InvalidRequestError("record is nested too deeply to decode") from exc
    except ValueError as exc:  # e.g. an integer past Python's digit limit
        raise InvalidRequestError(f"record is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise InvalidRequestError(f"record must be a JSON object, got {type(data).__name__}")
    try:
        req = InferenceRequest.model_validate(data)
    except ValidationError as exc:
        raise InvalidRequestError(f"invalid request: {describe(exc)}") from exc
    for m in req.chat():
        try:
            size = len(m.content.encode("utf-8"))
        except UnicodeEncodeError as exc:
            raise InvalidRequestError(
                f"content is not valid Unicode: {exc.reason} at character {exc.start}"
            ) from exc
        if size > max_content_bytes:
            raise InvalidRequestError(f"content is {size} bytes; the limit is {max_content_bytes} bytes")
    check_key(key, "user_id", req.user_id, "requests", InvalidRequestError)
    return req


def check_size(raw: bytes | None, max_record_bytes: int, error: type[InvalidRequestError]) -> bytes:
    """``raw``, when a record has a value of at most ``max_record_bytes``; else ``error`` saying so."""
    if raw is None:
        raise error("empty record (no value)")
    if len(raw) > max_record_bytes:
        raise error(f"record is {len(raw)} bytes; the limit is {max_record_bytes} bytes")
    return raw


def check_key(
    key: bytes | None, field: str, value: str, records: str, error: type[InvalidRequestError]
) -> None:
    """Raise ``error`` when a record's Kafka key is not its ``field`` (``value``): records are keyed by
    that field, so that one user's (or account's) records share a partition."""
    # bytes, not a lenient decoding: keys that differ only in bytes that are not UTF-8 would all
    # pass as one user's, and land on partitions (and rate-limit buckets) of their own
    if key is not None and key != value.encode("utf-8", "surrogatepass"):
        shown = key[:80].decode("utf-8", "replace") + (f"... ({len(key)} bytes)" if len(key) > 80 else "")
        raise error(f"record key {shown!r} differs from {field} {value!r}; key {records} by {field}")


def salvage_object(raw: bytes | None) -> dict[str, Any] | None:
    """The JSON object of a record that failed validation, when it is one and readable (at most 4 MiB):
    where the salvaged ids of an error reply or decision come from.

    Read more leniently than a record is validated, so that a flaw elsewhere in the record does not
    cost it its error reply: bytes that are not UTF-8 become U+FFFD (an id holding one is refused by
    :func:`salvaged_id`: it is not the id that was sent), and integers are read as floats, so that one
    past Python's 4,300-digit limit does not hide the ids (and an id that is a number stays refused).
    Only nesting too deep to parse leaves nothing to read."""
    if not raw or len(raw) > (4 << 20):
        return None
    try:
        data = json.loads(without_bom(raw).decode("utf-8", "replace"), parse_int=float)
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def salvaged_id(value: object, max_len: int = 128) -> str | None:
    """``value`` when it can serve as an id in an error reply: a string of 1 to ``max_len`` characters
    that UTF-8 can encode. JSON's ``"\\ud800"`` escape decodes to a lone surrogate, which no encoder
    can write as UTF-8 (a record key, orjson): such an id would fail the error reply itself, and the
    record would stop the worker on every redelivery. Those records get a dead letter only, as do ids
    holding U+FFFD, which is what :func:`salvage_object` makes of bytes that are not UTF-8."""
    if not (isinstance(value, str) and 0 < len(value) <= max_len) or "\ufffd" in value:
        return None
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return None
    return value


def salvage_ids(raw: bytes | None) -> tuple[str, str, str | None] | None:
    """``(request_id, user_id, reply_to)`` from a record that failed validation, when readable."""
    data = salvage_object(raw)
    if data is None:
        return None
    rid, uid, reply_to = (
        salvaged_id(data.get("request_id")),
        salvaged_id(data.get("user_id")),
        data.get("reply_to"),
    )
    if rid is None or uid is None:
        return None
    if not (isinstance(reply_to, str) and len(reply_to) <= 249 and _TOPIC_RE.fullmatch(reply_to)):
        reply_to = None
    return rid, uid, reply_to


def encode(record: BaseModel) -> bytes:
    """JSON bytes of a record, without null fields."""
    return record.model_dump_json(exclude_none=True).encode("utf-8")
