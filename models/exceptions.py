"""Errors raised by model backends; all derive from :class:`pipeline.exceptions.SurgeError`.

:class:`ModelError` and :class:`TransientModelError` live in :mod:`pipeline.exceptions` (the pipeline's
core handles them without importing a backend) and are re-exported here with the backend-only errors.
"""

from __future__ import annotations

from pipeline.exceptions import ModelError, PartialBatchError, TransientModelError

__all__ = [
    "ModelError",
    "ModelLoadError",
    "ModelOutOfMemoryError",
    "PartialBatchError",
    "TransientModelError",
]


class ModelOutOfMemoryError(ModelError):
    """The batch did not fit in memory; the caller splits it and tries the halves."""

    def __init__(self, batch_size: int, detail: str = "") -> None:
        super().__init__(f"out of memory on a batch of {batch_size}" + (f": {detail}" if detail else ""))
        self.batch_size = batch_size


class ModelLoadError(ModelError):
    """A model folder or endpoint could not be loaded."""
