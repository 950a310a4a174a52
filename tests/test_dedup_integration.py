"""Semantic dedup and the answer cache on the real broker and the real RocksDB tables."""

from __future__ import annotations

import pytest

from tests.conftest import RELAXED, request

pytestmark = pytest.mark.integration

#: 10 questions, each asked 10 ways: light edits a person makes when asking again
QUESTIONS = [
    "How do I reset my online banking password",
    "Where can I see my card's expiry date",
    "What is the fee for an international transfer",
    "How long does it take to open a savings account",
    "Can I order a replacement card for my partner",
    "Why is there a hold on my deposit",
    "How do I set up a standing order",
    "What are your branch opening hours on Saturday",
    "How can I download last month's statement",
    "Is contactless payment available on my debit card",
]
EDITS = [
    lambda q: q,
    lambda q: q + "?",
    lambda q: q.lower(),
    lambda q: q.upper() + "?",
    lambda q: "Hi, " + q.lower() + "?",
    lambda q: q + ", please?",
    lambda q: "  " + q.replace(" ", "  ") + " ",
    lambda q: "Hello! " + q + "?",
    lambda q: q + ". Thanks!",
    lambda q: "Please tell me: " + q.lower(),
]


def model_items(metrics: str) -> float:
    """Items the worker sent to the model (sum of all batch sizes)."""
    for line in metrics.splitlines():
        if line.startswith("surge_batch_size_sum"):
            return float(line.split()[-1])
    raise AssertionError("surge_batch_size_sum not exported")


async def test_100_paraphrases_of_10_questions_cost_about_10_model_calls(deployment) -> None:
    # each question's paraphrases come 10, 20 ... records after it: with a 100 ms model a starved
    # intake (a loaded CI machine) read them after the answer, so all came from the cache and none
    # merged; 2 s keeps the leaders in flight while their paraphrases arrive
    d = deployment(model="echo", echo_delay_ms="2000", rate_limit_enabled="false", **RELAXED)
    w = d.worker()
    c = await d.client()
    futs = []
    for j, edit in enumerate(EDITS):
        for i, q in enumerate(QUESTIONS):
            futs.append(await c.submit(request(f"{i}-{j}", f"user-{(i * 7 + j) % 13}", edit(q))))
    await c.producer.flush()
    replies = await d.replies(futs, 90)
    assert sorted(r.request_id for r in replies) == sorted(f"r-{i}-{j}" for i in range(10) for j in range(10))
    assert all(r.status == "ok" for r in replies)
    calls = model_items(w.metrics())
    assert 10 <= calls <= 14, f"{calls} model items for 10 distinct questions"
    for r in replies:
        i = int(r.request_id.split("-")[1])
        assert QUESTIONS[i].lower() in (r.answer or "").lower().replace("  ", " "), (r.request_id, r.answer)
        if r.served_from == "merged":
            assert r.merged_into and r.merged_into.split("-")[1] == str(i) and r.similarity is not None
    served = {r.served_from for r in replies}
    assert "merged" in served


async def test_opposite_requests_are_never_merged(deployment) -> None:
    d = deployment(model="echo", echo_delay_ms="100", rate_limit_enabled="false", **RELAXED)
    w = d.worker()
    c = await d.client()
    pairs = [
        ("Please increase my card limit", "Please decrease my card limit"),
        ("Lock my debit card now", "Unlock my debit card now"),
        ("I did receive the refund", "I did not receive the refund"),
        ("Send 50 EUR to my landlord", "Send 500 EUR to my landlord"),
    ]
    futs = []
    for k, (a, b) in enumerate(pairs):
        futs.append(await c.submit(request(f"a{k}", "ann", a)))
        futs.append(await c.submit(request(f"b{k}", "ben", b)))
    await c.producer.flush()
    replies = await d.replies(futs, 60)
    assert all(r.served_from == "model" for r in replies), [(r.request_id, r.served_from) for r in replies]
    assert model_items(w.metrics()) == 8


