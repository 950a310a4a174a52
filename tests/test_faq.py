"""The FAQ answerer, loaded from the committed weights with the real MiniLM embedder."""

from __future__ import annotations

import json
import math
import re
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest

import models.faq as faq_module
from models.base import ChatMessage, ModelInput
from models.exceptions import ModelLoadError
from models.faq import DATA_DIR, INTENTS_FILE, NOT_SURE_ANSWER, WEIGHTS_FILE, FAQAnswerer, load_model
from models.faq_train import evaluate, read_rows, split_banking77

BANKING77_CSV = Path(__file__).resolve().parents[2] / "shared" / "data" / "banking77" / "train.csv"


def ask(text: str, logprobs: bool = False) -> ModelInput:
    return ModelInput(messages=(ChatMessage("user", text),), logprobs=logprobs)


@pytest.fixture(scope="module")
def faq() -> FAQAnswerer:
    answerer = FAQAnswerer()
    answerer.load()
    return answerer


def test_intents_file_covers_every_label_with_own_examples(faq: FAQAnswerer) -> None:
    entries = json.loads((DATA_DIR / INTENTS_FILE).read_text(encoding="utf-8"))
    assert sorted(e["intent"] for e in entries) == sorted(faq.labels)
    assert len(faq.labels) == 77
    for e in entries:
        assert 2 <= len(e["examples"]) <= 3, e["intent"]
        assert 1 <= len(re.findall(r"[.!?](?:\s|$)", e["answer"])) <= 3, e["intent"]


def test_version_is_derived_from_the_weights(faq: FAQAnswerer) -> None:
    assert re.fullmatch(r"faq-[0-9a-f]{8}", faq.version)
    assert FAQAnswerer().version != faq.version  # unloaded answerers carry no weights version


@pytest.mark.parametrize(
    ("question", "intent"),
    [
        ("Somebody grabbed my purse with my Surge card inside it", "lost_or_stolen_card"),
        ("Three attempts with the wrong code and now my PIN won't work at all", "pin_blocked"),
        ("The hole in the wall machine kept my card and didn't give it back", "card_swallowed"),
        ("How old must someone be before they can get an account?", "age_limit"),
        ("Can I pay with my phone using Google's wallet?", "apple_pay_or_google_pay"),
        ("I'd like to close everything and leave the bank", "terminate_account"),
        ("The same taxi ride shows up twice on my statement", "transaction_charged_twice"),
    ],
)
def test_own_questions_map_to_the_right_intent(faq: FAQAnswerer, question: str, intent: str) -> None:
    [(predicted, confidence)] = faq.classify([question])
    assert predicted == intent, (predicted, confidence)
    assert confidence >= faq.confidence_floor


def test_infer_answers_a_batch_in_order_with_intent_and_logprob(faq: FAQAnswerer) -> None:
    answers = {e["intent"]: e["answer"] for e in json.loads((DATA_DIR / INTENTS_FILE).read_text())}
    batch = [ask("How do I put my new card on Apple Pay?", logprobs=True), ask("When will my card get here?")]
    first, second = faq.infer(batch)
    assert first.extra["intent"] == "apple_pay_or_google_pay"
    assert first.answer == answers["apple_pay_or_google_pay"]
    assert first.finish_reason == "stop"
    assert first.logprobs == [pytest.approx(math.log(float(first.extra["confidence"])))]
    assert second.extra["intent"] in {"card_arrival", "card_delivery_estimate"}
    assert second.logprobs is None


def test_below_the_floor_the_answerer_says_it_is_not_sure() -> None:
    unsure = FAQAnswerer(embedder=None, confidence_floor=0.999)
    unsure.load()
    [out] = unsure.infer([ask("Which planet has the most moons?")])
    assert out.extra["intent"] is None
    assert float(out.extra["confidence"]) < 0.999
    assert out.answer == NOT_SURE_ANSWER
    assert "rephrase" in out.answer and "support" in out.answer


def test_off_topic_and_chinese_questions_fall_below_the_default_floor(faq: FAQAnswerer) -> None:
    results = faq.classify(["What's a good recipe for lemon cake?", "今天天气怎么样？"])
    assert [intent for intent, _ in results] == [None, None], results


