"""Priority, deadlines, rate limits and failure isolation on the real broker."""

from __future__ import annotations

import asyncio
import json
import re
import time
from datetime import datetime

import pytest

from models.faq import DATA_DIR, INTENTS_FILE
from pipeline.metrics import scrape
from pipeline.records import now_ms
from pipeline.topics import TopicNames
from tests.conftest import RELAXED, request
from tests.test_replay_integration import _end_offsets

pytestmark = pytest.mark.integration
FAST = {"cache_enabled": "false", "dedup_enabled": "false", "rate_limit_enabled": "false"}
# batches of 2-4 and degradation thresholds of a few items: a backlog of 200 reaches every level
SMALL_QUEUE = {
    "max_batch_size": "4",
    "base_batch_size": "2",
    "degrade_up_queue_depth": "[2,4,6]",
    "degrade_down_queue_depth": "[1,3,5]",
    "degrade_cooldown_ms": "60000",
    "deadline_realtime_ms": "5000",
    "deadline_interactive_ms": "60000",
    "deadline_batch_ms": "120000",
    **FAST,
}


async def test_realtime_sent_after_a_batch_burst_is_answered_first(deployment) -> None:
    d = deployment(
        model="echo",
        echo_delay_ms="60",
        max_batch_size="8",
        base_batch_size="4",
        degrade_enabled="false",
        deadline_realtime_ms="2000",
        deadline_interactive_ms="60000",
        deadline_batch_ms="120000",
        **FAST,
    )
    d.worker()
    c = await d.client()
    batch = [await c.submit(request(f"b{i}", f"bulk-{i % 10}", priority="batch")) for i in range(320)]
    await c.producer.flush()
    while sum(r.priority == "batch" for r in c.replies) < 8:  # noqa: ASYNC110 - the backlog is being worked
        await asyncio.sleep(0.02)
    rt = [
        await c.submit(request(f"rt{i}", f"live-{i}", priority="realtime", deadline_ms=5000))
        for i in range(10)
    ]
    await c.producer.flush()
    await d.replies([*batch, *rt], 120)
    order = [r.request_id for r in c.replies]
    last_rt = max(order.index(f"r-rt{i}") for i in range(10))
    batch_after = sum(1 for rid in order[last_rt:] if rid.startswith("r-b"))
    assert batch_after >= 160, f"only {batch_after} batch replies came after the last real-time one"
    rt_errors = [r.error for r in c.replies if r.request_id.startswith("r-rt") and r.status != "ok"]
    assert not rt_errors, rt_errors


async def test_expired_requests_get_deadline_exceeded(deployment) -> None:
    d = deployment(model="echo", **FAST)
    d.worker()
    c = await d.client()
    late = await c.request(
        request("late", "u1", "hello", priority="interactive", created_at=now_ms() - 10_000), 60
    )
    assert late.status == "error" and late.error.code == "deadline_exceeded"
    assert "500 ms" in late.error.message
    fine = await c.request(request("fine", "u1", "hello again", priority="interactive", deadline_ms=400), 60)
    assert fine.status == "ok"


async def test_a_rate_limited_user_gets_errors_while_others_are_served(deployment) -> None:
    d = deployment(
        model="echo",
        user_rate_per_s_standard="0.5",
        user_burst_standard="3",
        cache_enabled="false",
        **RELAXED,
    )
    d.worker()
    c = await d.client()
    noisy = [await c.submit(request(f"n{i}", "noisy", f"question {i}")) for i in range(12)]
    quiet = [await c.submit(request(f"q{i}", f"quiet-{i}", f"question {i}")) for i in range(3)]
    await c.producer.flush()
    noisy_r = await d.replies(noisy, 60)
    quiet_r = await d.replies(quiet, 60)
    limited = [r for r in noisy_r if r.status == "error"]
    assert len([r for r in noisy_r if r.status == "ok"]) == 3
    assert len(limited) == 9 and all(r.error.code == "rate_limited" for r in limited)
    assert all(r.error.retry_after_ms and 0 < r.error.retry_after_ms <= 2000 for r in limited)
    assert "0.5 requests/s" in limited[0].error.message
    assert all(r.status == "ok" for r in quiet_r)
    assert 'surge_rate_limited_total{scope="user"} 9.0' in d.workers[0].metrics()


async def test_a_poisoned_request_fails_alone(deployment) -> None:
    d = deployment(
        model="echo", echo_poison="POISON", echo_delay_ms="50", max_wait_ms="200", **FAST, **RELAXED
    )
    d.worker()
    c = await d.client()
    futs = [await c.submit(request(i, f"u{i}", f"ordinary question {i}")) for i in range(15)]
    futs.insert(7, await c.submit(request("bad", "mallory", "this one carries POISON")))
    await c.producer.flush()
    replies = await d.replies(futs, 60)
    bad = next(r for r in replies if r.request_id == "r-bad")
    assert bad.status == "error" and bad.error.code == "model_error"
    good = [r for r in replies if r.request_id != "r-bad"]
    assert len(good) == 15 and all(r.status == "ok" for r in good)
    # it shared a batch with good requests (else "alone" would prove nothing), and they were answered
    assert (bad.timings.batch_size or 0) > 1, bad.timings
    assert any((r.timings.batch_size or 0) > 1 for r in good)


