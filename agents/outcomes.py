"""What happens to each request in the inference worker, and how it becomes a reply.

A :class:`Pending` is one request from admission to reply; an :class:`Outcome` is what it got (an
answer or an error, and where the answer came from); :class:`ReplyWriter` turns outcomes into
replies, in order (each recorded in the reply book first), and acks each source record, in offset
order, once its reply is on the broker (docs/architecture.md, "Guarantees").
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import faust
import numpy as np
from faust.types import EventT

from agents.acks import Ticket
from agents.runtime import Runtime
from models.base import ChatMessage, ModelBackend, ModelInput, ModelOutput
from pipeline.exceptions import SurgeError
from pipeline.queue_wait import Unreachable
from pipeline.records import InferenceReply, InferenceRequest, Timings, WorkItem, now_ms

Source = Literal["model", "cache", "merged", "template", "error"]

#: the level-3 answer when the template model has none
BUSY_FALLBACK = "We are very busy right now; please try again shortly."


def request_input(req: InferenceRequest) -> ModelInput:
    """What the model (or the template) is given for ``req``, before degradation changes it."""
    return ModelInput(
        messages=tuple(ChatMessage(m.role, m.content) for m in req.chat()),
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        logprobs=req.logprobs,
    )


@dataclass
class Pending:
    """One request inside this worker, from admission to reply."""

    stream: faust.StreamT
    event: EventT
    work: WorkItem
    scope: str
    inp: ModelInput
    ticket: Ticket
    #: the merge-leader id: where the record was read from, never chosen by a client
    lead_id: str
    level: int = 0
    vector: np.ndarray | None = None
    cache_key: str | None = None
    #: degradation level 3 sends it to the template answer (after a cache lookup)
    template: bool = False
    #: refused before its embedding: it would wait past its deadline (pipeline/queue_wait.py)
    unreachable: Unreachable | None = None
    #: copies of this very request read again (a redelivery, e.g. after a rebalance gave this worker
    #: back a partition whose drain timed out) while it was still in flight: acked with its reply,
    #: which is the one reply they all get (a twin asking for another reply topic gets a copy there)
    twins: list[Pending] = field(default_factory=list)

    @property
    def req_id(self) -> str:
        return self.work.request.request_id

    @property
    def tenant(self) -> str:
        return self.work.request.tenant


@dataclass(frozen=True, slots=True)
class Outcome:
    """The answer (or error) one request gets; ``merged_into``/``similarity`` for merged and cached."""

    pending: Pending
    result: ModelOutput | SurgeError
    source: Source
    merged_into: str | None = None
    similarity: float | None = None
    model_version: str | None = None

    @classmethod
    def error(cls, pending: Pending, err: SurgeError) -> Outcome:
        return cls(pending, err, "error")


class ReplyWriter:
    """Sends replies for outcomes; the model's version is stamped where an outcome has none."""

    def __init__(self, rt: Runtime, model: ModelBackend) -> None:
        self.rt = rt
        self.model = model  # its version is known only after load()
        #: told of each request answered (the inference agent forgets it as in flight)
        self.on_answered: Callable[[Pending], None] | None = None

    async def send(
        self, outcomes: Sequence[Outcome], *, batch_size: int = 0, inference_ms: float | None = None
    ) -> None:
        """One reply per outcome, enqueued in order; the records are acked once their replies are on
        the broker. A twin (the same request read again while in flight) is acked with its first
        copy's reply and gets no second one, unless it names another reply topic: a redelivery is
        no repeat. Called by every path that answers a request."""
        tickets: list[Ticket] = []
        futs: list[Awaitable[Any]] = []
        for outcome in outcomes:
            futs.append(await self._reply(outcome, batch_size, inference_ms))
            tickets.append(outcome.pending.ticket)
            for twin in outcome.pending.twins:
                if twin.work.reply_to != outcome.pending.work.reply_to:
                    futs.append(await self._reply(replace(outcome, pending=twin), batch_size, inference_ms))
                tickets.append(twin.ticket)
            if self.on_answered is not None:
                self.on_answered(outcome.pending)
        self.rt.acker.ack_after(tickets, futs)

    async def _reply(self, outcome: Outcome, batch_size: int, inference_ms: float | None) -> Awaitable[Any]:
        pending = outcome.pending
        work, req = pending.work, pending.work.request
        now = now_ms()
        timings = Timings(
            queued_ms=max(0, now - work.arrival_ms - (inference_ms or 0)),
            inference_ms=inference_ms,
            total_ms=max(0, now - work.created_at_ms),
            batch_size=batch_size or None,
        )
        res = outcome.result
        if isinstance(res, ModelOutput):
            reply = InferenceReply(
                request_id=req.request_id,
                user_id=req.user_id,
                status="ok",
                answer=res.answer,
                finish_reason=res.finish_reason,
                logprobs=res.logprobs if pending.inp.logprobs else None,
                served_from=outcome.source,
                merged_into=outcome.merged_into,
                similarity=outcome.similarity,
                degradation_level=pending.level,
                model_version=outcome.model_version or self.model.version,
                priority=work.priority,
                timings=timings,
            )
            return await self.rt.publish(
                reply,
                tenant=req.tenant,
                reply_to=work.reply_to,
                created_at_ms=work.created_at_ms,
                event=pending.event,
                digest=req.digest,
                key_id=work.key_id,
            )
        return await self.rt.error_reply(
            request_id=req.request_id,
            user_id=req.user_id,
            reply_to=work.reply_to,
            code=res.code,
            message=res.message,
            priority=work.priority,
            retry_after_ms=res.retry_after_ms,
            created_at_ms=work.created_at_ms,
            degradation_level=pending.level,
            timings=timings,
            tenant=req.tenant,
            event=pending.event,
            digest=req.digest,
            key_id=work.key_id,
        )
