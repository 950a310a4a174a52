"""A sentence-transformers model's forward pass as one TorchScript call (docs/architecture.md,
"Threads and the GIL").

Why: a worker embeds on a thread of its own while the event loop and Faust's consumer thread run
Python. The eager Hugging Face forward pass is a few hundred small torch calls, and each gives the
GIL up and must wait to take it back while another thread holds it (up to the interpreter's switch
interval, 5 ms by default). Measured on the project's 2-core machine, one question took 19 ms to
embed alone and about 1 s next to a busy Python thread; traced, the transformer, the mean pooling
and the normalisation run in one call that holds no GIL, and the same question took 29-64 ms next
to the busy thread.

Only the shape the default model has is traced: a BERT-style encoder taking ``input_ids``,
``attention_mask`` and ``token_type_ids``, then mean pooling, then (optionally) normalisation. Any
other pipeline returns None and the caller keeps sentence-transformers' own ``encode``. The traced
module is checked against ``encode`` on probe sentences (padded and unpadded batches, one over the
length limit) before it is used; a difference over :data:`TOLERANCE` means it is not used.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Sequence
from typing import Any

import numpy as np

log = logging.getLogger(__name__)

#: largest absolute difference per vector component allowed between the traced and the eager path
TOLERANCE = 1e-4

#: sentences of different lengths for tracing and the self-check (the last one is truncated)
PROBES = (
    "How do I reset my card PIN?",
    "Why was I charged twice for the same purchase at the supermarket yesterday evening?",
    "refund",
    "My transfer to a friend has been pending for three days, what is going on with it?",
    " ".join(["Please explain every fee on my statement"] * 40),  # past 256 tokens: truncated
    "",
)


class TracedEncoder:
    """Embeds with a traced forward pass; build it with :func:`trace_encoder`."""

    def __init__(self, st_model: Any, module: Any, batch_size: int) -> None:
        self._st = st_model
        self._module = module
        self.batch_size = batch_size

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """Unit vectors of ``texts`` (n, dim) float32, in input order; longest texts are batched
        together (sentence-transformers' order), ``batch_size`` per forward pass."""
        import torch

        order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
        out: list[np.ndarray] = [np.empty(0, dtype=np.float32)] * len(texts)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            features = _features(self._st, [texts[i] for i in chunk])
            with torch.inference_mode():
                vecs = self._module(
                    features["input_ids"], features["attention_mask"], features["token_type_ids"]
                ).numpy()
            for row, i in enumerate(chunk):
                out[i] = vecs[row]
        return np.asarray(out, dtype=np.float32)


def trace_encoder(st_model: Any, batch_size: int) -> TracedEncoder | None:
    """A :class:`TracedEncoder` for ``st_model`` (a loaded ``SentenceTransformer`` on the CPU), or
    None when its pipeline is not the traced shape, tracing fails, or the traced vectors differ
    from ``encode``'s."""
    try:
        module = _trace(st_model)
    except _Unsupported as exc:
        log.info("embedder not traced (%s): sentence-transformers' encode is used", exc)
        return None
    except Exception as exc:  # a model the tracer cannot follow: the eager path still works
        log.warning(
            "tracing the embedder failed (%s: %s): sentence-transformers' encode is used",
            type(exc).__name__,
            exc,
        )
        return None
    traced = TracedEncoder(st_model, module, batch_size)
    # the reference one text at a time (no padding, and the long probe costs one 256-token pass, not
    # six); the traced module on the short probes as one padded batch, and on the long one alone
    long_probes = [p for p in PROBES if len(p) > 200]
    short = [p for p in PROBES if len(p) <= 200]
    eager = st_model.encode(
        short + long_probes,
        batch_size=1,
        convert_to_numpy=True,
        normalize_embeddings=True,
        show_progress_bar=False,
    )
    got = np.concatenate([traced.encode(short), traced.encode(long_probes)])
    worst = float(np.abs(got - eager).max())
    if worst > TOLERANCE:
        log.warning(
            "the traced embedder differs from encode by %.2g (limit %.0e): not used", worst, TOLERANCE
        )
        return None
    return traced


class _Unsupported(Exception):
    pass


def _features(st_model: Any, texts: list[str]) -> Any:
    """The model's input tensors for ``texts``, as ``encode`` builds them (whitespace stripped,
    truncated at the model's length): ``preprocess`` since sentence-transformers 6, ``tokenize``
    before."""
    build = getattr(st_model, "preprocess", None) or st_model.tokenize
    return build(texts)


def _trace(st_model: Any) -> Any:
    import torch

    modules = list(st_model)
    kinds = [type(m).__name__ for m in modules]
    if kinds not in (["Transformer", "Pooling"], ["Transformer", "Pooling", "Normalize"]):
        raise _Unsupported(f"pipeline {kinds}")
    if str(st_model.device) != "cpu":
        raise _Unsupported(f"device {st_model.device}")
    pooling = modules[1].get_config_dict()
    if pooling.get("pooling_mode") != "mean" or not pooling.get("include_prompt", True):
        raise _Unsupported(f"pooling {pooling}")
    tokenizer = modules[0].tokenizer
    if list(tokenizer.model_input_names) != ["input_ids", "token_type_ids", "attention_mask"]:
        raise _Unsupported(f"model inputs {tokenizer.model_input_names}")
    encoder = modules[0].auto_model.eval()

    class MeanPooled(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.encoder = encoder

        def forward(self, ids: torch.Tensor, mask: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
            hidden = self.encoder(
                input_ids=ids, attention_mask=mask, token_type_ids=types, return_dict=False
            )[0]
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            mean = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
            return torch.nn.functional.normalize(mean, dim=1)

    # traced on a padded batch, so the attention mask is part of the graph
    example = _features(st_model, list(PROBES[:3]))
    with warnings.catch_warnings(), torch.inference_mode():
        warnings.simplefilter("ignore")
        return torch.jit.trace(
            MeanPooled(),
            (example["input_ids"], example["attention_mask"], example["token_type_ids"]),
            check_trace=False,
            strict=False,
        )
