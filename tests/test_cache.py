"""Unit tests of pipeline.cache.AnswerCache over a plain dict (the store a GlobalTable stands in for)."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from pipeline.cache import AnswerCache, CachedAnswer
from pipeline.pairs import Verdict

SCOPE_A = "scope-a"
SCOPE_B = "scope-b"


class Clock:
    """A settable millisecond clock."""

    def __init__(self, now_ms: float = 1_000_000.0) -> None:
        self.now_ms = now_ms

    def __call__(self) -> float:
        return self.now_ms

    def advance(self, ms: float) -> None:
        self.now_ms += ms


def unit(*xs: float) -> np.ndarray:
    v = np.asarray(xs, dtype=np.float32)
    return v / np.linalg.norm(v)


E1, E2, E3, E4 = (unit(*row) for row in np.eye(4))


class Cosine:
    """Cosine at least ``threshold``, nothing else: these tests' texts are placeholders, so the guard of
    the real decisions (tested in tests/test_pairs.py) stays out of the way."""

    name = "cosine"

    def __init__(self, threshold: float) -> None:
        self.cosine_floor = threshold

    def decide(self, a: str, b: str, cosine: float | None) -> Verdict:
        ok = cosine is not None and cosine >= self.cosine_floor
        return Verdict(ok, cosine or 0.0, cosine or 0.0, "cosine")


def search(
    cache: AnswerCache, scope: str, vector: np.ndarray, threshold: float
) -> tuple[CachedAnswer, float] | None:
    """The semantic lookup inference makes for a request with no exact hit, then the store clean-up it
    schedules on the event loop (expired entries the lookup met)."""
    hit = cache.lookup("no-exact-hit", scope, vector, "a probe question", Cosine(threshold))
    cache.drop_expired()
    return hit


def answer(
    key: str, *, clock: Clock, scope: str = SCOPE_A, vector: np.ndarray | None = None, text: str = ""
) -> CachedAnswer:
    return CachedAnswer(
        answer=f"answer {key}",
        finish_reason="stop",
        model_version="m1",
        created_ms=clock(),
        scope=scope,
        text=text or f"question {key}",
        request_id=f"req-{key}",
        vector=vector.tolist() if vector is not None else None,
    )


def make(
    ttl_s: float = 60.0, max_entries: int = 100, store: dict | None = None
) -> tuple[AnswerCache, dict, Clock]:
    clock = Clock()
    store = {} if store is None else store
    return AnswerCache(store, ttl_s=ttl_s, max_entries=max_entries, clock_ms=clock), store, clock


# ---- exact layer and TTL --------------------------------------------------------------------------
def test_put_then_get_exact_returns_the_entry() -> None:
    cache, store, clock = make()
    entry = answer("k1", clock=clock, vector=E1)
    cache.put("k1", entry)
    assert cache.get_exact("k1") == entry
    assert store["k1"] == entry.to_dict()
    assert cache.get_exact("missing") is None
    assert CachedAnswer.from_dict(entry.to_dict()) == entry


def test_to_dict_holds_every_field_as_asdict_does_with_the_vector_packed() -> None:
    clock = Clock()
    for entry in (answer("v", clock=clock, vector=E1), answer("none", clock=clock)):
        d = entry.to_dict()
        plain = dataclasses.asdict(entry)
        vector = plain.pop("vector")
        assert {k: v for k, v in d.items() if k != "vector_f32"} == plain
        assert ("vector_f32" in d) == (vector is not None)
    remembered = answer("r", clock=clock, vector=E2).remembered_as("another question", 0.91, SCOPE_A)
    assert remembered is not None
    assert remembered.to_dict() == {k: v for k, v in dataclasses.asdict(remembered).items() if k != "vector"}


def test_a_stored_vector_is_exact_and_a_quarter_of_the_json_list() -> None:
    """Every answer a worker stores goes through JSON three times (the write, its changelog record read
    back, each cache hit): the 384 floats of a MiniLM vector as base64 of their float32 bytes."""
    rng = np.random.default_rng(7)
    vec = rng.standard_normal(384).astype(np.float32)
    entry = answer("big", clock=Clock(), vector=vec / np.linalg.norm(vec))
    d = entry.to_dict()
    packed = json.dumps(d)
    as_list = json.dumps({**dataclasses.asdict(entry)})
    assert len(packed) * 3 < len(as_list)
    back = CachedAnswer.from_dict(json.loads(packed))
    assert back == entry and back.vector == entry.vector  # bit for bit


def test_a_record_written_with_the_vector_as_a_list_is_still_read() -> None:
    """Answers stored before vectors were packed stay in the changelog until they expire."""
    clock = Clock()
    entry = answer("old", clock=clock, vector=E1)
    old_record = dataclasses.asdict(entry)
    assert CachedAnswer.from_dict(old_record) == entry
    cache, store, _ = make()
    store["old"] = old_record
    assert cache.learn("old", old_record) is True
    assert cache.sync() == 0  # indexed by learn: not counted again
    hit = search(cache, SCOPE_A, E1, 0.99)
    assert hit is not None and hit[0] == entry


@pytest.mark.parametrize("packed", ["not base64!", "AAA=", 12, ["1.0"]])
def test_a_malformed_packed_vector_is_not_learned(packed: object) -> None:
    cache, _, clock = make()
    record = {**answer("bad", clock=clock).to_dict(), "vector_f32": packed}
    assert cache.learn("bad", record) is False
    with pytest.raises(ValueError):
        CachedAnswer.from_dict(record)


def test_entries_expire_after_ttl_and_are_removed() -> None:
    cache, store, clock = make(ttl_s=10.0)
    cache.put("k1", answer("k1", clock=clock, vector=E1))
    clock.advance(9_999)
    assert cache.get_exact("k1") is not None
    clock.advance(1)  # exactly ttl old: expired
    assert cache.get_exact("k1") is None
    assert "k1" not in store
    assert len(cache) == 0
    # and it is gone from the semantic index too
    assert cache.index is not None and (SCOPE_A, "k1") not in cache.index
    assert search(cache, SCOPE_A, E1, 0.5) is None


def test_ttl_counts_from_the_entry_not_from_the_last_read() -> None:
    cache, _, clock = make(ttl_s=10.0)
    cache.put("k1", answer("k1", clock=clock))
    for _ in range(3):
        clock.advance(3_000)
        assert cache.get_exact("k1") is not None
    clock.advance(1_000)  # 10 s after creation
    assert cache.get_exact("k1") is None


# ---- LRU ------------------------------------------------------------------------------------------
def test_lru_evicts_the_oldest_beyond_max_entries() -> None:
    cache, store, clock = make(max_entries=3)
    for k in ["a", "b", "c", "d", "e"]:
        cache.put(k, answer(k, clock=clock))
        assert len(cache) <= 3 and len(store) <= 3
    assert sorted(store) == ["c", "d", "e"]
    assert cache.get_exact("a") is None and cache.get_exact("b") is None


def test_get_exact_touches_recency() -> None:
    cache, store, clock = make(max_entries=3)
    for k in ["a", "b", "c"]:
        cache.put(k, answer(k, clock=clock))
    assert cache.get_exact("a") is not None  # a becomes the most recent; b is now the oldest
    cache.put("d", answer("d", clock=clock))
    assert sorted(store) == ["a", "c", "d"]
    cache.put("e", answer("e", clock=clock))
    assert sorted(store) == ["a", "d", "e"]


def test_semantic_hit_touches_recency() -> None:
    cache, store, clock = make(max_entries=2)
    cache.put("a", answer("a", clock=clock, vector=E1))
    cache.put("b", answer("b", clock=clock, vector=E2))
    assert search(cache, SCOPE_A, E1, 0.9) is not None
    cache.put("c", answer("c", clock=clock, vector=E3))
    assert sorted(store) == ["a", "c"]


def test_evicted_entries_leave_the_semantic_index() -> None:
    cache, _, clock = make(max_entries=2)
    cache.put("a", answer("a", clock=clock, vector=E1))
    cache.put("b", answer("b", clock=clock, vector=E2))
    cache.put("c", answer("c", clock=clock, scope=SCOPE_B, vector=E3))
    assert search(cache, SCOPE_A, E1, 0.5) is None
    assert cache.index is not None and len(cache.index) == 2
    assert (SCOPE_A, "a") not in cache.index


def test_a_cache_of_one_entry_replaces_it() -> None:
    cache, store, clock = make(max_entries=1)
    cache.put("a", answer("a", clock=clock, vector=E1))
    cache.put("b", answer("b", clock=clock, vector=E2))  # evicts a, in the store and the index
    assert sorted(store) == ["b"]
    hit = search(cache, SCOPE_A, E2, 0.9)
    assert hit is not None and hit[0].request_id == "req-b"
    assert search(cache, SCOPE_A, E1, 0.9) is None


# ---- semantic layer -------------------------------------------------------------------------------
def test_search_returns_the_best_match_above_the_threshold() -> None:
    cache, _, clock = make()
    near = unit(1.0, 0.2, 0.0, 0.0)
    nearer = unit(1.0, 0.05, 0.0, 0.0)
    cache.put("near", answer("near", clock=clock, vector=near))
    cache.put("nearer", answer("nearer", clock=clock, vector=nearer))
    cache.put("far", answer("far", clock=clock, vector=E2))
    hit = search(cache, SCOPE_A, E1, 0.9)
    assert hit is not None
    entry, sim = hit
    assert entry.request_id == "req-nearer"
    assert sim == pytest.approx(float(nearer @ E1), abs=1e-5)
    assert search(cache, SCOPE_A, E1, 0.9999) is None  # nothing that close
    assert search(cache, SCOPE_A, E4, 0.5) is None


def test_search_is_scoped() -> None:
    cache, _, clock = make()
    cache.put("in-b", answer("in-b", clock=clock, scope=SCOPE_B, vector=E1))
    assert search(cache, SCOPE_A, E1, 0.5) is None
    cache.put("in-a", answer("in-a", clock=clock, scope=SCOPE_A, vector=unit(1.0, 0.3, 0.0, 0.0)))
    hit = search(cache, SCOPE_A, E1, 0.5)
    assert hit is not None and hit[0].request_id == "req-in-a" and hit[1] < 0.99
    hit_b = search(cache, SCOPE_B, E1, 0.5)
    assert hit_b is not None and hit_b[0].request_id == "req-in-b" and hit_b[1] == pytest.approx(1.0)


def test_search_on_an_empty_cache_and_vectorless_entries() -> None:
    cache, _, clock = make()
    assert search(cache, SCOPE_A, E1, 0.1) is None
    cache.put("plain", answer("plain", clock=clock))  # not embeddable: exact layer only
    assert cache.get_exact("plain") is not None
    assert search(cache, SCOPE_A, E1, 0.0) is None


def test_search_skips_an_expired_best_match_for_a_fresh_one() -> None:
    cache, _, clock = make(ttl_s=10.0)
    cache.put("old", answer("old", clock=clock, vector=E1))
    clock.advance(5_000)
    cache.put("new", answer("new", clock=clock, vector=unit(1.0, 0.2, 0.0, 0.0)))
    clock.advance(6_000)  # old has expired, new has not
    hit = search(cache, SCOPE_A, E1, 0.9)
    assert hit is not None and hit[0].request_id == "req-new"


def test_search_ignores_an_entry_another_worker_deleted() -> None:
    cache, store, clock = make()
    cache.put("best", answer("best", clock=clock, vector=E1))
    cache.put("good", answer("good", clock=clock, vector=unit(1.0, 0.2, 0.0, 0.0)))
    del store["best"]  # evicted by another worker: the shared table no longer holds it
    for _ in range(2):
        hit = search(cache, SCOPE_A, E1, 0.9)
        assert hit is not None and hit[0].request_id == "req-good"


# ---- sync: entries written by other workers -------------------------------------------------------
def test_sync_indexes_entries_other_workers_wrote() -> None:
    shared: dict = {}
    mine, _, clock = make(store=shared)
    other_clock = Clock(clock())
    other = AnswerCache(shared, ttl_s=60.0, max_entries=100, clock_ms=other_clock)
    other.put("theirs", answer("theirs", clock=other_clock, vector=E2))
    # written straight into the shared dict, as a changelog update would appear
    shared["raw"] = answer("raw", clock=clock, vector=E3).to_dict()

    assert search(mine, SCOPE_A, E2, 0.9) is None  # not indexed here yet
    assert mine.get_exact("theirs") is not None  # but the exact layer reads the store directly
    assert mine.sync() == 2
    hit = search(mine, SCOPE_A, E2, 0.9)
    assert hit is not None and hit[0].request_id == "req-theirs"
    hit = search(mine, SCOPE_A, E3, 0.9)
    assert hit is not None and hit[0].request_id == "req-raw"
    assert mine.sync() == 0  # nothing new the second time


def test_sync_skips_expired_entries() -> None:
    cache, store, clock = make(ttl_s=10.0)
    store["stale"] = answer("stale", clock=clock, vector=E1).to_dict()
    clock.advance(10_000)
    store["fresh"] = answer("fresh", clock=clock, vector=E2).to_dict()
    assert cache.sync() == 1
    assert search(cache, SCOPE_A, E1, 0.9) is None
    assert search(cache, SCOPE_A, E2, 0.9) is not None


def test_synced_entries_are_evicted_before_ones_this_worker_used() -> None:
    cache, store, clock = make(max_entries=2)
    cache.put("mine", answer("mine", clock=clock, vector=E1))
    store["theirs"] = answer("theirs", clock=clock, vector=E2).to_dict()
    assert cache.sync() == 1
    cache.put("next", answer("next", clock=clock, vector=E3))
    assert sorted(store) == ["mine", "next"]


def test_sync_counts_a_vectorless_entry_once() -> None:
    cache, store, clock = make()
    store["zh"] = answer("zh", clock=clock, text="怎么给卡充值").to_dict()  # not embeddable: no vector
    assert cache.sync() == 1
    assert cache.sync() == 0


def test_sync_keeps_the_recency_of_a_vectorless_entry_this_worker_used() -> None:
    cache, store, clock = make(max_entries=2)
    cache.put("zh", answer("zh", clock=clock, text="怎么给卡充值"))  # no vector
    cache.put("en", answer("en", clock=clock, vector=E1))
    assert cache.get_exact("zh") is not None  # zh is now the most recently used
    cache.sync()  # the periodic timer: nothing new in the store
    cache.put("next", answer("next", clock=clock, vector=E2))
    assert sorted(store) == ["next", "zh"]  # en was least recently used


def test_an_entry_kept_by_the_lru_stays_searchable() -> None:
    cache, store, clock = make(max_entries=2)
    cache.put("a", answer("a", clock=clock, vector=E1))
    cache.put("b", answer("b", clock=clock, vector=E2))
    assert cache.get_exact("a") is not None  # an exact hit: b is now least recently used
    cache.put("c", answer("c", clock=clock, vector=E3))
    assert sorted(store) == ["a", "c"]
    hit = search(cache, SCOPE_A, E1, 0.9)  # a is still cached, so it must still be found
    assert hit is not None and hit[0].request_id == "req-a"


# ---- lookups off the event loop (the inference agent runs them in its embedding thread) ------------
def test_lookup_prefers_the_exact_answer_then_the_decision() -> None:
    from pipeline.pairs import ThresholdDecision

    cache, _, clock = make()
    cache.put("a", answer("a", clock=clock, vector=E1, text="how do I reset my card pin"))
    hit = cache.lookup("a", SCOPE_A, E2, "unrelated", ThresholdDecision(0.9))
    assert hit is not None and hit[0].request_id == "req-a" and hit[1] == 1.0
    near = unit(1.0, 0.05, 0.0, 0.0)
    hit = cache.lookup(
        "other-key", SCOPE_A, near, "how do I reset my card pin please", ThresholdDecision(0.9)
    )
    assert hit is not None and hit[0].request_id == "req-a" and hit[1] > 0.99
    assert cache.lookup("other-key", SCOPE_A, near, "how do I reset my card pin please", None) is None
    assert (
        cache.lookup("other-key", SCOPE_B, near, "how do I reset my card pin please", ThresholdDecision(0.9))
        is None
    )


def test_a_lookup_never_writes_the_store_and_expired_entries_are_dropped_later() -> None:
    from pipeline.pairs import ThresholdDecision

    cache, store, clock = make(ttl_s=1.0)
    cache.put("a", answer("a", clock=clock, vector=E1, text="how do I reset my card pin"))
    clock.advance(2_000)
    assert cache.lookup("a", SCOPE_A, E1, "how do I reset my card pin", ThresholdDecision(0.9)) is None
    assert "a" in store, "a lookup (in a worker thread) must not write the store"
    assert len(cache) == 0 and cache.index is not None and cache.index.size(SCOPE_A) == 0
    assert cache.drop_expired() == 1
    assert "a" not in store
    assert cache.drop_expired() == 0


def test_lookups_in_a_thread_while_the_loop_writes() -> None:
    """A thread searching while another stores, learns and evicts: no error, every hit is a real
    entry of the scope asked (the lock keeps the index consistent)."""
    import threading

    from pipeline.pairs import ThresholdDecision

    cache, _, clock = make(max_entries=64)
    rng = np.random.default_rng(7)
    vecs = rng.normal(size=(400, 4)).astype(np.float32)
    errors: list[BaseException] = []
    stop = threading.Event()

    def search() -> None:
        try:
            i = 0
            while not stop.is_set():
                v = vecs[i % len(vecs)]
                hit = cache.lookup(
                    f"k{i}", SCOPE_A, v / np.linalg.norm(v), f"question k{i}", ThresholdDecision(0.5)
                )
                assert hit is None or hit[0].scope == SCOPE_A
                i += 1
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=search)
    t.start()
    try:
        for i, v in enumerate(vecs):
            scope = SCOPE_A if i % 2 else SCOPE_B
            cache.put(f"p{i}", answer(f"p{i}", clock=clock, scope=scope, vector=v / np.linalg.norm(v)))
            cache.learn(
                f"l{i}", answer(f"l{i}", clock=clock, scope=scope, vector=v / np.linalg.norm(v)).to_dict()
            )
    finally:
        stop.set()
        t.join(10)
    assert not errors, errors
    assert len(cache) <= 64


def test_many_small_scopes_cost_about_their_vectors() -> None:
    """Each conversation context or tenant is a scope: one answer per scope must not pre-allocate a
    block of rows (a stream of unique system prompts would otherwise grow a worker several-fold)."""
    from pipeline.dedup import SemanticIndex

    idx = SemanticIndex(dim=384, max_per_scope=10_000)
    rng = np.random.default_rng(1)
    for i in range(2_000):
        idx.add(f"scope-{i}", f"k{i}", rng.normal(size=384).astype(np.float32))
    held = sum(m.nbytes for m in idx._matrix.values())
    assert held == 2_000 * 384 * 4


# ---- remembered merges ----------------------------------------------------------------------------
def test_a_remembered_merge_is_found_by_its_exact_key_with_the_merge_it_records() -> None:
    cache, store, clock = make(ttl_s=10.0)
    leader = answer("a", clock=clock, vector=E1, text="How do I reset my card PIN?")
    cache.put("a", leader)
    clock.advance(4_000)
    follower = leader.remembered_as("Hi, how can I reset the PIN of my card?", 0.93, SCOPE_A)
    assert follower is not None and follower.remembered
    assert (follower.answer, follower.request_id, follower.created_ms) == (
        leader.answer,
        "req-a",
        leader.created_ms,
    ), "the answer of the leader's model call, expiring with it"
    cache.put("f", follower)
    hit = cache.get_exact("f")
    assert hit is not None and hit.request_id == "req-a" and hit.similarity == 0.93
    found = cache.lookup("f", SCOPE_A, None, "Hi, how can I reset the PIN of my card?", None)
    assert found is not None and found[1] == 0.93, "an exact hit on a remembered merge keeps its similarity"
    clock.advance(7_000)
    assert cache.get_exact("f") is None and "f" not in store, "a remembered merge expires with its answer"


class Anything:
    """Merges every candidate it is shown: what a lookup finds is what the indexes hold."""

    name = "anything"
    cosine_floor = -1.0

    def decide(self, a: str, b: str, cosine: float | None) -> Verdict:
        return Verdict(True, 1.0, cosine or 0.0, "anything")


def test_a_remembered_merge_is_never_indexed_so_merges_do_not_chain() -> None:
    cache, store, clock = make()
    leader = answer("a", clock=clock, vector=E1, text="How do I reset my card PIN?")
    cache.put("a", leader)
    remembered = leader.remembered_as("我的银行卡密码怎么重置", 0.9, SCOPE_A)  # the lexical index reads it
    assert remembered is not None
    cache.put("f", remembered)
    assert cache.index is not None and cache.index.size(SCOPE_A) == 1
    assert cache.lookup("x", SCOPE_A, None, "我的银行卡密码怎么重置呢", Anything()) is None
    other, _, _ = make(store=store)
    assert other.learn("f", store["f"]) is False, "another worker does not index it either"
    other.sync()
    assert other.index is not None and other.index.size(SCOPE_A) == 1
    assert other.lookup("x", SCOPE_A, None, "我的银行卡密码怎么重置呢", Anything()) is None


def test_what_is_not_remembered() -> None:
    _, _, clock = make()
    leader = answer("a", clock=clock, text="How do I reset my card PIN?")
    assert leader.remembered_as("how do i reset my card pin", 1.0, SCOPE_A) is None, "the leader's own key"
    assert leader.remembered_as("Hi, how can I reset my PIN?", 0.95, SCOPE_B) is None, (
        "an answer made under other parameters (a leader degraded after its followers joined)"
    )
    assert leader.remembered_as("Hi, how can I reset my PIN?", 0.95, SCOPE_A) is not None


def test_a_scope_without_chinese_questions_skips_the_lexical_search(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only Chinese questions are found by their characters; where a scope has none cached, a lookup
    does not read the question's language at all (a seventh of an English lookup's time)."""
    import pipeline.cache as cache_module
    from pipeline.pairs import ThresholdDecision

    cache, _, clock = make()
    cache.put("a", answer("a", clock=clock, vector=E1, text="how do I reset my card pin"))
    read: list[str] = []
    real = cache_module.lexical_keys

    def counting(text: str) -> frozenset[str]:
        read.append(text)
        return real(text)

    monkeypatch.setattr(cache_module, "lexical_keys", counting)
    near = unit(1.0, 0.05, 0.0, 0.0)
    hit = cache.lookup("b", SCOPE_A, near, "how do I reset my card pin please", ThresholdDecision(0.9))
    assert hit is not None and hit[0].request_id == "req-a"
    assert read == [], "no Chinese question in the scope: its characters are never read"
    cache.put("zh", answer("zh", clock=clock, text="我的卡丢了怎么办"))
    read.clear()
    hit = cache.lookup("c", SCOPE_A, None, "我的卡丢了怎么办呢", ThresholdDecision(0.9))
    assert read == ["我的卡丢了怎么办呢"], "with one cached, they are"


