"""The default answer model: a banking FAQ answerer for the fictional "Surge Bank".

A question is embedded with the shared MiniLM :class:`~models.embedder.Embedder`, joined with word and
character n-gram TF-IDF features, and scored by one linear layer (a matrix multiply) over the 77
banking intents; those probabilities are blended with a nearest-neighbour vote over the training
questions' embeddings (a second matrix multiply). The most likely intent's canned answer (``faq_data/intents.json``, written for this
project) is the reply; below ``confidence_floor`` the answerer says it did not understand.

The template of degradation level 3 is a second linear layer over the n-grams alone, with no
embedding: a few points less accurate, a thousandth of the cost, so that level sheds MiniLM
(docs/architecture.md, "Degradation").

Weights are trained by :func:`models.faq_train.train` (``surge faq train``) and stored without pickle:
``faq_weights.npz`` (float arrays) and ``faq_vocab.json`` (labels, n-gram vocabularies, settings).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy import sparse

from models.base import ModelBackend, ModelInput, ModelOutput
from models.embedder import Embedder, shared_embedder
from models.exceptions import ModelError, ModelLoadError
from pipeline.atomic import npz_bytes, replace_files
from pipeline.textcache import TextCache

DATA_DIR = Path(__file__).resolve().parent / "faq_data"
WEIGHTS_FILE = "faq_weights.npz"
VOCAB_FILE = "faq_vocab.json"
INTENTS_FILE = "intents.json"

NOT_SURE_ANSWER = (
    "I'm not sure I understood your question. Could you rephrase it in a few words, for example "
    "'my card has not arrived'? If it is urgent, please contact Surge Bank support through the chat "
    "in the app."
)

#: Measured on the banking77 held-out split (1,498 questions) with the shipped weights: 2.3% of
#: answers fall below 0.40 (accuracy above it 95.3%, against 94.3% overall); 0.45 would refuse 3.6%.
#: Off-topic English and Chinese questions tried by hand scored 0.12-0.30.
DEFAULT_CONFIDENCE_FLOOR = 0.40
#: The same for the level-3 template's lexical layer (n-grams alone), whose probabilities are flatter:
#: on the held-out split 2.6 % of its answers fall below 0.25 (accuracy above it 93.4 %, against 91.7 %
#: overall; 0.40 would refuse 6.6 %); the off-topic questions tried by hand scored 0.04-0.14.
DEFAULT_TEMPLATE_CONFIDENCE_FLOOR = 0.25
#: how many texts' template intents (the lexical layer's answer) one answerer remembers, and the bytes
#: they may hold: level 3 answers every batch and offline request from it on the intake's event loop,
#: where the same questions come again and again (docs/architecture.md, "Degradation")
TEMPLATE_MEMO_TEXTS = 4096
TEMPLATE_MEMO_BYTES = 4 << 20
#: how many words' character n-gram columns a TF-IDF block keeps (:meth:`TfidfBlock.columns`), and
#: the longest word it keeps them for (a longer one is computed each time)
WORD_COLUMNS_WORDS = 50_000
WORD_COLUMNS_MAX_CHARS = 40

_WORD_RE = re.compile(r"(?u)\b\w\w+\b")


def word_ngrams(text: str, n_max: int = 2) -> list[str]:
    """Lower-cased word unigrams .. ``n_max``-grams of ``text``."""
    words = _WORD_RE.findall(text.lower())
    grams = list(words)
    for n in range(2, n_max + 1):
        grams.extend(" ".join(words[i : i + n]) for i in range(len(words) - n + 1))
    return grams


def char_ngrams(text: str, n_min: int = 1, n_max: int = 4) -> list[str]:
    """Character n-grams inside word boundaries (each word padded with one space on each side)."""
    grams: list[str] = []
    for word in text.lower().split():
        padded = f" {word} "
        size = len(padded)
        for n in range(n_min, min(n_max, size) + 1):
            grams += [padded[i : i + n] for i in range(size - n + 1)]
    return grams


@dataclass(frozen=True)
class TfidfBlock:
    """One TF-IDF feature block: a vocabulary and its inverse document frequencies.

    ``fit`` is called by training; ``transform`` by training and at every inference.
    Term frequency is sublinear (``1 + ln(count)``); each row is L2-normalised.
    """

    kind: str  # "word" or "char"
    vocab: dict[str, int]
    idf: np.ndarray
    #: a "char" block's vocabulary columns of each word's n-grams (n-grams never cross a word), for the
    #: words met lately: questions share most of their words, and the n-grams and their lookups were
    #: a third of the level-3 template's cost on the intake's event loop
    _word_columns: dict[str, list[int]] = field(default_factory=dict, compare=False, repr=False)

    def analyze(self, text: str) -> list[str]:
        return word_ngrams(text) if self.kind == "word" else char_ngrams(text)

    def columns(self, text: str) -> list[int]:
        """The vocabulary columns of ``text``'s n-grams in the vocabulary, one per occurrence: what
        :meth:`row` counts (the same as looking up :meth:`analyze`'s n-grams)."""
        vocab = self.vocab
        if self.kind == "word":
            return [i for i in map(vocab.get, word_ngrams(text)) if i is not None]
        cache = self._word_columns
        out: list[int] = []
        for word in text.lower().split():
            cols = cache.get(word)
            if cols is None:
                cols = [i for i in map(vocab.get, char_ngrams(word)) if i is not None]
                if len(word) <= WORD_COLUMNS_MAX_CHARS:
                    if len(cache) >= WORD_COLUMNS_WORDS:
                        cache.clear()  # hostile text cannot grow it: at most this many words
                    cache[word] = cols
            out += cols
        return out

    @classmethod
    def fit(cls, kind: str, texts: Iterable[str], min_df: int = 2) -> TfidfBlock:
        """Count document frequencies over ``texts`` and keep terms seen in at least ``min_df`` of them."""
        block = cls(kind, {}, np.zeros(0, dtype=np.float32))
        df: Counter[str] = Counter()
        n_docs = 0
        for text in texts:
            df.update(set(block.analyze(text)))
            n_docs += 1
        terms = sorted(t for t, c in df.items() if c >= min_df)
        idf = np.array([math.log((1 + n_docs) / (1 + df[t])) + 1.0 for t in terms], dtype=np.float32)
        return cls(kind, {t: i for i, t in enumerate(terms)}, idf)

    def row(self, text: str) -> tuple[np.ndarray, np.ndarray]:
        """One text's L2-normalised TF-IDF row: its columns (ascending, int64) and their values
        (float32)."""
        counts = Counter(self.columns(text))  # n-grams outside the vocabulary left out
        cols = np.fromiter(counts.keys(), dtype=np.int64, count=len(counts))
        tf = np.fromiter(counts.values(), dtype=np.float64, count=len(counts))
        order = np.argsort(cols)
        cols, tf = cols[order], tf[order]
        vals = (1.0 + np.log(tf)).astype(np.float32) * self.idf[cols]  # sublinear tf, float32 as trained
        norm = float(np.linalg.norm(vals)) if len(cols) else 0.0
        return cols, (vals / norm if norm > 0 else vals)

    def transform(self, texts: Sequence[str]) -> sparse.csr_matrix:
        """An (n, len(vocab)) sparse float32 matrix of L2-normalised TF-IDF rows."""
        rows = [self.row(text) for text in texts]
        indptr = np.cumsum([0, *(len(cols) for cols, _ in rows)])
        indices = np.concatenate([cols for cols, _ in rows] or [np.zeros(0, dtype=np.int64)])
        data = np.concatenate([vals for _, vals in rows] or [np.zeros(0, dtype=np.float32)])
        return sparse.csr_matrix((data, indices, indptr), shape=(len(texts), len(self.vocab)))

    def terms(self) -> list[str]:
        """The vocabulary in column order (what the vocabulary JSON stores)."""
        out = [""] * len(self.vocab)
        for term, i in self.vocab.items():
            out[i] = term
        return out


@dataclass(frozen=True)
class Blend:
    """How the nearest-neighbour vote joins the linear layer: ``(1 - weight) * p_linear + weight * p_knn``,
    where ``p_knn`` weighs each of the ``k`` most similar training questions by
    ``exp((cosine - 1) / temperature)``."""

    k: int = 5
    temperature: float = 0.05
    weight: float = 0.0


def _softmax(logits: np.ndarray) -> np.ndarray:
    logits = logits - logits.max(axis=1, keepdims=True)
    exp = np.exp(logits)
    return exp / exp.sum(axis=1, keepdims=True)


@dataclass(frozen=True)
class FAQModel:
    """The trained classifier: features ``[embedding * emb_scale | word TF-IDF | char TF-IDF]``, one
    linear layer, blended with a k-nearest-neighbour vote over ``knn_vectors`` (unit embeddings of the
    training questions, labelled by ``knn_labels``). Built by training or by :func:`load_model`;
    :meth:`probabilities` is the whole inference after embedding."""

    labels: list[str]
    word: TfidfBlock
    char: TfidfBlock
    emb_scale: float
    weight: np.ndarray  # (emb_dim + n_word + n_char, n_labels) float32
    bias: np.ndarray  # (n_labels,) float32
    knn_vectors: np.ndarray  # (n_examples, emb_dim) float32, unit rows
    knn_labels: np.ndarray  # (n_examples,) int: column in ``labels``
    blend: Blend = Blend()
    #: the level-3 template's own linear layer over ``[word TF-IDF | char TF-IDF]`` alone (no embedding),
    #: (n_word + n_char, n_labels) float32, and its bias; None in weights trained before it existed
    lexical_weight: np.ndarray | None = None
    lexical_bias: np.ndarray | None = None

    def features(self, texts: Sequence[str], embeddings: np.ndarray) -> sparse.csr_matrix:
        """The feature rows of ``texts`` given their (n, dim) unit embeddings."""
        return sparse.hstack(
            [
                sparse.csr_matrix(embeddings.astype(np.float32) * self.emb_scale),
                self.word.transform(texts),
                self.char.transform(texts),
            ],
            format="csr",
        )

    def lexical_features(self, texts: Sequence[str]) -> sparse.csr_matrix:
        """The n-gram rows of ``texts`` alone: what the lexical layer reads."""
        return sparse.hstack([self.word.transform(texts), self.char.transform(texts)], format="csr")

    def linear_probabilities(self, texts: Sequence[str], embeddings: np.ndarray) -> np.ndarray:
        """Softmax of the linear layer: an (n, n_labels) float array."""
        return _softmax(np.asarray(self.features(texts, embeddings) @ self.weight) + self.bias)

    @property
    def has_lexical(self) -> bool:
        """Whether these weights carry the lexical layer (the level-3 template without an embedding)."""
        return self.lexical_weight is not None and self.lexical_bias is not None

    def lexical_probabilities(self, texts: Sequence[str]) -> np.ndarray:
        """Probabilities from the n-grams alone, no embedding: about a thousandth of MiniLM's cost per
        question, a few points less accurate (the training report's ``template_accuracy``)."""
        if self.lexical_weight is None or self.lexical_bias is None:
            raise ModelError("these FAQ weights have no lexical layer; retrain with `surge faq train`")
        # each row's few hundred weight rows gathered and summed: the same product as the sparse
        # matrix's, without building one (a third of the cost for one question, which the intake
        # answers at level 3 on its own event loop; docs/architecture.md, "Degradation")
        weight, n_word = self.lexical_weight, len(self.word.vocab)
        logits = np.empty((len(texts), weight.shape[1]), dtype=np.float32)
        for i, text in enumerate(texts):
            word_cols, word_vals = self.word.row(text)
            char_cols, char_vals = self.char.row(text)
            logits[i] = word_vals @ weight[word_cols] + char_vals @ weight[n_word + char_cols]
        return _softmax(logits + self.lexical_bias)

    def knn_probabilities(self, embeddings: np.ndarray, k: int, temperature: float) -> np.ndarray:
        """The similarity-weighted vote of the ``k`` nearest training questions: (n, n_labels)."""
        n = embeddings.shape[0]
        votes = np.zeros((n, len(self.labels)), dtype=np.float64)
        k = min(k, self.knn_vectors.shape[0])
        if n == 0 or k == 0:
            return votes
        sims = embeddings.astype(np.float32) @ self.knn_vectors.T
        top = np.argpartition(-sims, k - 1, axis=1)[:, :k]
        weights = np.exp((np.take_along_axis(sims, top, axis=1) - 1.0) / temperature)
        np.add.at(votes, (np.repeat(np.arange(n), k), self.knn_labels[top].ravel()), weights.ravel())
        return votes / np.maximum(votes.sum(axis=1, keepdims=True), 1e-30)

    @staticmethod
    def blended(linear: np.ndarray, knn: np.ndarray, weight: float) -> np.ndarray:
        """``(1 - weight) * linear + weight * knn``: still a probability distribution per row."""
        return (1.0 - weight) * linear + weight * knn if weight > 0 else linear

    def probabilities(self, texts: Sequence[str], embeddings: np.ndarray) -> np.ndarray:
        """Probabilities over intents: an (n, n_labels) float array."""
        linear = self.linear_probabilities(texts, embeddings)
        if self.blend.weight <= 0:
            return linear
        knn = self.knn_probabilities(embeddings, self.blend.k, self.blend.temperature)
        return self.blended(linear, knn, self.blend.weight)

    def save(self, out_dir: Path) -> None:
        """Write ``faq_weights.npz`` (no pickled objects) and ``faq_vocab.json`` into ``out_dir``, each
        replaced whole (:func:`pipeline.atomic.replace_files`): a failed save leaves the old ones."""
        out_dir.mkdir(parents=True, exist_ok=True)
        vocab = {
            "format": 1,
            "labels": self.labels,
            "emb_scale": self.emb_scale,
            "emb_dim": int(self.weight.shape[0] - len(self.word.vocab) - len(self.char.vocab)),
            "word_terms": self.word.terms(),
            "char_terms": self.char.terms(),
            "knn_k": self.blend.k,
            "knn_temperature": self.blend.temperature,
            "knn_weight": self.blend.weight,
        }
        arrays: dict[str, np.ndarray] = {
            "weight": self.weight.astype(np.float16),
            "bias": self.bias.astype(np.float32),
            "word_idf": self.word.idf.astype(np.float32),
            "char_idf": self.char.idf.astype(np.float32),
            "knn_vectors": self.knn_vectors.astype(np.float16),
            "knn_labels": self.knn_labels.astype(np.int16),
        }
        if self.lexical_weight is not None and self.lexical_bias is not None:
            arrays["lexical_weight"] = self.lexical_weight.astype(np.float16)
            arrays["lexical_bias"] = self.lexical_bias.astype(np.float32)
        # atomically, the vocabulary last: a worker loading meanwhile reads the old pair or the new one
        replace_files(
            [
                (out_dir / WEIGHTS_FILE, npz_bytes(arrays)),
                (out_dir / VOCAB_FILE, json.dumps(vocab, ensure_ascii=False).encode("utf-8")),
            ]
        )


def load_model(data_dir: Path) -> FAQModel:
    """Read the weights and vocabulary written by :meth:`FAQModel.save`; ``ModelLoadError`` if absent."""
    weights_path, vocab_path = data_dir / WEIGHTS_FILE, data_dir / VOCAB_FILE
    missing = [str(p) for p in (weights_path, vocab_path) if not p.is_file()]
    if missing:
        raise ModelLoadError(
            f"FAQ answerer weights not found ({', '.join(missing)}); run `surge faq train` "
            "(models.faq_train.train) to create them"
        )
    try:
        vocab = json.loads(vocab_path.read_text(encoding="utf-8"))
        with np.load(weights_path, allow_pickle=False) as npz:
            arrays = {k: npz[k] for k in npz.files}
        word_terms, char_terms = vocab["word_terms"], vocab["char_terms"]
        word = TfidfBlock("word", {t: i for i, t in enumerate(word_terms)}, arrays["word_idf"])
        char = TfidfBlock("char", {t: i for i, t in enumerate(char_terms)}, arrays["char_idf"])
        weight = arrays["weight"].astype(np.float32)
        expected_rows = int(vocab["emb_dim"]) + len(word_terms) + len(char_terms)
        labels = list(vocab["labels"])
        blend = Blend(int(vocab["knn_k"]), float(vocab["knn_temperature"]), float(vocab["knn_weight"]))
        knn_vectors = arrays["knn_vectors"].astype(np.float32)
        knn_labels = arrays["knn_labels"].astype(np.int64)
        lexical_weight = arrays["lexical_weight"].astype(np.float32) if "lexical_weight" in arrays else None
        lexical_bias = arrays["lexical_bias"].astype(np.float32) if "lexical_bias" in arrays else None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"FAQ answerer weights in {data_dir} are unreadable: {exc}") from exc
    if weight.shape != (expected_rows, len(labels)):
        raise ModelLoadError(
            f"FAQ weight matrix has shape {weight.shape}, expected ({expected_rows}, {len(labels)}) "
            f"from {vocab_path.name}; retrain with `surge faq train`"
        )
    if knn_vectors.shape[0] != knn_labels.shape[0] or (len(knn_labels) and knn_labels.max() >= len(labels)):
        raise ModelLoadError(
            f"FAQ neighbour table is inconsistent: {knn_vectors.shape[0]} vectors, {knn_labels.shape[0]} "
            f"labels, {len(labels)} intents; retrain with `surge faq train`"
        )
    lexical_rows = len(word_terms) + len(char_terms)
    if (lexical_weight is None) != (lexical_bias is None) or (
        lexical_weight is not None and lexical_weight.shape != (lexical_rows, len(labels))
    ):
        raise ModelLoadError(
            f"FAQ lexical layer is inconsistent ({WEIGHTS_FILE}: weight "
            f"{None if lexical_weight is None else lexical_weight.shape}, expected ({lexical_rows}, "
            f"{len(labels)}) with a bias); retrain with `surge faq train`"
        )
    return FAQModel(
        labels,
        word,
        char,
        float(vocab["emb_scale"]),
        weight,
        arrays["bias"].astype(np.float32),
        knn_vectors,
        knn_labels,
        blend,
        lexical_weight,
        lexical_bias,
    )


