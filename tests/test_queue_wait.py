"""Refusing, before its embedding, an item that would expire in the model queue
(pipeline/queue_wait.py; docs/architecture.md, "Degradation")."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.devtools.broker import EmbeddedKafka
from pipeline.queue_wait import QueueWait, Unreachable
from pipeline.records import now_ms
from tests.conftest import request
from tests.test_agents_inprocess import _RecordingEmbedder, inprocess


def test_an_item_with_less_time_left_than_its_class_waited_lately_is_unreachable() -> None:
    waits = QueueWait(window_ms=1_000)
    for wait in (300.0, 500.0):
        waits.observe("interactive", wait, now_ms=10_000)
    assert waits.expected_ms("interactive", 10_000) == 400.0
    # 450 ms left, 400 ms of queue and a 100 ms embedding call ahead: it would expire
    assert waits.unreachable("interactive", 10_450, 10_000, ahead_ms=100) == Unreachable(450, 400, 100)
    assert waits.unreachable("interactive", 10_500, 10_000, ahead_ms=100) is None
    assert waits.unreachable("realtime", 10_001, 10_000, ahead_ms=100) is None, "no wait of its own class"
    assert waits.unreachable("interactive", None, 10_000, ahead_ms=100) is None, "no deadline"


def test_a_few_long_waits_do_not_make_a_queue_that_serves_most_items_in_time_refuse() -> None:
    """The median: after a failover, items of the backlog expire after seconds in the queue while
    new ones are served in 100 ms; the mean (1,325 ms here) refused them all."""
    waits = QueueWait(window_ms=1_000)
    for wait in (100.0, 100.0, 100.0, 5_000.0):
        waits.observe("interactive", wait, now_ms=0)
    assert waits.expected_ms("interactive", 0) == 100.0
    assert waits.unreachable("interactive", 300, 0, ahead_ms=50) is None


def test_waits_older_than_the_window_are_forgotten_so_a_refused_class_is_tried_again() -> None:
    """A class whose items are all refused records no new waits: once the window has passed, its
    items are embedded again, and what the queue does then decides."""
    waits = QueueWait(window_ms=1_000)
    waits.observe("batch", 9_000.0, now_ms=0)
    assert waits.unreachable("batch", 2_000, 500, ahead_ms=0) is not None
    assert waits.unreachable("batch", 2_000, 1_001, ahead_ms=0) is None
    assert waits.expected_ms("batch", 1_001) is None


def test_the_median_kept_between_questions_follows_new_and_forgotten_waits() -> None:
    waits = QueueWait(window_ms=1_000)
    waits.observe("interactive", 100.0, now_ms=0)
    waits.observe("interactive", 300.0, now_ms=800)
    assert waits.expected_ms("interactive", 900) == 200.0
    assert waits.expected_ms("interactive", 900) == 200.0  # asked again, nothing changed
    waits.observe("interactive", 700.0, now_ms=900)
    assert waits.expected_ms("interactive", 900) == 300.0, "a new wait"
    assert waits.expected_ms("interactive", 1_001) == 500.0, "the wait at 0 left the window"


def test_samples_are_bounded_and_negative_waits_count_as_none() -> None:
    waits = QueueWait(window_ms=10_000, max_samples=3)
    for wait in (1_000.0, 1_000.0, 1_000.0, 10.0, -5.0, 20.0):
        waits.observe("offline", wait, now_ms=5)
    assert waits.expected_ms("offline", 5) == 10.0
    with pytest.raises(ValueError):
        QueueWait(window_ms=0)


@pytest.mark.parametrize("level", [1, 2])
async def test_from_level_2_an_item_its_class_would_leave_to_expire_is_refused_unembedded(
    kafka: EmbeddedKafka, tmp_path: Path, level: int
) -> None:
    """Interactive items lately waited 120 s for the model, longer than their 60 s deadline: from
    level 2 the next one is answered ``deadline_exceeded`` with the numbers and never embedded;
    below level 2 (the worker keeps up) it is served. A real-time one is served either way, though
    its class waited as long: real-time items are never refused so (refused, the queue filled with
    interactive work in their place)."""
    async with inprocess(kafka, tmp_path, dedup_enabled="true", unreachable_window_ms="600000") as w:
        inf = w.rt.inference
        assert inf.embedder is not None
        rec = _RecordingEmbedder(inf.embedder, call_s=0.0)
        inf.embedder = rec
        inf.level = lambda: level  # type: ignore[method-assign]
        recorded: list[bool] = []  # what the controller's miss rate hears
        inf.misses.record = lambda missed, now: recorded.append(missed)  # type: ignore[method-assign]
        for priority in ("interactive", "realtime"):
            inf.queue_wait.observe(priority, 120_000.0, now_ms=now_ms())
        doomed_text, urgent_text = "can I move my standing order to another day", "is this payment mine"
        doomed = await w.client.submit(request("d", "ud", doomed_text, priority="interactive"))
        urgent = await w.client.submit(request("u", "uu", urgent_text, priority="realtime"))
        doomed_reply, urgent_reply = await w.replies(doomed, urgent)
        assert urgent_reply.status == "ok"
        embedded = [t for call in rec.calls for t in call]
        if level < 2:
            assert doomed_reply.status == "ok" and doomed_text in embedded
            assert inf.status()["refused_as_unreachable"] == 0
            return
        assert doomed_reply.status == "error" and doomed_reply.error is not None
        assert doomed_reply.error.code == "deadline_exceeded"
        assert "cannot begin inference within its deadline of 60000 ms" in doomed_reply.error.message
        assert "waited 120000 ms for the model lately" in doomed_reply.error.message
        assert doomed_text not in embedded, rec.calls
        assert inf.status()["refused_as_unreachable"] == 1
        assert True not in recorded, "a refusal is the level's own shedding, not a miss of the worker"