async def test_the_followers_of_a_failed_leader_get_its_error_never_silence(deployment) -> None:
    """Requests merged into a leader whose model call fails each get the leader's error reply: a
    failed batch closes its leaders, so no follower waits forever."""
    d = deployment(
        model="echo",
        echo_poison="POISON",
        echo_delay_ms="50",
        max_wait_ms="300",
        cache_enabled="false",
        rate_limit_enabled="false",
        **RELAXED,
    )
    d.worker()
    c = await d.client()
    futs = [await c.submit(request(f"p{i}", f"user{i}", "please explain the POISON fee")) for i in range(4)]
    futs.append(await c.submit(request("ok", "other", "an ordinary question about fees")))
    await c.producer.flush()
    replies = {r.request_id: r for r in await d.replies(futs, 60)}
    poisoned = [replies[f"r-p{i}"] for i in range(4)]
    assert all(r.status == "error" and r.error.code == "model_error" for r in poisoned)
    assert sum(r.merged_into is not None for r in poisoned) == 0, "an error names no leader"
    assert replies["r-ok"].status == "ok"
    status = d.workers[0].status()
    assert status["open_leaders"] == 0 and status["followers_waiting"] == 0 and status["in_flight"] == 0
    merged = sum(v for (name, _), v in d.metrics().items() if name == "surge_merged_total")
    assert merged >= 1, "the identical poisoned requests were merged into a leader, not each computed"


async def test_an_offline_backlog_without_a_deadline_does_not_degrade_anyone(deployment) -> None:
    """Offline work may wait as long as it takes: a deep offline queue (the same depth that sends a
    batch backlog to level 3 in the test below) leaves the level at 0 and templates no one."""
    d = deployment(
        model="echo",
        echo_delay_ms="40",
        **SMALL_QUEUE,
    )
    d.worker()
    c = await d.client()
    futs = [await c.submit(request(f"o{i}", f"night-{i % 7}", priority="offline")) for i in range(200)]
    await c.producer.flush()
    # the queue's depth swings as batches leave it: watched until it has been past level 3's
    # threshold (read once at the 20th reply, it was 2 in two runs of fourteen)
    deepest, deadline = 0.0, time.monotonic() + 30
    while (
        sum(r.priority == "offline" for r in c.replies) < 20 or deepest <= 6
    ) and time.monotonic() < deadline:
        deepest = max(
            [deepest]
            + [
                float(line.split()[-1])
                for line in d.workers[0].metrics().splitlines()
                if line.startswith('requests_queue_depth{priority="offline"}')
            ]
        )
        await asyncio.sleep(0.05)
    # one real-time request at a time: three at once would be a real-time queue of 3, over level 1's 2
    rt = []
    for i in range(3):
        rt.append(await c.submit(request(f"rt{i}", f"live-{i}", priority="realtime")))
        await c.producer.flush()
        await d.replies(rt[-1:], 60)
    replies = await d.replies([*futs, *rt], 120)
    assert deepest > 6, f"the offline queue must be deeper than level 3's threshold, was at most {deepest}"
    assert all(r.status == "ok" and r.served_from == "model" for r in replies), {
        (r.served_from, r.error.code if r.error else None) for r in replies
    }
    assert {r.degradation_level for r in replies} == {0}
    assert "surge_degradation_level 0.0" in d.workers[0].metrics()


async def test_overload_degrades_low_classes_to_templates_but_never_realtime(deployment) -> None:
    d = deployment(
        model="faq",
        **SMALL_QUEUE,
    )
    d.worker()
    c = await d.client()
    futs = [
        await c.submit(
            request(f"b{i}", f"bulk-{i % 7}", f"I want to know about topping up, case {i}", priority="batch")
        )
        for i in range(200)
    ]
    await c.producer.flush()
    while sum(r.priority == "batch" for r in c.replies) < 20:  # noqa: ASYNC110 - the backlog is being worked
        await asyncio.sleep(0.02)
    rt = [
        await c.submit(
            request(f"rt{i}", f"live-{i}", "Where is my card?", priority="realtime", logprobs=True)
        )
        for i in range(5)
    ]
    await c.producer.flush()
    replies = await d.replies([*futs, *rt], 120)
    templated = [r for r in replies if r.served_from == "template"]
    assert templated, "level 3 must answer low classes with the FAQ template"
    assert all(r.degradation_level == 3 and r.finish_reason == "template" and r.answer for r in templated)
    assert all(r.priority == "batch" for r in templated)
    for r in replies[-5:]:
        # identical real-time questions share one model call: the leader's "model", the others "merged"
        assert r.status == "ok" and r.served_from in ("model", "merged") and r.degradation_level <= 2, (
            r.error,
            r.served_from,
        )
        assert r.degradation_level == 0 or r.logprobs is None, "logprobs are dropped from level 1"
    assert "surge_degradation_level 3.0" in d.workers[0].metrics()
    # arriving while level 3 holds (60 s cooldown): templated at admission, without queueing
    late = [
        await c.submit(request(f"late{i}", f"late-{i}", "How do I top up?", priority="batch"))
        for i in range(5)
    ]
    await c.producer.flush()
    late_replies = await d.replies(late, 60)
    assert all(r.served_from == "template" and r.degradation_level == 3 for r in late_replies), late_replies


