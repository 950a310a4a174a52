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
inference worker answers such a request when it admits it (:func:`template_answer`): at level 3 its
batch and offline readers are not held back by strict priority, since what they read takes no place
in the embedding stage or the queue (``Inference.can_admit``), so work forwarded before the level
rose is answered too, not left to expire.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from agents.outcomes import BUSY_FALLBACK, request_input
from models.base import ModelInput, ModelOutput
from pipeline.degrade import DegradePlan
from pipeline.keys import cache_key, scope_of
from pipeline.records import InferenceReply, Timings, WorkItem, now_ms
from pipeline.replan import request_plan, templated_at_once, templates_whole_class

if TYPE_CHECKING:
    from agents.inference import Inference


def _template_state(inf: Inference) -> tuple[bool, bool]:
    """Whether the worker is ready with a template model, and whether that template reads vectors."""
    template = inf.template_model
    if template is None or not inf.ready.is_set():
        return False, False
    return True, template.template_needs_vectors()


def answers_at_once(inf: Inference, plan: DegradePlan) -> bool:
    """Whether a request planned to ``plan`` gets the template as soon as it is read
    (:func:`pipeline.replan.templated_at_once`)."""
    return templated_at_once(plan, *_template_state(inf))


def answers_class_at_once(inf: Inference, priority: str) -> bool:
    """Whether the level in force answers every record of ``priority`` that way, at admission
    (:func:`pipeline.replan.templates_whole_class`). Called before each read of a work topic."""
    available, needs_vectors = _template_state(inf)
    return available and not needs_vectors and templates_whole_class(inf.level(), priority)


def template_answer(inf: Inference, inp: ModelInput, scope: str, key: str | None) -> ModelOutput | None:
    """The template's answer to ``inp`` (planned and scoped already; ``key`` None when the request
    may not use the cache), or None when the cache holds an answer under ``key``: the normal path
    answers it from there. Called on the event loop (the FAQ template's n-gram layer takes about
    0.2 ms a question)."""
    s = inf.rt.settings
    assert inf.template_model is not None
    if key is not None and inf.cache is not None and s.cache_enabled:
        # the lookup the inference path makes first for such an item (exact; no vector to match)
        decision = inf.decision if s.semantic_cache_enabled else None
        if inf.cache.lookup(key, scope, None, inp.text, decision) is not None:
            return None
    return inf.template_model.template_answers([inp])[0] or ModelOutput(BUSY_FALLBACK, "template")


def template_at_intake(inf: Inference, work: WorkItem) -> InferenceReply | None:
    """The reply the intake sends instead of forwarding ``work``, or None to forward it. Called by
    the intake agent for each request it would forward."""
    s = inf.rt.settings
    plan = request_plan(work, inf.level(), s.degrade_max_tokens_cap)
    if not answers_at_once(inf, plan):
        return None
    req = work.request
    inp = replace(request_input(req), max_tokens=plan.max_tokens, logprobs=plan.logprobs)
    scope = scope_of(req, s.served_model, inf.model.version, plan.max_tokens, plan.logprobs)
    out = template_answer(inf, inp, scope, cache_key(inp.text, scope) if req.cache else None)
    if out is None:
        return None
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
