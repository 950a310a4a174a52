"""The keys that decide what may be shared, in one place (docs/architecture.md, "Caches and scopes").

* :func:`request_scope`: within one scope requests may share an answer (exact cache, semantic cache,
  merging). It covers the tenant, the served model and its version, the generation parameters and
  the whole conversation except its last user message (system prompt and earlier turns), so a
  different system prompt, history, model fix or parameter set never shares an answer. The last
  user message is what the exact key normalises and the embedder reads.
* :func:`reply_key`: the idempotency key of a request in the reply record table: tenant, user and
  request_id, so two tenants (or two users) numbering their requests alike never collide.
* :func:`source_key`: an identifier the client cannot choose (the record's topic, partition and
  offset), used for merge leaders.

Pure: hashlib and json only. Intake and inference both call these, so their keys always agree.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pipeline.dedup import exact_key, normalize

if TYPE_CHECKING:
    from pipeline.records import InferenceRequest


def request_scope(
    *,
    tenant: str,
    model: str,
    model_version: str,
    max_tokens: int,
    temperature: float,
    logprobs: bool,
    context: Sequence[tuple[str, str]] = (),
) -> str:
    """sha256 hex of everything two requests must share to share an answer."""
    payload = json.dumps(
        [
            tenant,
            model,
            model_version,
            int(max_tokens),
            float(temperature),
            bool(logprobs),
            [[role, content] for role, content in context],
        ],
        ensure_ascii=False,
    )
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()


def scope_of(
    req: InferenceRequest,
    model: str,
    version: str,
    max_tokens: int | None = None,
    logprobs: bool | None = None,
) -> str:
    """The cache and merge scope of a request, the one function intake and inference both call:
    ``model`` is the served model name (``Settings.served_model``, never a folder path), ``version``
    the model's version; ``max_tokens``/``logprobs`` when degradation changed what is asked."""
    return request_scope(
        tenant=req.tenant,
        model=model,
        model_version=version,
        max_tokens=req.max_tokens if max_tokens is None else max_tokens,
        temperature=req.temperature,
        logprobs=req.logprobs if logprobs is None else logprobs,
        context=req.context(),
    )


def cache_key(text: str, scope: str) -> str:
    """The exact-cache key of the last user message ``text`` within ``scope``."""
    return exact_key(normalize(text), scope)


def reply_key(tenant: str, user_id: str, request_id: str, reply_to: str, digest: str = "") -> str:
    """Key of a request's recorded reply; the parts are length-prefixed so no two collide.

    ``reply_to`` (the resolved topic) is part of it: a recorded reply is re-sent only to the topic it
    was recorded for. Without it, anyone who could write a request naming another client's tenant,
    user and request_id could have that client's recorded answer re-sent to a reply topic of their
    own (docs/architecture.md, "Tenant isolation"); a redelivered request names the same topic.
    ``digest`` (:attr:`pipeline.records.InferenceRequest.digest`, what the request asks) is part of
    it too: a reply is re-sent only for the same request, never for another question sent under
    the same id ahead of it; empty for replies that are never recorded (unreadable records)."""
    parts = (tenant, user_id, request_id, reply_to, digest)
    return "|".join(f"{len(p)}:{p}" for p in parts)


def source_key(topic: str, partition: int, offset: int) -> str:
    """Where a record was read from: unique per record, never chosen by a client."""
    return f"{topic}/{partition}@{offset}"
