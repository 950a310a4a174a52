"""Errors raised by model backends; all derive from :class:`pipeline.exceptions.SurgeError`."""

from __future__ import annotations

from pipeline.exceptions import SurgeError


class ModelError(SurgeError):
    """A model call failed for this input; permanent unless a subclass says otherwise."""

    code = "model_error"


class TransientModelError(ModelError):
    """A failure worth retrying with backoff (timeouts, 5xx from a remote endpoint, busy device)."""


class ModelOutOfMemoryError(ModelError):
    """The batch did not fit in memory; the caller splits it and tries the halves."""

    def __init__(self, batch_size: int, detail: str = "") -> None:
        super().__init__(f"out of memory on a batch of {batch_size}" + (f": {detail}" if detail else ""))
        self.batch_size = batch_size


class ModelLoadError(ModelError):
    """A model folder or endpoint could not be loaded."""
