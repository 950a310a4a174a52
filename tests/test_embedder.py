"""The sentence embedder: chunking changes the cost of a call, never its vectors."""

from __future__ import annotations

import numpy as np

from models.embedder import Embedder, shared_embedder

# questions of very different lengths, so one chunk of all of them pads the short ones a lot
QUESTIONS = [
    "card lost",
    "Why was I charged twice for the same coffee this morning at the station?",
    "pin?",
    "I moved abroad last month and my new address is not showing up in the app, what should I do now",
    "How long does a transfer to another bank take?",
    "refund",
    "Can I have a second card for my partner on the same account, and what would it cost me per year?",
    "exchange rate today",
    "My top-up by bank transfer has not arrived",
    "freeze card",
] * 3


def test_the_default_chunk_follows_the_device() -> None:
    """On CPU one large chunk costs 2.6x more per question than chunks of 8 (docs in Embedder); on an
    accelerator one large chunk is cheaper."""
    emb = shared_embedder()
    on_cpu = str(emb._model.device).startswith("cpu")
    expected = Embedder.CPU_BATCH_SIZE if on_cpu else Embedder.ACCELERATOR_BATCH_SIZE
    assert emb.batch_size == expected
    assert Embedder.CPU_BATCH_SIZE <= 16 < Embedder.ACCELERATOR_BATCH_SIZE


def test_chunking_leaves_the_vectors_unchanged() -> None:
    emb = shared_embedder()
    small = emb.embed(QUESTIONS)
    one_chunk = Embedder(emb.path, batch_size=len(QUESTIONS)).embed(QUESTIONS)
    alone = np.stack([emb.embed([q])[0] for q in QUESTIONS[:10]])
    assert small.shape == (len(QUESTIONS), emb.dim)
    np.testing.assert_allclose(small, one_chunk, atol=1e-5)
    np.testing.assert_allclose(small[:10], alone, atol=1e-5)
    assert np.allclose(np.linalg.norm(small, axis=1), 1.0, atol=1e-5)
