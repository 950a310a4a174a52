"""The traced embedder (models/traced_encoder.py): the same vectors as sentence-transformers' encode,
with the forward pass as one native call, and the eager path kept for any model it cannot trace."""

from __future__ import annotations

import sys
from collections.abc import Callable, Sequence

import numpy as np
import pytest
from sentence_transformers import SentenceTransformer
from sentence_transformers.models import Pooling, Transformer

from models import traced_encoder
from models.embedder import Embedder, shared_embedder

TEXTS = [
    "card lost",
    "  Why was I charged twice for the same coffee this morning at the station?  ",
    "",
    "我的卡丢了怎么办",
    "How long does a transfer to another bank take? " * 40,  # past the 256-token limit
    "pin?",
    "I moved abroad last month and my new address is not showing up in the app",
    "refund",
    "exchange rate today",
    "freeze card",
] * 2


def cpu_embedder() -> Embedder:
    """The shared embedder; the test is skipped where it runs on an accelerator (never traced there).
    On the CPU it is not skipped when tracing fails: the tests then fail, as they should."""
    emb = shared_embedder()
    if not str(emb._model.device).startswith("cpu"):
        pytest.skip("tracing is for the CPU")
    return emb


def eager(emb: Embedder, texts: Sequence[str]) -> np.ndarray:
    return np.asarray(
        emb._model.encode(
            list(texts), batch_size=emb.batch_size, normalize_embeddings=True, convert_to_numpy=True
        )
    )


def test_the_default_embedder_is_traced_and_gives_encodes_vectors() -> None:
    emb = cpu_embedder()
    assert emb.traced is not None
    got = emb.embed(TEXTS)
    assert got.shape == (len(TEXTS), emb.dim) and got.dtype == np.float32
    np.testing.assert_allclose(got, eager(emb, TEXTS), atol=1e-5)
    # one text alone (no padding) and in input order whatever the lengths
    np.testing.assert_allclose(emb.embed(TEXTS[3:4])[0], got[3], atol=1e-5)
    np.testing.assert_allclose(emb.embed(TEXTS[::-1]), got[::-1], atol=1e-5)
    assert emb.embed([]).shape == (0, emb.dim)


def python_calls(embed: Callable[[list[str]], object], texts: list[str]) -> int:
    """Python and C functions called from Python while ``embed`` runs: each call between torch's native
    operations is a point where an embedding thread gives up the GIL and waits to take it back while the
    event loop runs."""
    calls = 0

    def count(frame: object, event: str, arg: object) -> None:
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1

    sys.setprofile(count)
    try:
        embed(texts)
    finally:
        sys.setprofile(None)
    return calls


def test_the_forward_pass_is_one_native_call_not_hundreds_of_python_ones() -> None:
    emb = cpu_embedder()
    assert emb.traced is not None
    texts = [t for t in TEXTS if 0 < len(t) < 100][:9]
    emb.embed(texts)  # anything done once per process is not counted
    traced = python_calls(emb.embed, texts)
    eager_calls = python_calls(lambda t: eager(emb, t), texts)
    # measured: about 1,800 (the tokenizer's Python) against about 12,800
    assert traced * 4 < eager_calls, (traced, eager_calls)


def test_a_pipeline_of_another_shape_keeps_the_eager_path() -> None:
    path = shared_embedder().path
    body = Transformer(path)
    cls = SentenceTransformer(
        modules=[body, Pooling(body.get_embedding_dimension(), pooling_mode="cls")], device="cpu"
    )
    assert traced_encoder.trace_encoder(cls, 8) is None


def test_a_traced_module_that_differs_from_encode_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    emb = cpu_embedder()
    assert emb.traced is not None
    assert traced_encoder.trace_encoder(emb._model, 8) is not None
    monkeypatch.setattr(traced_encoder, "TOLERANCE", -1.0)  # any difference at all, even 0, is too much
    assert traced_encoder.trace_encoder(emb._model, 8) is None