def load_answers(path: Path) -> dict[str, str]:
    """Intent name -> canned answer, from ``intents.json``."""
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
        return {str(e["intent"]): str(e["answer"]) for e in entries}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"cannot read FAQ intents from {path}: {exc}") from exc


def weights_version(data_dir: Path) -> str:
    """``faq-`` and the first 8 hex digits of the SHA-256 of the weights and vocabulary files."""
    digest = hashlib.sha256()
    for name in (WEIGHTS_FILE, VOCAB_FILE):
        digest.update((data_dir / name).read_bytes())
    return "faq-" + digest.hexdigest()[:8]


class FAQAnswerer(ModelBackend):
    """Answers banking questions with the canned answer of the most likely intent."""

    name = "faq"
    version = "faq-unloaded"
    max_batch_size = 128

    def __init__(
        self,
        data_dir: str | Path | None = None,
        embedder: Embedder | None = None,
        confidence_floor: float = DEFAULT_CONFIDENCE_FLOOR,
        template_floor: float = DEFAULT_TEMPLATE_CONFIDENCE_FLOOR,
    ) -> None:
        for name, floor in (("confidence_floor", confidence_floor), ("template_floor", template_floor)):
            if not 0.0 <= floor < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {floor}")
        self.data_dir = Path(data_dir) if data_dir is not None else DATA_DIR
        self.confidence_floor = confidence_floor
        self.template_floor = template_floor
        self._embedder = embedder
        self._model: FAQModel | None = None
        self._answers: dict[str, str] = {}
        self._lock = threading.Lock()
        #: the lexical template's (intent, confidence) of each text seen lately: a pure function of the
        #: text and the loaded weights, so a repeat costs a lookup, not the n-grams and their gather
        self.template_memo: TextCache[tuple[str | None, float]] = TextCache(
            self._lexical_best, TEMPLATE_MEMO_TEXTS, TEMPLATE_MEMO_BYTES
        )

    def load(self) -> None:
        """Load the weights, the answers and (unless one was given) the shared embedder.

        Called once at worker start, off the event loop; ``infer`` calls it if nobody did.
        """
        with self._lock:
            if self._model is not None:
                return
            model = load_model(self.data_dir)
            intents_path = self.data_dir / INTENTS_FILE
            answers = load_answers(intents_path if intents_path.is_file() else DATA_DIR / INTENTS_FILE)
            missing = [label for label in model.labels if label not in answers]
            if missing:
                raise ModelLoadError(
                    f"{len(missing)} of {len(model.labels)} intents have no answer in {INTENTS_FILE}: "
                    f"{missing[:5]}"
                )
            if self._embedder is None:
                self._embedder = shared_embedder()
            self.version = weights_version(self.data_dir)
            self._answers = answers
            self._model = model
            self.template_memo.cache_clear()

    @property
    def labels(self) -> list[str]:
        """The intents this answerer knows, in weight-column order (after ``load``)."""
        return list(self._loaded().labels)

    def _loaded(self) -> FAQModel:
        if self._model is None:
            self.load()
        assert self._model is not None
        return self._model

    def probabilities(self, texts: Sequence[str], vectors: np.ndarray | None = None) -> np.ndarray:
        """(n, n_intents) probabilities; called by ``classify`` and by evaluation code. ``vectors``:
        the texts' embeddings when the caller has them (they are then not computed again)."""
        model = self._loaded()
        assert self._embedder is not None
        if not texts:
            return np.zeros((0, len(model.labels)), dtype=np.float32)
        if vectors is None:
            vectors = self._embedder.embed(texts)
        return model.probabilities(texts, vectors)

    def classify(
        self, texts: Sequence[str], vectors: np.ndarray | None = None
    ) -> list[tuple[str | None, float]]:
        """The most likely intent of each text and its probability; ``None`` below the floor."""
        return self._best(self._loaded(), self.probabilities(texts, vectors), self.confidence_floor)

    def _lexical_best(self, text: str) -> tuple[str | None, float]:
        """The lexical layer's intent (None under the template floor) and confidence for one text
        (rows are independent: the same as in a batch); what :attr:`template_memo` remembers."""
        model = self._loaded()
        return self._best(model, model.lexical_probabilities([text]), self.template_floor)[0]

    @staticmethod
    def _best(model: FAQModel, probs: np.ndarray, floor: float) -> list[tuple[str | None, float]]:
        out: list[tuple[str | None, float]] = []
        for row in probs:
            best = int(row.argmax())
            conf = float(row[best])
            out.append((model.labels[best] if conf >= floor else None, conf))
        return out

    def _output(self, intent: str | None, confidence: float, inp: ModelInput, finish: str) -> ModelOutput:
        answer = self._answers[intent] if intent is not None else NOT_SURE_ANSWER
        return ModelOutput(
            answer=answer,
            finish_reason=finish,
            logprobs=[math.log(max(confidence, 1e-12))] if inp.logprobs and finish == "stop" else None,
            extra={"intent": intent, "confidence": confidence},
        )

    def infer(self, batch: Sequence[ModelInput]) -> list[ModelOutput]:
        """Answer a micro-batch (called in a worker thread): one embedding call for the whole batch."""
        try:
            given = [inp.vector for inp in batch]
            vectors = np.stack(given).astype(np.float32) if all(v is not None for v in given) else None
            results = self.classify([inp.text for inp in batch], vectors)
        except ModelError:
            raise
        except Exception as exc:
            raise ModelError(f"FAQ answerer failed on a batch of {len(batch)}: {exc}") from exc
        return [
            self._output(intent, conf, inp, "stop")
            for (intent, conf), inp in zip(results, batch, strict=True)
        ]

    def peek_version(self) -> str:
        """The weights' version, from the files alone (no load)."""
        return weights_version(self.data_dir)

    def accepts_vectors_from(self, embedder: object) -> bool:
        """Vectors of the embedder this answerer classifies with stand in for its own embedding."""
        self._loaded()
        return embedder is self._embedder

    def template_answer(self, inp: ModelInput) -> ModelOutput:
        """The same canned answer, marked ``finish_reason="template"``; called under degradation level 3."""
        return self.template_answers([inp])[0]

    def template_needs_vectors(self) -> bool:
        """False with a lexical layer: the template then classifies by n-grams alone."""
        return not self._loaded().has_lexical

    def template_answers(self, batch: Sequence[ModelInput]) -> list[ModelOutput]:
        """Template answers for a batch, marked ``finish_reason="template"``: the whole classifier when
        the pipeline gave every input its vector (an item re-planned to level 3 after it was embedded),
        else the lexical layer, which needs no embedding (weights without one embed as the model
        does)."""
        if not batch:
            return []
        model = self._loaded()
        given = [inp.vector for inp in batch]
        texts = [inp.text for inp in batch]
        if all(v is not None for v in given):
            results = self.classify(texts, np.stack(given).astype(np.float32))
        elif model.has_lexical:
            results = [self.template_memo(text) for text in texts]
        else:
            results = self.classify(texts)
        return [
            self._output(intent, conf, inp, "template")
            for (intent, conf), inp in zip(results, batch, strict=True)
        ]