async def test_level_3_templates_cost_no_embedding_and_no_work_topic_on_the_default_path(deployment) -> None:
    """With caches and merging on (the default path), every request is embedded with MiniLM, the
    worker's dearest step; one that level 3 sends to the FAQ template skips it (the template reads
    n-grams alone), so the level sheds that cost, and its answer is still the question's intent.
    The intake gives that answer itself (agents/shed.py): a batch request arriving at level 3 never
    enters its work topic, where in a surge it waited behind the higher classes until its deadline
    had passed; a real-time one is still forwarded and answered by the model."""
    d = deployment(model="faq", **{**SMALL_QUEUE, "cache_enabled": "true", "dedup_enabled": "true"})
    w = d.worker()
    c = await d.client()
    backlog = [
        await c.submit(
            request(f"b{i}", f"bulk-{i % 7}", f"Tell me about my card delivery, case {i}", priority="batch")
        )
        for i in range(200)
    ]
    await c.producer.flush()
    await d.replies(backlog, 120)
    metrics = w.metrics()
    assert "surge_degradation_level 3.0" in metrics
    embedded = scrape(metrics)[("surge_embed_batch_size_sum", ())]
    assert embedded > 0
    topics = TopicNames(d.settings.topic_prefix)
    work_before = await _end_offsets(d.bootstrap, [topics.work("batch"), topics.work("realtime")])
    late = [
        await c.submit(
            request(
                f"late{i}",
                f"late-{i}",
                f"How do I top up my account with my debit card, number {i}?",
                priority="batch",
            )
        )
        for i in range(5)
    ]
    await c.producer.flush()
    late_replies = await d.replies(late, 60)
    assert all(r.served_from == "template" and r.degradation_level == 3 for r in late_replies), [
        (r.served_from, r.degradation_level) for r in late_replies
    ]
    answers = {e["intent"]: e["answer"] for e in json.loads((DATA_DIR / INTENTS_FILE).read_text())}
    assert all(r.answer == answers["topping_up_by_card"] for r in late_replies), [
        r.answer for r in late_replies
    ]
    assert scrape(w.metrics())[("surge_embed_batch_size_sum", ())] == embedded
    work_after = await _end_offsets(d.bootstrap, [topics.work("batch"), topics.work("realtime")])
    assert work_after[topics.work("batch")] == work_before[topics.work("batch")] > 0, (
        "templated at the intake"
    )
    live = [
        await c.submit(
            request(f"live{i}", f"live-{i}", f"Where is my new card, order {i}?", priority="realtime")
        )
        for i in range(2)
    ]
    await c.producer.flush()
    live_replies = await d.replies(live, 60)
    # real time is never templated: the model's answer, or the cache's (the backlog asked alike)
    assert all(
        r.status == "ok" and r.served_from != "template" and r.degradation_level <= 2 for r in live_replies
    ), [(r.served_from, r.degradation_level) for r in live_replies]
    work_after = await _end_offsets(d.bootstrap, [topics.work("realtime")])
    assert work_after[topics.work("realtime")] == work_before[topics.work("realtime")] + 2