class _CountingStore(dict):  # type: ignore[type-arg]
    """A store that counts its reads (a RocksDB read and a JSON record each, in a worker)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def get(self, key: str, default: object = None) -> object:  # type: ignore[override]
        self.reads.append(key)
        return super().get(key, default)


def test_a_semantic_lookup_reads_the_store_for_the_chosen_question_only() -> None:
    """The merge decision reads the questions kept in memory; the store is read for the best-ranked
    candidate, and for the next when that one expired meanwhile."""
    from pipeline.pairs import ThresholdDecision

    texts = [
        "reset my card pin please",
        "reset my card pin now",
        "can you reset my card pin",
        "reset the card pin",
    ]
    store = _CountingStore()
    clock = Clock()
    cache = AnswerCache(store, ttl_s=60.0, max_entries=100, clock_ms=clock)
    for k, (x, y) in enumerate([(1.0, 0.02), (1.0, 0.04), (1.0, 0.06), (1.0, 0.08)]):
        cache.put(f"k{k}", answer(f"k{k}", clock=clock, vector=unit(x, y, 0.0, 0.0), text=texts[k]))
    store.reads.clear()
    hit = cache.lookup("new", SCOPE_A, unit(1.0, 0.0, 0.0, 0.0), "reset my card pin", ThresholdDecision(0.9))
    assert hit is not None and hit[0].request_id == "req-k0", "the most similar question"
    assert store.reads == ["new", "k0"], "the exact key, then the chosen candidate: no other read"
    del store["k0"]  # another worker's deletion, not yet learned
    store.reads.clear()
    hit = cache.lookup("new", SCOPE_A, unit(1.0, 0.0, 0.0, 0.0), "reset my card pin", ThresholdDecision(0.9))
    assert hit is not None and hit[0].request_id == "req-k1", "the next best when the best went"
    assert store.reads == ["new", "k0", "k1"]
    assert cache.index is not None and "k0" not in {
        k for k, _ in cache.index.candidates(SCOPE_A, unit(1.0, 0.0, 0.0, 0.0), 0.5, 10)
    }
