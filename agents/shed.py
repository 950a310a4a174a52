"""Level 3 at once: the template answer a request gets as soon as it is read, by the intake or at
admission, instead of after the embedding stage (docs/architecture.md, "Degradation").

At level 3 a batch or offline request (or an interactive one of the free tier) gets the template
answer. Read from its work topic, it waits behind the higher classes (strict priority) and, in a
surge, is still there when its deadline passes: it got ``deadline_exceeded`` minutes later, and the
worker spent the time after the surge draining that backlog. When the worker that runs the intake
also runs the inference agent (the default role ``all``) and its level sends a request to a template
that reads no vector, the intake gives that answer itself, recorded in the reply book like every
reply, so a redelivery gets the same one. A request whose answer the cache holds under its degraded
parameters is forwarded as before: the inference path answers it from there.

Where the intake runs apart (``--role intake``, the Kubernetes shape) it forwards everything, and the
inference worker answers such a request when it admits it (:func:`template_now`): at level 3 its
batch and offline readers are not held back by strict priority, since what they read takes no place
in the embedding stage or the queue (``Inference.can_admit``), so work forwarded before the level
rose is answered too, not left to expire.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from agents.outcomes import BUSY_FALLBACK, request_input
from models.base import ModelOutput
from pipeline.degrade import DegradePlan
from pipeline.keys import cache_key, scope_of
from pipeline.records import InferenceReply, Timings, WorkItem, now_ms
from pipeline.replan import request_plan, templated_at_once

if TYPE_CHECKING:
    from agents.inference import Inference


def template_now(inf: Inference, work: WorkItem) -> tuple[DegradePlan, ModelOutput] | None:
    """The plan and the template answer of ``work`` at the level in force, or None when it takes the
    normal path: not templated at this level, a template that reads vectors, or an answer the cache
    holds under its degraded parameters. Called on the event loop (the FAQ template's n-gram layer
    takes about 0.2 ms a question)."""
    s = inf.rt.settings
    template = inf.template_model
    if template is None or not inf.ready.is_set():
        return None
    plan = request_plan(work, inf.level(), s.degrade_max_tokens_cap)
    if not templated_at_once(plan, True, template.template_needs_vectors()):
        return None
    req = work.request
    inp = replace(request_input(req), max_tokens=plan.max_tokens, logprobs=plan.logprobs)
    if inf.cache is not None and s.cache_enabled and req.cache:
        # the lookup the inference path makes first for such an item (exact; no vector to match)
        scope = scope_of(req, s.served_model, inf.model.version, plan.max_tokens, plan.logprobs)
        decision = inf.decision if s.semantic_cache_enabled else None
        if inf.cache.lookup(cache_key(inp.text, scope), scope, None, inp.text, decision) is not None:
            return None
    return plan, template.template_answers([inp])[0] or ModelOutput(BUSY_FALLBACK, "template")


def template_at_intake(inf: Inference, work: WorkItem) -> InferenceReply | None:
    """The reply the intake sends instead of forwarding ``work``, or None to forward it. Called by
    the intake agent for each request it would forward."""
    now = template_now(inf, work)
    if now is None:
        return None
    plan, out = now
    req = work.request
    return InferenceReply(
        request_id=req.request_id,
        user_id=req.user_id,
        status="ok",
        answer=out.answer,
        finish_reason=out.finish_reason,
        served_from="template",
        degradation_level=plan.level_applied,
        model_version=inf.model.version,
        priority=work.priority,
        timings=Timings(total_ms=max(0, now_ms() - work.created_at_ms)),
    )