def test_template_answer_is_the_same_answer_marked_template(faq: FAQAnswerer) -> None:
    inp = ask("My card was stolen yesterday, what should I do?", logprobs=True)
    [normal] = faq.infer([inp])
    template = faq.template_answer(inp)
    assert template.finish_reason == "template"
    assert template.answer == normal.answer
    assert template.extra["intent"] == normal.extra["intent"] == "lost_or_stolen_card"


def test_weights_load_without_pickle() -> None:
    with np.load(DATA_DIR / WEIGHTS_FILE, allow_pickle=False) as npz:
        assert all(npz[name].dtype != object for name in npz.files)
        assert npz["weight"].shape[1] == 77
    total = sum(p.stat().st_size for p in DATA_DIR.iterdir())
    assert total < 20 * 1024 * 1024


def test_missing_weights_raise_a_load_error_naming_the_command(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="surge faq train"):
        FAQAnswerer(data_dir=tmp_path).load()


@pytest.mark.skipif(not BANKING77_CSV.is_file(), reason=f"banking77 CSV not present at {BANKING77_CSV}")
def test_split_banking77_is_deterministic_stratified_and_disjoint() -> None:
    train_a, held_a = split_banking77(BANKING77_CSV)
    train_b, held_b = split_banking77(BANKING77_CSV)
    assert (train_a, held_a) == (train_b, held_b)
    all_rows = read_rows(BANKING77_CSV)
    assert sorted(train_a + held_a) == sorted(all_rows)  # a partition: nothing lost, nothing repeated
    assert not set(train_a) & set(held_a)
    assert 0.14 < len(held_a) / len(all_rows) < 0.16
    per_label = Counter(c for _, c in all_rows)
    held_per_label = Counter(c for _, c in held_a)
    assert set(held_per_label) == set(per_label)
    assert all(abs(held_per_label[c] - 0.15 * n) <= 1 for c, n in per_label.items())
    _, held_other = split_banking77(BANKING77_CSV, seed=78)
    assert held_other != held_a


def test_evaluate_reports_accuracy_on_a_csv(faq: FAQAnswerer, tmp_path: Path) -> None:
    csv_path = tmp_path / "mine.csv"
    csv_path.write_text(
        "text,category\n"
        "Where in the app can I change my home address?,edit_personal_details\n"
        "Is my Surge card on the Visa network?,visa_or_mastercard\n"
        "Where in the app can I change my home address?,age_limit\n",
        encoding="utf-8",
    )
    report = evaluate(csv_path, faq)
    assert report["n"] == 3
    assert report["n_correct"] == 2
    assert report["accuracy"] == pytest.approx(2 / 3, abs=1e-4)


def test_the_worker_embeds_each_request_once_with_the_default_settings() -> None:
    """What ``surge worker`` builds with SURGE_MODEL=faq and no SURGE_EMBEDDER_PATH: the pipeline's
    embedder and the answerer's are one object, so the answerer takes the pipeline's vectors (issue
    found under load: ``shared_embedder()`` and ``shared_embedder(None)`` were two MiniLM copies, and
    every request was embedded twice)."""
    from models.embedder import default_embedder_path, shared_embedder
    from models.registry import build_model
    from pipeline.settings import Settings

    s = Settings.load(model="faq")
    assert s.embedder_path is None
    model = build_model(s)
    model.load()
    pipeline_embedder = shared_embedder(s.embedder_path)  # as agents/worker.py asks for it
    assert pipeline_embedder is shared_embedder() is shared_embedder(default_embedder_path())
    assert model.accepts_vectors_from(pipeline_embedder)

    # a batch that carries the pipeline's vectors is classified without embedding again
    calls: list[int] = []
    embed = pipeline_embedder.embed

    def counting(texts: list[str]) -> np.ndarray:
        calls.append(len(texts))
        return embed(texts)

    questions = ["how do I activate my new card", "my card payment was declined"]
    vectors = embed(questions)
    pipeline_embedder.embed = counting  # type: ignore[method-assign]
    try:
        given = [
            ModelInput((ChatMessage("user", q),), vector=v) for q, v in zip(questions, vectors, strict=True)
        ]
        with_vectors = model.infer(given)
        assert calls == []
        without = model.infer([ModelInput((ChatMessage("user", q),)) for q in questions])
        assert calls == [2]
    finally:
        del pipeline_embedder.embed
    assert [o.answer for o in with_vectors] == [o.answer for o in without]