async def test_cache_survives_a_worker_restart_and_never_crosses_tenants(deployment) -> None:
    d = deployment(model="echo", rate_limit_enabled="false", **RELAXED)
    w = d.worker()
    c = await d.client()
    first = await c.request(request("c1", "u1", "How do I order a new chequebook?", tenant="bank-a"), 60)
    assert first.served_from == "model"
    again = await c.request(request("c2", "u2", "how do I order a new chequebook", tenant="bank-a"), 60)
    assert again.served_from == "cache" and again.answer == first.answer
    w.stop()
    d.worker(data_dir=str(d.tmp / "fresh-data"))  # an empty local store: the answers come from the changelog
    exact = await c.request(request("c3", "u3", "How do I order a new chequebook?", tenant="bank-a"), 60)
    assert exact.served_from == "cache", "the exact layer must survive a restart on a new machine"
    semantic = await c.request(
        request("c4", "u4", "Hi, how can I order a new chequebook please?", tenant="bank-a"), 60
    )
    assert semantic.served_from == "cache" and semantic.similarity is not None and semantic.similarity >= 0.92
    other = await c.request(request("c5", "u5", "How do I order a new chequebook?", tenant="bank-b"), 60)
    assert other.served_from == "model", "tenant bank-b must never see bank-a's cached answer"
    private = await c.request(
        request("c6", "u6", "How do I order a new chequebook?", tenant="bank-a", cache=False), 60
    )
    assert private.served_from == "model", "cache: false never reads the shared cache"


def exact_hits(metrics: str) -> float:
    """Exact-layer cache hits: the requests intake answered before any embedding."""
    for line in metrics.splitlines():
        if (
            line.startswith("surge_cache_lookups_total")
            and 'layer="exact"' in line
            and 'result="hit"' in line
        ):
            return float(line.split()[-1])
    return 0.0


async def test_a_merged_request_asked_again_gets_the_same_answer_from_intake(deployment) -> None:
    """A request answered by another's model call (merged in flight, or from the semantic layer) is
    remembered under its own exact key: asked again, intake answers it with the same answer and names
    the same leader, and nothing is embedded or computed again."""
    d = deployment(model="echo", echo_delay_ms="400", rate_limit_enabled="false", **RELAXED)
    w = d.worker()
    c = await d.client()
    # in flight: the follower arrives while its leader's model call runs
    texts = {
        "r-lead": "How do I order a new chequebook?",
        "r-follow": "Hi, how can I order a new chequebook please?",
    }
    futs = [await c.submit(request(rid[2:], f"u-{rid}", text)) for rid, text in texts.items()]
    await c.producer.flush()
    pair = sorted(await d.replies(futs, 60), key=lambda r: r.served_from or "")
    follower, leader = pair  # "merged" sorts before "model"; either may have been read first
    assert leader.served_from == "model"
    assert follower.served_from == "merged" and follower.merged_into == leader.request_id, follower
    # from the semantic layer: the leader is answered before this one arrives
    first = await c.request(request("fee", "u3", "What is the fee for an international transfer?"), 60)
    near = await c.request(request("near", "u4", "Hello, what's the fee for an international transfer?"), 60)
    assert first.served_from == "model"
    assert near.served_from == "cache" and near.merged_into == "r-fee" and near.similarity is not None, near
    items, hits = model_items(w.metrics()), exact_hits(w.metrics())

    edited = "  " + texts[follower.request_id].upper().rstrip("?") + " "
    again = await c.request(request("again", "u5", edited), 60)
    assert (again.served_from, again.merged_into, again.answer) == ("cache", leader.request_id, leader.answer)
    assert again.similarity == follower.similarity
    near_again = await c.request(
        request("near-again", "u6", "hello, what's the fee for an international transfer"), 60
    )
    assert (near_again.served_from, near_again.merged_into, near_again.answer) == (
        "cache",
        "r-fee",
        first.answer,
    )
    assert near_again.similarity == near.similarity
    assert exact_hits(w.metrics()) == hits + 2, "both must be answered at intake, from the exact layer"
    assert model_items(w.metrics()) == items


async def test_a_request_that_may_not_share_an_answer_is_not_embedded(deployment) -> None:
    """``cache: false`` means never merged, never looked up, never cached, so its vector would serve
    nothing: a long prompt of that kind (an escalated risk case is 2-3 KB of JSON) cost MiniLM's time
    for nothing, and held real-time requests behind it."""
    d = deployment(model="echo", rate_limit_enabled="false", **RELAXED)
    w = d.worker()
    c = await d.client()
    private = [
        await c.submit(request(f"p{i}", f"user-{i % 5}", f"{QUESTIONS[i % 10]} case {i}", cache=False))
        for i in range(20)
    ]
    await c.producer.flush()
    replies = await d.replies(private, 60)
    assert all(r.status == "ok" and r.served_from == "model" for r in replies)
    assert w.status()["embed_calls"] == 0
    shared = [await c.submit(request(f"s{i}", "user-1", q)) for i, q in enumerate(QUESTIONS[:4])]
    await c.producer.flush()
    await d.replies(shared, 60)
    assert w.status()["embed_calls"] >= 1  # the same worker embeds what may share an answer
