"""The OpenAI wire format of the gateway: chat requests in, ``chat.completion`` objects and errors out.

Pure logic (no aiohttp, no Kafka): the gateway calls :func:`build_request` for each HTTP request
before anything is produced, :func:`completion` / :func:`stream_chunks` for each ok reply, and
:func:`error_status` / :func:`error_body` for each error, whether the gateway or the pipeline found it.

What a client may choose is bounded by its API key (docs/architecture.md "Security"): the tenant is
the key's; the tier and priority may be lowered, never raised (:meth:`pipeline.auth.ApiKey.grant`);
the body's ``user`` becomes ``<tenant>/<user>`` (:func:`pipeline.auth.tenant_user_id`).

A level-3 degradation template is marked where an OpenAI client looks: ``finish_reason`` is
:data:`TEMPLATE_FINISH_REASON` (``content_filter``, the one standard value that says the content is
not the model's completion, so clients with a closed set of finish reasons still parse it), the
``surge`` object says ``served_from: "template"`` and ``template: true``, and the gateway adds the
header ``X-Surge-Served-From``.
"""

from __future__ import annotations

import json
import math
import re
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from pipeline.auth import ApiKey, tenant_user_id
from pipeline.exceptions import InvalidRequestError
from pipeline.records import MAX_DEADLINE_MS, InferenceReply, decode_request
from pipeline.settings import PRIORITIES, TIERS, Settings

#: HTTP status of each error code (docs/architecture.md, "Records", plus the gateway's own)
STATUS_OF_CODE: dict[str, int] = {
    "invalid_request": 400,
    "invalid_api_key": 401,
    "permission_denied": 403,
    "request_too_large": 413,
    "rate_limited": 429,
    "model_error": 500,
    "internal": 500,
    "overloaded": 503,
    "unavailable": 503,
    "deadline_exceeded": 504,
}

#: OpenAI ``error.type`` of each error code
TYPE_OF_CODE: dict[str, str] = {
    "invalid_request": "invalid_request_error",
    "invalid_api_key": "authentication_error",
    "permission_denied": "permission_error",
    "request_too_large": "invalid_request_error",
    "rate_limited": "rate_limit_error",
    "model_error": "server_error",
    "internal": "server_error",
    "overloaded": "overloaded_error",
    "unavailable": "server_error",
    "deadline_exceeded": "timeout_error",
}

#: largest number of content chunks one streamed answer is cut into
MAX_STREAM_CHUNKS = 16
#: ``finish_reason`` of a degradation template (the reply's ``finish_reason: "template"``)
TEMPLATE_FINISH_REASON = "content_filter"
#: ``X-Surge-Deadline-Ms``: ASCII digits only, at most this many (``int()`` would take "١٢" or fail on "²")
_DEADLINE_HEADER_RE = re.compile(r"[0-9]{1,12}", re.ASCII)

_ROLES = {"system", "user", "assistant", "tool", "developer"}
_UNSUPPORTED = ("tools", "functions", "tool_choice", "function_call", "audio", "prediction")


def model_name(settings: Settings) -> str:
    """The model the gateway advertises at ``/v1/models`` and answers with by default."""
    return settings.served_model  # one definition: the intake's and inference's cache scopes use it too


def error_status(code: str) -> int:
    """HTTP status of an error code; unknown codes are server errors (500)."""
    return STATUS_OF_CODE.get(code, 500)


def retry_after_s(retry_after_ms: int | None) -> int | None:
    """``Retry-After`` header value in whole seconds (rounded up, at least 1), or None."""
    if retry_after_ms is None:
        return None
    return max(1, math.ceil(retry_after_ms / 1000))


