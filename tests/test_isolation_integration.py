"""Tenant isolation from outside, with a Kafka client: reply_to, request ids shared by two tenants,
conversations that differ only in their system message, unknown model names."""

from __future__ import annotations

import asyncio
import json

import pytest
from aiokafka import AIOKafkaConsumer

from pipeline.admin import changelog_topics
from pipeline.records import DeadLetter, InferenceReply
from tests.conftest import RELAXED, decode, request

pytestmark = pytest.mark.integration


async def test_reply_to_cannot_name_internal_topics(deployment) -> None:
    d = deployment(model="echo", rate_limit_enabled="false", **RELAXED)
    d.worker()
    c = await d.client()
    s = d.settings
    changelog = changelog_topics(s)[1]  # the answer cache's changelog
    hostile = {
        "cl": changelog,
        "offsets": "__consumer_offsets",
        "work": d.topics.work("realtime"),
        "fresh": "brand-new-topic-per-request",
    }
    futs = {k: c.expect(f"r-{k}") for k in hostile}
    for k, topic in hostile.items():
        await c.send_raw(b"mallory", json.dumps(request(k, "mallory", "hello", reply_to=topic)).encode())
    # the same partition keeps serving and committing after the refusals
    ok = await c.submit(request("after", "mallory", "still served?"))
    await c.producer.flush()
    for fut in futs.values():
        reply = await asyncio.wait_for(fut, 30)  # on the default replies topic
        assert reply.status == "error" and reply.error is not None
        assert reply.error.code == "invalid_request" and "reply_to" in reply.error.message, reply.error
    assert (await asyncio.wait_for(ok, 30)).status == "ok"
    dead = [
        DeadLetter.model_validate(decode(r)) for r in await d.read_topic(d.topics.deadletter, min_count=4)
    ]
    assert sum("reply_to" in x.message for x in dead) == 4
    # nothing reached the changelog or the work topic from a client, and no topic was created
    consumer = AIOKafkaConsumer(bootstrap_servers=d.bootstrap)
    await consumer.start()
    try:
        topics = await consumer.topics()
    finally:
        await consumer.stop()
    assert "brand-new-topic-per-request" not in topics
    for record in await d.read_topic(changelog, timeout_s=3):
        assert b"mallory" not in (record.value or b"")
    work = await d.read_topic(d.topics.work("realtime"), timeout_s=3)
    assert all(b'"request_id":"r-work"' not in (r.value or b"") for r in work)


async def test_two_tenants_numbering_requests_alike_get_their_own_answers(deployment) -> None:
    """Merge leaders and recorded replies are keyed by nothing a client chooses alone: two tenants
    with the same request ids, each with a leader and a merged follower in flight at once."""
    # degradation off: a slow machine must not turn this into template answers
    d = deployment(
        model="echo", echo_delay_ms="1000", rate_limit_enabled="false", degrade_enabled="false", **RELAXED
    )
    d.worker()
    c = await d.client()
    expected: dict[tuple[str, str], str] = {}
    for i in range(4):
        for tenant, users in (("bank-a", ("a1", "a2")), ("bank-b", ("b1", "b2"))):
            text = f"{tenant} asks question {i}"
            for user in users:  # the second is merged into the first (same text, same scope)
                await c.submit(request(i, user, text, tenant=tenant))
                expected[(f"r-{i}", user)] = text
    await c.producer.flush()
    # every reply, read from the topic (the client's futures are keyed by request id alone)
    records = await d.read_topic(c.reply_topic, min_count=len(expected), timeout_s=60)
    replies = [InferenceReply.model_validate(decode(r)) for r in records]
    seen = sorted((r.request_id, r.user_id, r.status, r.served_from) for r in replies)
    assert sorted((r.request_id, r.user_id) for r in replies) == sorted(expected), seen
    assert all(r.status == "ok" for r in replies), seen
    # the followers share their leader's answer (merged while it is in flight, or from the cache
    # once it is stored): either way keyed by tenant and source, never by the shared request ids
    assert any(r.served_from in ("merged", "cache") for r in replies), (
        "the scenario needs shared answers",
        seen,
    )
    for r in replies:
        assert r.answer == expected[(r.request_id, r.user_id)], (r.request_id, r.user_id, r.answer)


async def test_a_different_system_message_is_never_served_from_the_cache(deployment) -> None:
    d = deployment(model="echo", rate_limit_enabled="false", **RELAXED)
    d.worker()
    c = await d.client()
    q = {"role": "user", "content": "How do I reset my PIN?"}
    first = await c.request(request("plain", "u1", messages=[q], prompt=None), timeout_s=30)
    again = await c.request(request("plain-2", "u2", messages=[q], prompt=None), timeout_s=30)
    assert first.served_from == "model" and again.served_from == "cache"
    french = await c.request(
        request("fr", "u3", messages=[{"role": "system", "content": "answer in French"}, q], prompt=None),
        timeout_s=30,
    )
    assert french.served_from == "model", "another conversation must not get this one's cached answer"


async def test_a_request_naming_an_unknown_model_is_refused(deployment) -> None:
    d = deployment(model="echo", rate_limit_enabled="false", **RELAXED)
    d.worker()
    c = await d.client()
    replies = await asyncio.gather(
        *[c.request(request(f"m{i}", "u1", "hi", model=f"random-model-{i}"), timeout_s=30) for i in range(3)]
    )
    assert all(r.status == "error" and r.error and r.error.code == "invalid_request" for r in replies)
    assert "unknown model" in replies[0].error.message  # type: ignore[union-attr]
    named = await c.request(request("ok", "u1", "hi", model="echo"), timeout_s=30)
    assert named.status == "ok"