class CountingEmbedder:
    """The real shared embedder, counting the questions it is asked to embed."""

    def __init__(self) -> None:
        from models.embedder import shared_embedder

        self.inner = shared_embedder()
        self.dim = self.inner.dim
        self.multilingual = self.inner.multilingual
        self.embedded = 0

    def embed(self, texts: list[str]) -> np.ndarray:
        self.embedded += len(texts)
        return self.inner.embed(texts)


LEXICAL_CASES = [
    ("Three attempts with the wrong code and now my PIN won't work at all", "pin_blocked"),
    ("The hole in the wall machine kept my card and didn't give it back", "card_swallowed"),
    ("How old must someone be before they can get an account?", "age_limit"),
    ("I'd like to close everything and leave the bank", "terminate_account"),
    ("The same taxi ride shows up twice on my statement", "transaction_charged_twice"),
    ("How do I top up my account with my debit card?", "topping_up_by_card"),
]


def test_the_template_answers_from_ngrams_without_an_embedding() -> None:
    """Level 3's template must cost no MiniLM call, or degradation sheds nothing on the default path."""
    counting = CountingEmbedder()
    faq = FAQAnswerer(embedder=counting)  # type: ignore[arg-type]
    faq.load()
    assert faq.template_needs_vectors() is False
    outs = faq.template_answers(
        [ask(q) for q, _ in LEXICAL_CASES] + [ask("What's a good recipe for lemon cake?")]
    )
    assert counting.embedded == 0
    assert [o.extra["intent"] for o in outs] == [intent for _, intent in LEXICAL_CASES] + [None]
    assert all(o.finish_reason == "template" for o in outs)
    assert outs[-1].answer == NOT_SURE_ANSWER


def test_a_repeated_question_gets_its_template_from_the_memo_with_the_same_answer() -> None:
    """Level 3 templates every batch and offline request on the intake's event loop, where the same
    questions come again and again: a repeat is looked up, not classified again, and a batch's
    answers are the ones each question gets alone."""
    faq = FAQAnswerer(embedder=CountingEmbedder())  # type: ignore[arg-type]
    faq.load()
    model = faq._loaded()
    calls: list[int] = []
    real = model.lexical_probabilities

    def counting(texts: Sequence[str]) -> np.ndarray:
        calls.append(len(texts))
        return real(texts)

    object.__setattr__(model, "lexical_probabilities", counting)
    questions = [q for q, _ in LEXICAL_CASES]
    first = faq.template_answers([ask(q) for q in questions])
    assert len(calls) == len(questions)
    again = faq.template_answers([ask(q) for q in reversed(questions)])
    assert len(calls) == len(questions), "every repeat answered from the memo"
    assert [o.extra for o in again] == [o.extra for o in reversed(first)]
    assert [o.answer for o in again] == [o.answer for o in reversed(first)]
    assert [o.extra["intent"] for o in first] == [intent for _, intent in LEXICAL_CASES]
    alone = [real([q])[0] for q in questions]
    assert [o.extra["confidence"] for o in first] == [float(p.max()) for p in alone]
    assert faq.template_memo.cache_info().hits == len(questions)


def test_the_template_uses_the_pipelines_vectors_when_every_input_has_one(faq: FAQAnswerer) -> None:
    """An item re-planned to level 3 after it was embedded keeps the whole classifier's answer."""
    from models.embedder import shared_embedder

    questions = ["Somebody grabbed my purse with my Surge card inside it", "Where is my card?"]
    vectors = shared_embedder().embed(questions)
    given = [
        ModelInput(messages=(ChatMessage("user", q),), vector=v)
        for q, v in zip(questions, vectors, strict=True)
    ]
    templates = faq.template_answers(given)
    assert [t.extra["intent"] for t in templates] == [
        o.extra["intent"] for o in faq.infer([ask(q) for q in questions])
    ]
    assert (
        templates[0].extra["intent"] == "lost_or_stolen_card"
    )  # the n-grams alone fall below the floor here


