"""Unit tests of pipeline.merge.MergeRegistry: which open leader a new request may join."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.merge import MergeRegistry

REALTIME, INTERACTIVE, BATCH, OFFLINE = range(4)
S1, S2 = "scope-1", "scope-2"


def unit(*xs: float) -> np.ndarray:
    v = np.asarray(xs, dtype=np.float32)
    return v / np.linalg.norm(v)


V = unit(1.0, 0.0, 0.0, 0.0)
CLOSE = unit(1.0, 0.25, 0.0, 0.0)  # cosine with V ~ 0.970
CLOSER = unit(1.0, 0.1, 0.0, 0.0)  # cosine with V ~ 0.995
FAR = unit(1.0, 1.0, 0.0, 0.0)  # cosine with V ~ 0.707


@pytest.fixture
def reg() -> MergeRegistry:
    return MergeRegistry(threshold=0.9)


def test_empty_registry_finds_nothing(reg: MergeRegistry) -> None:
    assert reg.find(S1, "how do I top up my card", V, INTERACTIVE) is None
    assert len(reg) == 0


def test_exact_normalised_text_joins_with_similarity_one(reg: MergeRegistry) -> None:
    leader = reg.open("r1", S1, "How do I top up my card?", V, INTERACTIVE)
    found = reg.find(S1, "  hello, how do I TOP UP my card  ", None, INTERACTIVE)
    assert found is not None
    assert found[0] is leader and found[1] == 1.0
    # an exact match needs no vector, and does not depend on the threshold
    strict = MergeRegistry(threshold=1.0)
    strict.open("r1", S1, "How do I top up my card?", None, INTERACTIVE)
    assert strict.find(S1, "how do i top up my card", None, INTERACTIVE) is not None


def test_similar_vectors_at_or_above_threshold_join(reg: MergeRegistry) -> None:
    reg.open("r1", S1, "how do I top up my card", V, INTERACTIVE)
    found = reg.find(S1, "how can I put money on my card", CLOSE, INTERACTIVE)
    assert found is not None
    assert found[0].leader_id == "r1"
    assert found[1] == pytest.approx(float(V @ CLOSE), abs=1e-6)
    at = MergeRegistry(threshold=float(V @ CLOSE))
    at.open("r1", S1, "how do I top up my card", V, INTERACTIVE)
    assert at.find(S1, "how can I put money on my card", CLOSE, INTERACTIVE) is not None


def test_below_threshold_does_not_join(reg: MergeRegistry) -> None:
    reg.open("r1", S1, "how do I top up my card", V, INTERACTIVE)
    assert reg.find(S1, "what is the exchange rate today", FAR, INTERACTIVE) is None


def test_without_vectors_only_exact_text_joins(reg: MergeRegistry) -> None:
    reg.open("r1", S1, "how do I top up my card", None, INTERACTIVE)
    assert reg.find(S1, "how can I put money on my card", CLOSE, INTERACTIVE) is None
    reg.open("r2", S1, "where is my card", V, INTERACTIVE)
    assert reg.find(S1, "where did my card go", None, INTERACTIVE) is None


def test_the_most_similar_leader_is_chosen(reg: MergeRegistry) -> None:
    reg.open("close", S1, "how do I top up my card", CLOSE, INTERACTIVE)
    reg.open("closer", S1, "how to top up the card", CLOSER, INTERACTIVE)
    found = reg.find(S1, "how can I put money on my card", V, INTERACTIVE)
    assert found is not None and found[0].leader_id == "closer"


def test_guard_veto_prevents_joining_identical_vectors(reg: MergeRegistry) -> None:
    reg.open("r1", S1, "lock my card", V, INTERACTIVE)
    assert reg.find(S1, "unlock my card", V, INTERACTIVE) is None
    # a vetoed candidate does not hide an allowed one in the same scope
    reg.open("r2", S1, "please unlock my card now", CLOSE, INTERACTIVE)
    found = reg.find(S1, "unlock my card", V, INTERACTIVE)
    assert found is not None and found[0].leader_id == "r2"


def test_guard_veto_on_differing_amounts(reg: MergeRegistry) -> None:
    reg.open("r1", S1, "send 50 euros to my savings", V, INTERACTIVE)
    assert reg.find(S1, "send 500 euros to my savings", V, INTERACTIVE) is None


@pytest.mark.parametrize("leader_rank", [INTERACTIVE, BATCH, OFFLINE])
def test_realtime_never_joins_a_less_urgent_leader(reg: MergeRegistry, leader_rank: int) -> None:
    reg.open("slow", S1, "how do I top up my card", V, leader_rank)
    assert reg.find(S1, "how do I top up my card", V, REALTIME) is None  # not even an exact match
    assert reg.find(S1, "how can I put money on my card", CLOSE, REALTIME) is None


@pytest.mark.parametrize("follower_rank", [REALTIME, INTERACTIVE, BATCH, OFFLINE])
def test_a_request_joins_a_leader_at_least_as_urgent(reg: MergeRegistry, follower_rank: int) -> None:
    reg.open("fast", S1, "how do I top up my card", V, REALTIME)
    found = reg.find(S1, "how can I put money on my card", CLOSE, follower_rank)
    assert found is not None and found[0].leader_id == "fast"


def test_a_less_urgent_exact_leader_does_not_hide_an_urgent_similar_one(reg: MergeRegistry) -> None:
    reg.open("batch", S1, "how do I top up my card", V, BATCH)
    reg.open("rt", S1, "how to top up the card", CLOSER, REALTIME)
    found = reg.find(S1, "how do I top up my card", V, REALTIME)
    assert found is not None and found[0].leader_id == "rt"


def test_scopes_isolate(reg: MergeRegistry) -> None:
    reg.open("r1", S1, "how do I top up my card", V, INTERACTIVE)
    assert reg.find(S2, "how do I top up my card", V, INTERACTIVE) is None
    reg.open("r2", S2, "how do I top up my card", V, INTERACTIVE)
    found = reg.find(S2, "how do I top up my card", V, INTERACTIVE)
    assert found is not None and found[0].leader_id == "r2"


def test_close_returns_followers_and_removes_the_leader(reg: MergeRegistry) -> None:
    leader = reg.open("r1", S1, "how do I top up my card", V, INTERACTIVE)
    reg.open("r2", S1, "where is my card", FAR, INTERACTIVE)
    for item, text, vec in [("f1", "how do I top up my card", None), ("f2", "put money on my card", CLOSE)]:
        found = reg.find(S1, text, vec, INTERACTIVE)
        assert found is not None and found[0] is leader
        found[0].followers.append((item, found[1]))
    assert reg.get("r1") is leader and len(reg) == 2 and reg.followers() == 2
    followers = reg.close("r1")
    assert [f for f, _ in followers] == ["f1", "f2"]
    assert followers[0][1] == 1.0 and followers[1][1] == pytest.approx(float(V @ CLOSE), abs=1e-6)
    assert reg.get("r1") is None and len(reg) == 1 and reg.followers() == 0
    assert reg.find(S1, "how do I top up my card", V, INTERACTIVE) is None
    assert reg.close("r1") == []  # closing twice is harmless
    assert reg.close("never-opened") == []
    assert reg.close("r2") == [] and len(reg) == 0


def test_reopening_an_id_then_closing_it_leaves_the_scope_usable(reg: MergeRegistry) -> None:
    # the same request_id opened twice (a client re-sends it at a more urgent priority, which may
    # not join the first copy) and then closed must not leave a dangling id behind
    reg.open("r1", S1, "how do I top up my card", V, BATCH)
    reg.open("r1", S1, "how do I top up my card", V, REALTIME)
    reg.close("r1")
    assert reg.find(S1, "how do I top up my card", V, OFFLINE) is None
    assert len(reg) == 0
