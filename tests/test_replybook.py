"""The reply book and the keys that decide what may be shared."""

from __future__ import annotations

import asyncio

import pytest

from pipeline.exceptions import InvalidRequestError
from pipeline.keys import cache_key, reply_key, request_scope, source_key
from pipeline.records import InferenceRequest
from pipeline.replybook import ReplyBook
from pipeline.replyto import KnownTopics, ReplyToPolicy
from pipeline.topics import TopicNames


def test_first_reply_wins_and_repeats_are_identical() -> None:
    now = [1_000.0]
    book = ReplyBook({}, ttl_ms=60_000, clock_ms=lambda: now[0])
    key = reply_key("acme", "u1", "r1", "surge.replies")
    assert book.get(key) is None
    assert book.record(key, b'{"answer":"A"}') == b'{"answer":"A"}'
    # a second worker (or a redelivery) that computed something else sends the recorded one
    assert book.record(key, b'{"status":"error"}') == b'{"answer":"A"}'
    assert book.get(key) == b'{"answer":"A"}'
    now[0] += 60_000
    assert book.get(key) is None  # expired: forgotten


def test_a_requests_digest_is_what_it_asks_not_when_or_how_urgently() -> None:
    """The digest keys the reply book with the ids: another question (or model, parameters, role,
    conversation) under the same request_id is another request; the same one retried with new
    times, deadline, class or tier is the same."""
    base = {"request_id": "r1", "user_id": "u1", "prompt": "How do I block my card?"}
    digest = InferenceRequest.model_validate(base).digest
    same = [
        {**base, "created_at": 5, "deadline_ms": 900, "priority": "realtime", "tier": "free"},
        {**base, "reply_to": "other.replies", "tenant": "acme", "request_id": "r2"},
        {
            **{k: v for k, v in base.items() if k != "prompt"},
            "messages": [{"role": "user", "content": base["prompt"]}],
        },
    ]
    for rec in same:
        assert InferenceRequest.model_validate(rec).digest == digest, rec
    other = [
        {**base, "prompt": "How do I close my account?"},
        {**base, "prompt": "How do I block my card? "},
        {**base, "max_tokens": 7},
        {**base, "temperature": 0.5},
        {**base, "logprobs": True},
        {**base, "cache": False},
        {**base, "model": "other"},
        {
            **{k: v for k, v in base.items() if k != "prompt"},
            "messages": [
                {"role": "system", "content": "be brief"},
                {"role": "user", "content": base["prompt"]},
            ],
        },
    ]
    digests = {InferenceRequest.model_validate(rec).digest for rec in other}
    assert len(digests) == len(other) and digest not in digests


def test_reply_keys_never_collide_across_tenants_users_or_reply_topics() -> None:
    keys = {
        reply_key("a", "u", "1", "t"),
        reply_key("b", "u", "1", "t"),
        reply_key("a", "v", "1", "t"),
        reply_key("a|1:u", "", "1", "t"),
        reply_key("a", "u|1:1", "", "t"),
        # the same request to another reply topic: a recorded reply never goes to a topic it was
        # not recorded for
        reply_key("a", "u", "1", "t2"),
        reply_key("a", "u", "1|1:t", ""),
        # the same ids asking something else: never the recorded reply of the first
        reply_key("a", "u", "1", "t", "d1"),
        reply_key("a", "u", "1", "t", "d2"),
        reply_key("a", "u", "1", "t|2:d1", ""),
    }
    assert len(keys) == 10
    assert source_key("t", 1, 2) != source_key("t", 12, 2)


def _req(**kw: object) -> InferenceRequest:
    return InferenceRequest.model_validate({"request_id": "r", "user_id": "u", **kw})


def _scope(req: InferenceRequest, version: str = "v1") -> str:
    return request_scope(
        tenant=req.tenant,
        model="faq",
        model_version=version,
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        logprobs=req.logprobs,
        context=req.context(),
    )


def test_scope_covers_the_whole_conversation_and_the_model_version() -> None:
    q = {"role": "user", "content": "How do I reset my PIN?"}
    plain = _req(messages=[q])
    french = _req(messages=[{"role": "system", "content": "answer in French"}, q])
    history = _req(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}, q])
    scopes = {_scope(plain), _scope(french), _scope(history), _scope(plain, version="v2")}
    assert len(scopes) == 4
    # the last user message is what the exact key reads; the prompt form is the same conversation
    assert _scope(_req(prompt="How do I reset my PIN?")) == _scope(plain)
    assert french.text() == plain.text()
    assert cache_key(french.text(), _scope(french)) != cache_key(plain.text(), _scope(plain))


def test_the_same_messages_in_another_order_or_from_another_role_never_share_a_scope() -> None:
    """Pairs that once had one scope and one exact key: a question before or after an assistant's
    greeting, a follow-up placed before or after the answer it follows, a lone system message and a
    lone user message with the same text. One user's crafted conversation filled the cache that the
    other conversation of the pair then read."""
    q, g = {"role": "user", "content": "How do I reset my PIN?"}, {"role": "assistant", "content": "Hi!"}
    q0, a0 = {"role": "user", "content": "hello"}, {"role": "assistant", "content": "Hi, how can I help?"}
    pairs = [
        ([g, q], [q, g]),
        ([q0, a0, q], [q0, q, a0]),
        ([q], [{"role": "system", "content": q["content"]}]),
    ]
    for one, other in pairs:
        a, b = _req(messages=one), _req(messages=other)
        assert a.text() == b.text()
        assert _scope(a) != _scope(b), (one, other)
        assert cache_key(a.text(), _scope(a)) != cache_key(b.text(), _scope(b))


