"""The answer of degradation level 3: what a request gets instead of a model call under overload.

``SURGE_DEGRADE_TEMPLATE`` chooses it per deployment (one worker serves one model): ``faq`` answers
with the banking FAQ answerer, any other text is answered as written, and empty (the default) means
the FAQ answerer for ``model=faq`` and :data:`BUSY_ANSWER` for every other model, whose users never
asked a bank. See docs/architecture.md "Degradation" and "Security".
"""

from __future__ import annotations

from collections.abc import Sequence

from models.base import ModelBackend, ModelInput, ModelOutput
from pipeline.settings import Settings

#: the default level-3 answer of models other than the FAQ answerer
BUSY_ANSWER = (
    "The service is very busy right now and could not answer this request with the model; "
    "please try again in a little while."
)


class TextTemplate(ModelBackend):
    """A fixed answer, marked ``finish_reason="template"``; loads nothing."""

    name = "template"
    version = "template-1"

    def __init__(self, text: str = BUSY_ANSWER) -> None:
        if not text.strip():
            raise ValueError("a template answer must not be empty")
        self.text = text

    def infer(self, batch: Sequence[ModelInput]) -> list[ModelOutput]:
        """The template for each input (never called by the pipeline; here to complete the interface)."""
        return [self.template_answer(inp) for inp in batch]

    def template_answer(self, inp: ModelInput) -> ModelOutput:
        return ModelOutput(self.text, "template")


def template_choice(settings: Settings) -> str:
    """``"faq"`` or the fixed text that ``degrade_template`` selects for ``settings.model``."""
    choice = settings.degrade_template.strip()
    if not choice:
        return "faq" if settings.model == "faq" else BUSY_ANSWER
    return "faq" if choice.lower() == "faq" else settings.degrade_template


def build_template(settings: Settings, model: ModelBackend) -> ModelBackend | None:
    """The template answerer of an inference worker whose answer model is ``model``.

    With ``model=faq`` and the FAQ template, the model itself; with degradation off and another
    model, None (nothing is loaded that would never answer).
    """
    choice = template_choice(settings)
    if choice == "faq":
        if settings.model == "faq":
            return model
        if not settings.degrade_enabled:
            return None
        from models.registry import build_faq

        return build_faq(settings)
    return TextTemplate(choice) if settings.degrade_enabled else None
