"""Errors raised by model backends; all derive from :class:`pipeline.exceptions.SurgeError`.

:class:`ModelError` and :class:`TransientModelError` live in :mod:`pipeline.exceptions` (the pipeline's
core handles them without importing a backend) and are re-exported here with the backend-only errors.
"""

from __future__ import annotations

from pipeline.exceptions import ModelError, PartialBatchError, TransientModelError

__all__ = [
    "FAQDataError",
    "MergeDataError",
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


class FAQDataError(ModelError):
    """A ``text,category`` file the FAQ trainer or its evaluation cannot use: missing, not UTF-8,
    without those columns, or too small to train on (the path and what is wrong are in the message).
    Raised before a model is loaded or a weight written."""

    def __init__(self, path: object, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path


class MergeDataError(ModelError):
    """A data folder ``surge dedup train`` cannot learn from: not a folder, a file missing, or too few
    pairs or intents (the path and what is wrong are in the message; the minimums are in
    :mod:`models.merge_train`). Raised before the embedder loads or a weight is written."""

    def __init__(self, path: object, problem: str) -> None:
        super().__init__(f"{path}: {problem}")
        self.path = path
