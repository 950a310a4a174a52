"""The interface every model backend implements.

Lifecycle, in the order the inference worker calls it:

1. ``load()`` once, at worker start, off the event loop (it may take seconds).
2. ``infer(batch)`` for each micro-batch, in a worker thread (never on the event loop). It returns
   one :class:`ModelOutput` per input, in order, or raises a :class:`models.exceptions.ModelError`
   for the whole batch; the caller retries transient errors and splits batches to isolate a bad
   input.
3. ``template_answer(inp)`` under degradation level 3: a cheap canned answer, or ``None`` when the
   backend has none.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True, slots=True)
class ModelInput:
    """One request as a model sees it."""

    messages: tuple[ChatMessage, ...]
    max_tokens: int = 256
    temperature: float = 0.0
    logprobs: bool = False
    #: the embedding of :attr:`text`, when the pipeline computed one (see
    #: :meth:`ModelBackend.accepts_vectors_from`); not part of equality
    vector: Any = field(default=None, compare=False, repr=False)

    @property
    def text(self) -> str:
        """The last user message: what an answerer or an embedder reads."""
        for m in reversed(self.messages):
            if m.role == "user":
                return m.content
        return self.messages[-1].content if self.messages else ""

    def chat(self) -> list[dict[str, str]]:
        """The messages as chat-completion dicts (``role``, ``content``): what an OpenAI-compatible
        endpoint and a Hugging Face tokenizer's chat template both read."""
        return [{"role": m.role, "content": m.content} for m in self.messages]


@dataclass(frozen=True, slots=True)
class ModelOutput:
    answer: str
    finish_reason: str = "stop"  # stop | length | template
    logprobs: list[float] | None = None
    extra: dict[str, object] = field(default_factory=dict)


class ModelBackend(abc.ABC):
    """A model that answers batches of requests."""

    #: short name requests use in their ``model`` field
    name: str = "model"
    #: version stamped on replies and on the ``model_inference_latency`` metric
    version: str = "0"
    #: the largest batch this backend accepts in one ``infer`` call
    max_batch_size: int = 32

    def load(self) -> None:  # noqa: B027 - optional hook
        """Load weights or open connections. Called once, off the event loop."""

    @abc.abstractmethod
    def infer(self, batch: Sequence[ModelInput]) -> list[ModelOutput]:
        """Answer a batch; blocking; one output per input, in order."""

    def template_answer(self, inp: ModelInput) -> ModelOutput | None:
        """A canned answer for degradation level 3, or ``None``."""
        return None

    def template_answers(self, batch: Sequence[ModelInput]) -> Sequence[ModelOutput | None]:
        """:meth:`template_answer` for a batch (blocking: called in a worker thread, never on the
        event loop); a backend that classifies overrides it to do one call for the batch."""
        return [self.template_answer(inp) for inp in batch]

    def template_needs_vectors(self) -> bool:
        """Whether :meth:`template_answers` reads :attr:`ModelInput.vector`. When it does not, an item
        that degradation level 3 sends to the template skips the embedding stage (the worker's dearest
        step on the default path), so the level sheds that cost (docs/architecture.md, "Degradation")."""
        return False

    def peek_version(self) -> str:
        """The version :meth:`load` will stamp, computed without loading (cheap: file hashes).

        Called by the intake agent, which keys its exact cache by model version but never loads the
        model, so a model fix is never answered from a cache filled by the old version.
        """
        return self.version

    def accepts_vectors_from(self, embedder: object) -> bool:
        """Whether :attr:`ModelInput.vector` made by ``embedder`` may stand in for this model's own
        embedding of the input's text (the FAQ answerer, with the same embedder): each request is
        then embedded once, by the inference agent's embedding stage."""
        return False

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources. Called once at worker shutdown."""