def test_weights_without_a_lexical_layer_load_and_their_template_embeds(tmp_path: Path) -> None:
    """Weights trained before the lexical layer existed still serve: their template embeds as before."""
    from dataclasses import replace

    from models.faq import load_model

    replace(load_model(DATA_DIR), lexical_weight=None, lexical_bias=None).save(tmp_path)
    (tmp_path / INTENTS_FILE).write_bytes((DATA_DIR / INTENTS_FILE).read_bytes())
    counting = CountingEmbedder()
    old = FAQAnswerer(tmp_path, embedder=counting)  # type: ignore[arg-type]
    old.load()
    assert old.template_needs_vectors() is True
    [out] = old.template_answers([ask("My card was stolen yesterday, what should I do?")])
    assert counting.embedded == 1
    assert out.extra["intent"] == "lost_or_stolen_card" and out.finish_reason == "template"


def test_a_lexical_layer_of_the_wrong_shape_is_refused(tmp_path: Path) -> None:
    from dataclasses import replace

    from models.faq import load_model

    model = load_model(DATA_DIR)
    assert model.lexical_weight is not None
    replace(model, lexical_weight=model.lexical_weight[:-3]).save(tmp_path)
    with pytest.raises(ModelLoadError, match="lexical layer is inconsistent"):
        load_model(tmp_path)


def test_training_fits_the_lexical_layer_and_saves_it(tmp_path: Path) -> None:
    """``surge faq train`` writes the template's layer with the model (on the project's own examples)."""
    from models.embedder import shared_embedder
    from models.faq import load_model
    from models.faq_train import Candidate, fit_model, intent_examples

    rows = intent_examples()
    texts, labels = [t for t, _ in rows], [c for _, c in rows]
    fit_model(texts, labels, shared_embedder().embed(texts), Candidate(30.0)).save(tmp_path)
    model = load_model(tmp_path)
    assert model.has_lexical
    predicted = np.asarray(model.labels)[model.lexical_probabilities(texts).argmax(axis=1)]
    assert float(np.mean(predicted == np.asarray(labels))) >= 0.9  # it learnt its own rows from n-grams


def test_a_blocks_columns_are_its_ngrams_looked_up_with_each_words_kept() -> None:
    """``TfidfBlock.columns`` keeps each word's character n-gram columns: the same columns, in the
    same number, as looking up every n-gram of the text, for words seen before or not, long ones
    (not kept) and text that is no banking question; a full cache is emptied, not grown."""
    model = load_model(DATA_DIR)
    texts = [
        "Why was my top-up declined?? Order #48213",
        "why was my TOP-UP declined again",
        "Ünïcødé wörds and   tabs\tand\nnewlines, ticket 12",
        "x" * 500 + " card " + "y" * 41,
        "",
        "我的卡被吞了 card",
    ]
    for block in (model.word, model.char):
        for text in texts * 2:
            expected = [i for i in map(block.vocab.get, block.analyze(text)) if i is not None]
            assert Counter(block.columns(text)) == Counter(expected), (block.kind, text)
    kept = model.char._word_columns
    assert "card" in kept and "x" * 500 not in kept and "y" * 41 not in kept
    kept.update({f"w{i}": [] for i in range(faq_module.WORD_COLUMNS_WORDS - len(kept))})
    model.char.columns("one more word")
    assert len(kept) <= 3


def test_the_lexical_layer_gathers_what_the_sparse_product_computes() -> None:
    """``lexical_probabilities`` sums each question's weight rows itself (a third of the cost for the
    one question the intake templates at a time); it must be the sparse matrix product it replaced."""
    faq = FAQAnswerer(embedder=CountingEmbedder())  # type: ignore[arg-type]
    faq.load()
    model = faq._loaded()
    assert model.lexical_weight is not None and model.lexical_bias is not None
    texts = [q for q, _ in LEXICAL_CASES] + ["", "zzzz qqqq", "Card card CARD card!!", "我的卡丢了"]
    logits = np.asarray(model.lexical_features(texts) @ model.lexical_weight) + model.lexical_bias
    expected = np.exp(logits - logits.max(axis=1, keepdims=True))
    expected /= expected.sum(axis=1, keepdims=True)
    got = model.lexical_probabilities(texts)
    assert got.shape == expected.shape
    np.testing.assert_allclose(got, expected, atol=1e-5)
    assert [model.lexical_probabilities([t])[0].argmax() for t in texts] == list(expected.argmax(axis=1))