def error_body(code: str, message: str, param: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error object: ``{"error": {"message", "type", "param", "code"}}``."""
    return {
        "error": {
            "message": message,
            "type": TYPE_OF_CODE.get(code, "server_error"),
            "param": param,
            "code": code,
        }
    }


def _words(text: str) -> int:
    return len(text.split())


def _content_text(content: Any, index: int) -> str:
    """Text of one message's content: a string, None (assistant tool calls), or a list of text parts."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for j, part in enumerate(content):
            if (
                not isinstance(part, dict)
                or part.get("type") != "text"
                or not isinstance(part.get("text"), str)
            ):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidRequestError(
                    f"messages[{index}].content[{j}]: only text parts are supported, got {kind!r}"
                )
            parts.append(part["text"])
        return "\n".join(parts)
    raise InvalidRequestError(
        f"messages[{index}].content must be a string or a list of text parts, got {type(content).__name__}"
    )


def _messages(raw: Any) -> list[dict[str, str]]:
    if not isinstance(raw, list) or not raw:
        raise InvalidRequestError("messages is required: a non-empty list of {role, content} objects")
    out = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise InvalidRequestError(f"messages[{i}] must be an object, got {type(m).__name__}")
        role = m.get("role")
        # a list or an object is not hashable: ``in`` a set would raise TypeError (an HTTP 500)
        if not isinstance(role, str) or role not in _ROLES:
            raise InvalidRequestError(
                f"messages[{i}].role must be one of {sorted(_ROLES)}, got {_show(role)}"
            )
        out.append(
            {"role": "system" if role == "developer" else role, "content": _content_text(m.get("content"), i)}
        )
    if not any(m["content"].strip() for m in out):
        raise InvalidRequestError("messages hold no text: at least one message needs non-empty content")
    return out


def _show(value: Any, limit: int = 40) -> str:
    """A value as JSON for a message, cut at ``limit`` characters; safe on deep or huge values."""
    try:
        return json.dumps(value)[:limit]
    except (RecursionError, ValueError):
        return type(value).__name__


def _int_field(body: Mapping[str, Any], name: str, lo: int, hi: int | None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int):
        raise InvalidRequestError(f"{name} must be an integer, got {_show(v)}")
    if v < lo or (hi is not None and v > hi):
        limit = f"{lo}-{hi}" if hi is not None else f">= {lo}"
        raise InvalidRequestError(f"{name} must be {limit}, got {_show(v)}")
    return v


def _choice(value: Any, name: str, allowed: tuple[str, ...]) -> str | None:
    if value is None or value == "":
        return None
    if value not in allowed:
        raise InvalidRequestError(f"{name} must be one of {list(allowed)}, got {str(value)[:40]!r}")
    return str(value)


@dataclass(frozen=True)
class ChatCall:
    """One validated chat request: the InferenceRequest dict to produce and how to answer it."""

    request: dict[str, Any]
    model: str
    stream: bool
    include_usage: bool
    prompt_tokens: int


def build_request(
    raw: bytes,
    headers: Mapping[str, str],
    *,
    settings: Settings,
    request_id: str,
    key: ApiKey,
    reply_to: str,
    created_at_ms: int,
) -> ChatCall:
    """Validate one ``POST /v1/chat/completions`` body and build its InferenceRequest for ``key``.

    Called by the gateway before anything is produced; raises :class:`InvalidRequestError` (400)
    with a message naming the field and its limit, or :class:`pipeline.exceptions.PermissionDeniedError`
    (403) for a tier or priority above the key's. ``headers`` must be case-insensitive (aiohttp's).
    """
    if not raw.strip():
        raise InvalidRequestError("request body is empty; send a JSON chat completion request")
    try:
        body = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InvalidRequestError(
            f"request body is not UTF-8 text: {exc.reason} at byte {exc.start}"
        ) from exc
    except json.JSONDecodeError as exc:
        raise InvalidRequestError(
            f"request body is not valid JSON: {exc.msg} at line {exc.lineno} col {exc.colno}"
        ) from exc
    except RecursionError as exc:
        raise InvalidRequestError(
            f"request body nests JSON arrays or objects deeper than {sys.getrecursionlimit()} levels"
        ) from exc
    except ValueError as exc:  # e.g. an integer beyond Python's int digit limit
        raise InvalidRequestError(f"request body has a value that cannot be read: {str(exc)[:120]}") from exc
    if not isinstance(body, dict):
        raise InvalidRequestError(f"request body must be a JSON object, got {type(body).__name__}")
    for name in _UNSUPPORTED:
        if body.get(name):
            raise InvalidRequestError(f"{name} is not supported by this gateway")
    n = _int_field(body, "n", 1, None)
    if n is not None and n != 1:
        raise InvalidRequestError(f"n must be 1 (one choice per request), got {n}")
    messages = _messages(body.get("messages"))
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not 0 < len(model) <= 256):
        raise InvalidRequestError("model must be a string of 1-256 characters")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise InvalidRequestError(f"stream must be true or false, got {_show(stream)}")
    opts = body.get("stream_options") or {}
    if not isinstance(opts, dict):
        raise InvalidRequestError("stream_options must be an object")
    max_tokens = _int_field(body, "max_completion_tokens", 1, 4096)
    if max_tokens is None:
        max_tokens = _int_field(body, "max_tokens", 1, 4096)
    temperature = body.get("temperature")
    if temperature is not None and (
        isinstance(temperature, bool) or not isinstance(temperature, int | float) or not 0 <= temperature <= 2
    ):
        raise InvalidRequestError(f"temperature must be a number 0-2, got {_show(temperature)}")
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise InvalidRequestError(f"logprobs must be true or false, got {_show(logprobs)}")
    cache = body.get("cache")
    if cache is not None and not isinstance(cache, bool):
        raise InvalidRequestError(f"cache must be true or false, got {_show(cache)}")
    user = body.get("user")
    if user is not None and (not isinstance(user, str) or not 0 < len(user) <= 128):
        raise InvalidRequestError("user must be a string of 1-128 characters")
    priority = _choice(headers.get("X-Surge-Priority"), "X-Surge-Priority", PRIORITIES) or _choice(
        body.get("priority"), "priority", PRIORITIES
    )
    tier = _choice(headers.get("X-Surge-Tier"), "X-Surge-Tier", TIERS) or _choice(
        body.get("tier"), "tier", TIERS
    )
    tier, priority = key.grant(tier, priority)
    deadline_ms: Any = headers.get("X-Surge-Deadline-Ms")
    if deadline_ms is not None:
        text = deadline_ms.strip()
        if not _DEADLINE_HEADER_RE.fullmatch(text) or not 0 < int(text) <= MAX_DEADLINE_MS:
            raise InvalidRequestError(
                f"X-Surge-Deadline-Ms must be an integer 1-{MAX_DEADLINE_MS} (a week) in ASCII digits, "
                f"got {deadline_ms[:40]!r}"
            )
        deadline_ms = int(text)
    else:
        deadline_ms = _int_field(body, "deadline_ms", 1, MAX_DEADLINE_MS)

    req: dict[str, Any] = {
        "request_id": request_id,
        "user_id": tenant_user_id(key.tenant, user or key.key_user),
        "tenant": key.tenant,
        "messages": messages,
        "reply_to": reply_to,
        "created_at": created_at_ms,
        "model": model or model_name(settings),
    }
    optional = {
        "priority": priority,
        "tier": tier,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "logprobs": logprobs,
        "deadline_ms": deadline_ms,
        "cache": cache,
    }
    req.update({k: v for k, v in optional.items() if v is not None})
    # the pipeline's own validation (sizes, ranges), run here so that nothing invalid is produced
    decode_request(
        json.dumps(req).encode(),
        None,
        max_record_bytes=settings.max_record_bytes,
        max_content_bytes=settings.max_content_bytes,
    )
    return ChatCall(
        request=req,
        model=req["model"],
        stream=stream,
        include_usage=bool(opts.get("include_usage")),
        prompt_tokens=sum(_words(m["content"]) for m in messages),
    )