@pytest.mark.parametrize(
    "name",
    [
        "__consumer_offsets",
        "__transaction_state",
        "surge-answers-changelog",
        "surge-ratelimit-changelog",
        "other-app-x-changelog",
        "surge.work.realtime",
        "surge.requests",
        "surge.deadletter",
        "surge.risk.decisions",
        "surge.repliesX",
        "my-topic",
        "surge.replies.-changelog",
    ],
)
def test_reply_to_refuses_internal_and_foreign_topics(name: str) -> None:
    policy = ReplyToPolicy(TopicNames("surge."), app_id="surge")
    with pytest.raises(InvalidRequestError, match="not allowed"):
        policy.resolve(name)
    assert policy.safe(name) == "surge.replies"


def test_reply_to_allows_the_replies_family_and_a_configured_pattern() -> None:
    policy = ReplyToPolicy(TopicNames("surge."), app_id="surge")
    assert policy.resolve(None) == "surge.replies"
    assert policy.resolve("surge.replies") == "surge.replies"
    assert policy.resolve("surge.replies.team-a") == "surge.replies.team-a"
    custom = ReplyToPolicy(TopicNames("surge."), app_id="surge", pattern=r"bank\.answers\.[a-z]+")
    assert custom.resolve("bank.answers.web") == "bank.answers.web"
    with pytest.raises(InvalidRequestError):
        custom.resolve("surge.replies.x")
    # a pattern cannot open an internal topic
    wide = ReplyToPolicy(TopicNames("surge."), app_id="surge", pattern=r".*")
    with pytest.raises(InvalidRequestError):
        wide.resolve("surge-answers-changelog")


class Broker:
    """What a metadata probe would answer: the topics that exist; counts the questions."""

    def __init__(self, *topics: str) -> None:
        self.topics, self.asked, self.down, self.silent = set(topics), 0, False, False

    async def probe(self, name: str) -> bool:
        self.asked += 1
        if self.down:
            raise ConnectionError("broker down")
        if self.silent:
            await asyncio.sleep(3600)
        return name in self.topics


def test_known_topics_asks_once_and_remembers_found_longer_than_missing() -> None:
    broker, now = Broker("surge.replies.team-a"), [0.0]
    known = KnownTopics(broker.probe, found_ttl_ms=60_000, missing_ttl_ms=1_000, clock_ms=lambda: now[0])

    async def main() -> None:
        assert await known.exists("surge.replies.team-a") and await known.exists("surge.replies.team-a")
        assert not await known.exists("surge.replies.nobody") and not await known.exists(
            "surge.replies.nobody"
        )
        assert broker.asked == 2  # one question per name
        # a client creates its topic after being refused: refused until the missing answer expires
        broker.topics.add("surge.replies.nobody")
        now[0] = 999.0
        assert not await known.exists("surge.replies.nobody")
        now[0] = 1_000.0
        assert await known.exists("surge.replies.nobody") and broker.asked == 3
        # a found topic is asked about again only after a minute
        now[0] = 59_999.0
        await known.exists("surge.replies.team-a")
        assert broker.asked == 3
        now[0] = 60_000.0
        await known.exists("surge.replies.team-a")
        assert broker.asked == 4

    asyncio.run(main())


def test_known_topics_is_bounded_and_counts_an_unanswered_question_as_found() -> None:
    broker = Broker()
    known = KnownTopics(broker.probe, max_names=100)

    async def main() -> None:
        for i in range(1_000):  # a client making up a name per request
            assert not await known.exists(f"surge.replies.x{i}")
        assert len(known) == 100 and broker.asked == 1_000
        # the broker does not answer: the reply is sent as before, and the name is not remembered
        broker.down = True
        assert await known.exists("surge.replies.later")
        assert known.probe_errors == 1 and len(known) == 100
        broker.down = False
        assert not await known.exists("surge.replies.later") and broker.asked == 1_002
        # a broker that does not answer at all holds the intake at most the probe timeout
        broker.silent, known.probe_timeout_s = True, 0.05
        assert await asyncio.wait_for(known.exists("surge.replies.silent"), 1.0)
        asked = broker.asked
        assert await known.exists("surge.replies.silent")  # not remembered: asked again
        assert known.probe_errors == 3 and broker.asked == asked + 1

    asyncio.run(main())


def test_an_entry_expires_at_its_ttl_and_anything_else_is_left_alone() -> None:
    from pipeline.replybook import expired_entry

    assert expired_entry({"reply": "{}", "at_ms": 1_000}, now_ms=61_000, ttl_ms=60_000)
    assert not expired_entry({"reply": "{}", "at_ms": 1_001}, now_ms=61_000, ttl_ms=60_000)
    for other in (None, "x", {"reply": "{}"}, {"at_ms": "1"}):
        assert not expired_entry(other, now_ms=10**12, ttl_ms=1)