async def test_batch_work_waits_while_the_intake_is_behind(deployment) -> None:
    """One worker runs both agents on one event loop. Batch work is not read while the intake has
    requests waiting on the request topic, so real-time requests behind a backlog reach their work
    topic before the batch work already forwarded is answered (after a surge, a cheap low-class
    backlog drained at over a thousand replies a second and starved the intake: real-time requests
    waited in the request topic, real-time p99 of 4 s). Measured by broker timestamps: when the
    intake wrote each real-time work item, against when each batch reply was written.

    And the drain that follows never fills Faust's producer buffer (one reply-book write per reply)
    far past the 100 records at which Faust stops delivering records to every stream (its own
    warning, "producer buffer full size N", reports it): the reply book's records skip that buffer,
    and batch reading waits while more than 50 other table writes wait there."""
    d = deployment(model="echo", deadline_realtime_ms="60000", **RELAXED, **FAST)
    c = await d.client()
    batch = [await c.submit(request(f"b{i}", f"bulk-{i % 16}", priority="batch")) for i in range(1500)]
    live = [await c.submit(request(f"rt{i}", f"live-{i}", priority="realtime")) for i in range(8)]
    await c.producer.flush()
    # the whole backlog is in the request topic before the worker reads it: real-time records that
    # reach the topic only after the intake caught up are not "behind" (up to the mark of 32 may
    # wait without holding batch reading), and with the worker started first, a client producer
    # slow to send its last records made that race (29 batch replies once in about 11 runs)
    d.worker()
    replies = await d.replies([*batch, *live], 120)
    assert all(r.status == "ok" for r in replies), {r.error.code for r in replies if r.error}
    forwarded = await d.read_topic(d.topics.work("realtime"), min_count=8)
    assert len(forwarded) == 8
    last_forward = max(r.timestamp for r in forwarded)
    written = await d.read_topic(d.topics.replies, min_count=1508)
    batch_first = sum(1 for r in written if b'"r-b' in r.value and r.timestamp < last_forward)
    # 0 in every run; without the gate 78-458 of them (three runs with the worker started first), 93
    # and 190 (two runs with the backlog written first)
    assert batch_first <= 10, f"{batch_first} batch replies written before the intake forwarded real-time"
    log = d.workers[0].log_path.read_text(errors="replace")
    sizes = [
        int(n)
        for at, n in re.findall(
            r"^\[([\d-]+ [\d:]+,\d+)\] \[\d+\] \[WARNING\] producer buffer full size (\d+)", log, re.M
        )
        if datetime.strptime(at, "%Y-%m-%d %H:%M:%S,%f").timestamp() * 1000 > last_forward
    ]
    # the reply book's records skip that buffer (agents/durable_table.py): no warning at all in three
    # runs; with them in it and batch reading paced at 50, 102-143 in most runs but 338 and 445 in two
    # of 30 after the intake was done (model batches answered whole); 663-870 without either
    assert max(sizes, default=0) <= 300, sizes


async def test_level_3_answers_a_forwarded_low_class_at_admission_past_strict_priority(deployment) -> None:
    """The Kubernetes shape (intake and inference in their own workers): the intake has no level
    and forwards everything; at level 3 the inference worker answers batch work with the template as
    it reads it (agents/shed.py). Its batch reader is not held back by strict priority then, since
    what it reads takes no place in the embedding stage or the queue: the batch requests are answered
    while real-time work still waits for the slow model, not after all of it (where, in a surge,
    their deadlines had passed)."""
    d = deployment(
        model="echo",
        echo_delay_ms="300",
        **{**SMALL_QUEUE, "deadline_realtime_ms": "60000"},
    )
    d.worker(role="intake", wait=False)
    d.worker(role="inference", wait=False)
    for w in d.workers:
        w.wait_ready()
    c = await d.client()
    live = [
        await c.submit(request(f"rt{i}", f"live-{i}", f"real-time question {i}", priority="realtime"))
        for i in range(80)
    ]
    await c.producer.flush()
    inference = d.workers[1]
    deadline = time.monotonic() + 60
    while "surge_degradation_level 3.0" not in inference.metrics():
        assert time.monotonic() < deadline, "the real-time backlog must raise the level to 3"
        await asyncio.sleep(0.1)
    topics = TopicNames(d.settings.topic_prefix)
    forwarded_before = (await _end_offsets(d.bootstrap, [topics.work("batch")]))[topics.work("batch")]
    bulk = [
        await c.submit(request(f"b{i}", f"bulk-{i}", f"batch question {i}", priority="batch"))
        for i in range(5)
    ]
    await c.producer.flush()
    bulk_replies = await d.replies(bulk, 60)
    assert all(
        r.status == "ok" and r.served_from == "template" and r.degradation_level == 3 for r in bulk_replies
    ), [(r.served_from, r.degradation_level) for r in bulk_replies]
    forwarded_after = (await _end_offsets(d.bootstrap, [topics.work("batch")]))[topics.work("batch")]
    assert forwarded_after == forwarded_before + 5, "an intake apart has no level: it forwards"
    order = [r.request_id for r in c.replies]
    answered_live = sum(
        rid.startswith("r-rt") for rid in order[: max(order.index(f"r-b{i}") for i in range(5))]
    )
    # held back by strict priority, batch work would be read only once no real-time request waited,
    # with at most the last batch of them (4) still in the model
    assert answered_live <= len(live) // 2, f"batch answered after {answered_live} of {len(live)} real-time"
    live_replies = await d.replies(live, 120)
    assert all(r.status == "ok" and r.served_from == "model" for r in live_replies)