# ---- training and evaluation input ----------------------------------------------------------------
class _NeverEmbeds:
    """An embedder that fails the test if training got as far as embedding."""

    def embed(self, texts: object) -> np.ndarray:
        raise AssertionError("the file was read as valid and embedded")


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (None, "cannot be read"),
        (b"question,label\nhi,greet\n", "needs the columns text,category"),
        ("text,category\ncaf\u00e9 card,card\n".encode("latin-1"), "is not UTF-8"),
        (b"text,category\n", "holds no rows"),
        (b"text,category\nhello,\n", "line 2: empty text or category"),
        (b"text,category\n" + b"".join(b"q %d,only_one\n" % i for i in range(40)), "1 intents"),
        (
            b"text,category\n"
            + b"".join(b"q %d,big\n" % i for i in range(40))
            + b"".join(b"r %d,tiny\n" % i for i in range(3)),
            "too few: tiny",
        ),
    ],
)
def test_training_refuses_a_file_it_cannot_learn_from_before_it_embeds(
    tmp_path: Path, content: bytes | None, problem: str
) -> None:
    """A 12-row file once trained, reported 1.0 accuracy on its two held-out rows and wrote weights
    whose accuracy on real questions fell from 0.99 to 0.29; bad files failed with tracebacks
    after the embedder loaded."""
    from models.exceptions import FAQDataError
    from models.faq_train import train

    path = tmp_path / "rows.csv"
    if content is not None:
        path.write_bytes(content)
    out = tmp_path / "weights"
    with pytest.raises(FAQDataError, match=re.escape(problem)):
        train(path, out, embedder=_NeverEmbeds())  # type: ignore[arg-type]
    assert not out.exists(), "nothing is written for a file that was refused"


def test_surge_faq_train_never_writes_the_shipped_weights_unless_told_to(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``surge faq train`` wrote into the package's own folder, which every worker loads."""
    from pipeline.cli import main

    before = {p.name: p.stat().st_mtime_ns for p in DATA_DIR.iterdir()}
    rows = tmp_path / "rows.csv"
    rows.write_text("text,category\n" + "".join(f"q {i},c{i % 2}\n" for i in range(40)), encoding="utf-8")
    assert main(["faq", "train", "--data", str(rows)]) == 2
    assert "--out-dir is required" in capsys.readouterr().err
    assert main(["faq", "eval", "--data", str(tmp_path / "missing.csv")]) == 2
    assert "missing.csv: cannot be read" in capsys.readouterr().err
    assert {p.name: p.stat().st_mtime_ns for p in DATA_DIR.iterdir()} == before


def test_workers_load_the_faq_weights_settings_name(tmp_path: Path) -> None:
    from models.registry import build_faq
    from pipeline.settings import Settings

    assert build_faq(Settings.load(faq_data_dir=str(tmp_path))).data_dir == tmp_path  # type: ignore[attr-defined]
    assert build_faq(Settings.load()).data_dir == DATA_DIR  # type: ignore[attr-defined]


def test_a_failed_save_leaves_the_old_weights_and_vocabulary_whole(tmp_path: Path) -> None:
    """The vocabulary was written first and the arrays after: a failure while saving the arrays
    left a new vocabulary beside the old weights, which load refused or misread."""
    from dataclasses import replace

    from models.faq import load_model

    model = load_model(DATA_DIR)
    model.save(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    # a new vocabulary (other labels) with arrays that cannot be saved
    broken = replace(model, labels=model.labels[::-1], bias=np.array(["not", "a", "number"], dtype=object))
    with pytest.raises(ValueError):
        broken.save(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before, "no new, half or stray file"
    assert load_model(tmp_path).labels == model.labels