def _finish_reason(reply: InferenceReply) -> str:
    if reply.served_from == "template" or reply.finish_reason == "template":
        return TEMPLATE_FINISH_REASON
    return "length" if reply.finish_reason == "length" else "stop"


def surge_extension(reply: InferenceReply, gateway_ms: float) -> dict[str, Any]:
    """The ``surge`` object added to each completion: how the pipeline served it."""
    ext: dict[str, Any] = {
        "request_id": reply.request_id,
        "served_from": reply.served_from,
        "template": reply.served_from == "template",
        "merged_into": reply.merged_into,
        "similarity": reply.similarity,
        "degradation_level": reply.degradation_level,
        "model_version": reply.model_version,
        "priority": reply.priority,
        "finish_reason": reply.finish_reason,
        "timings": {**reply.timings.model_dump(), "gateway_ms": round(gateway_ms, 2)},
    }
    if reply.logprobs is not None:
        ext["logprobs"] = reply.logprobs
    return ext


def usage(call: ChatCall, answer: str) -> dict[str, int]:
    """Rough token counts (whitespace-separated words; the pipeline reports no token counts)."""
    completion_tokens = _words(answer)
    return {
        "prompt_tokens": call.prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": call.prompt_tokens + completion_tokens,
    }


def completion(call: ChatCall, reply: InferenceReply, gateway_ms: float) -> dict[str, Any]:
    """The ``chat.completion`` object of one ok reply."""
    answer = reply.answer or ""
    return {
        "id": f"chatcmpl-{reply.request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": call.model,
        "system_fingerprint": reply.model_version,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": answer, "refusal": None},
                "logprobs": None,
                "finish_reason": _finish_reason(reply),
            }
        ],
        "usage": usage(call, answer),
        "surge": surge_extension(reply, gateway_ms),
    }


def split_answer(answer: str, max_chunks: int = MAX_STREAM_CHUNKS) -> list[str]:
    """Cut an answer into at most ``max_chunks`` pieces at word boundaries; they join back exactly."""
    pieces = re.findall(r"\s*\S+\s*", answer)
    if "".join(pieces) != answer:  # only whitespace: one piece
        return [answer] if answer else []
    per = max(1, math.ceil(len(pieces) / max_chunks))
    return ["".join(pieces[i : i + per]) for i in range(0, len(pieces), per)]


def stream_chunks(call: ChatCall, reply: InferenceReply, gateway_ms: float) -> Iterator[dict[str, Any]]:
    """The ``chat.completion.chunk`` objects of one ok reply, in order (without ``[DONE]``).

    A role chunk, the content in word-boundary pieces, a final chunk with ``finish_reason`` and
    the ``surge`` extension, and a usage chunk when ``stream_options.include_usage`` was set.
    """
    base = {
        "id": f"chatcmpl-{reply.request_id}",
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": call.model,
        "system_fingerprint": reply.model_version,
    }

    def chunk(delta: dict[str, Any], finish: str | None = None, **extra: Any) -> dict[str, Any]:
        return {
            **base,
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}],
            **extra,
        }

    yield chunk({"role": "assistant", "content": ""})
    for piece in split_answer(reply.answer or ""):
        yield chunk({"content": piece})
    yield chunk({}, _finish_reason(reply), surge=surge_extension(reply, gateway_ms))
    if call.include_usage:
        yield {**base, "choices": [], "usage": usage(call, reply.answer or "")}


def models_list(settings: Settings) -> dict[str, Any]:
    """``GET /v1/models``: the one configured model."""
    return {
        "object": "list",
        "data": [{"id": model_name(settings), "object": "model", "created": 0, "owned_by": "surge"}],
    }
