"""The reply sequencer (agents/reply_order.py): replies leave in order, each after its record, and a
future cancelled by someone else never makes queued replies vanish (docs/architecture.md, "Guarantees")."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from types import SimpleNamespace
from typing import Any

import pytest

from agents.acks import Acker
from agents.reply_order import ReplySequencer


async def _durable(key: str, ack: Awaitable[Any]) -> None:
    await asyncio.shield(ack)


def _sender(sent: list[str], key: str) -> Any:
    async def send() -> Awaitable[Any]:
        sent.append(key)
        done: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        done.set_result(key)
        return done

    return send


async def test_replies_leave_in_order_each_after_its_record() -> None:
    seq, sent = ReplySequencer(_durable), []
    loop = asyncio.get_running_loop()
    record_a, record_b = loop.create_future(), loop.create_future()
    acks = [
        await seq.submit(k, r, _sender(sent, k)) for k, r in (("a", record_a), ("b", record_b), ("c", None))
    ]
    await asyncio.sleep(0.01)
    assert sent == [] and seq.waiting == 3
    record_b.set_result(None)
    await asyncio.sleep(0.01)
    assert sent == [], "b waits for a, whose record is not on the broker yet"
    record_a.set_result(None)
    assert await asyncio.wait_for(asyncio.gather(*acks), 2) == ["a", "b", "c"]
    assert sent == ["a", "b", "c"]


async def test_a_record_acknowledgement_cancelled_by_someone_else_loses_no_reply() -> None:
    """Such a CancelledError used to be taken for the drain task's own stop: every queued reply was
    dropped without a log line and its records never acked (a worker kept answering others while
    those requests waited for ever). Now the head is tried again, then failed like a failed send
    (its records stay unacked and the worker stops, so the next owner answers them), and every
    reply behind it is sent."""
    seq, sent = ReplySequencer(_durable), []
    loop = asyncio.get_running_loop()
    record_a = loop.create_future()
    record_b = loop.create_future()
    ack_a = await seq.submit("a", record_a, _sender(sent, "a"))
    ack_b = await seq.submit("b", record_b, _sender(sent, "b"))
    record_b.set_result(None)
    record_a.cancel()  # e.g. someone awaiting it without a shield timed out
    with pytest.raises(RuntimeError, match="cancelled"):
        await asyncio.wait_for(ack_a, 5)
    assert await asyncio.wait_for(ack_b, 5) == "b"
    assert sent == ["b"]


async def test_a_send_cancelled_once_from_outside_is_sent_again() -> None:
    seq, sent = ReplySequencer(_durable), []
    loop = asyncio.get_running_loop()
    tries = {"a": 0}

    async def flaky() -> Awaitable[Any]:
        tries["a"] += 1
        if tries["a"] == 1:
            blocked: asyncio.Future[None] = loop.create_future()
            loop.call_soon(blocked.cancel)
            await blocked  # raises CancelledError in the drain task, which nobody cancelled
        return await _sender(sent, "a")()

    record = loop.create_future()
    acks = [await seq.submit("a", record, flaky), await seq.submit("b", None, _sender(sent, "b"))]
    record.set_result(None)
    assert await asyncio.wait_for(asyncio.gather(*acks), 5) == ["a", "b"]
    assert sent == ["a", "b"] and tries["a"] == 2


async def test_stopping_the_drain_task_still_cancels_what_is_queued() -> None:
    seq = ReplySequencer(_durable)
    ack = await seq.submit("a", asyncio.get_running_loop().create_future(), _sender([], "a"))
    await asyncio.sleep(0.01)
    (drain,) = [t for t in asyncio.all_tasks() if t.get_coro().__qualname__ == "ReplySequencer._drain"]
    drain.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(ack, 2)
    assert seq.waiting == 0


async def test_an_ack_wait_whose_future_is_cancelled_stops_the_worker_instead_of_hanging() -> None:
    """Records whose reply future was cancelled by someone else are never finished: the Acker
    treats that as a failed send (the worker stops; the next owner reads them again) rather than
    leaving them unacked for good, with the partition's commits stuck behind them."""
    crashed: list[BaseException] = []

    async def crash(exc: BaseException) -> None:
        crashed.append(exc)

    acker = Acker(app=SimpleNamespace(consumer=None, crash=crash))  # type: ignore[arg-type]
    fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    acker.ack_after([], [fut])
    fut.cancel()
    await asyncio.sleep(0.05)
    assert len(crashed) == 1 and isinstance(crashed[0], asyncio.CancelledError)


async def test_status_shows_sends_the_broker_has_not_acknowledged_and_the_oldest_wait() -> None:
    """Unacked records whose outputs wait for the broker are told apart from records still being
    worked on: /status counts the groups of sends not acknowledged and how long the oldest waited."""
    acker = Acker(app=SimpleNamespace(consumer=None, crash=None))  # type: ignore[arg-type]
    assert acker.awaiting_broker() == {"groups": 0, "oldest_ms": None}
    loop = asyncio.get_running_loop()
    first: asyncio.Future[None] = loop.create_future()
    acker.ack_after([], [first])
    await asyncio.sleep(0.2)
    second: asyncio.Future[None] = loop.create_future()
    acker.ack_after([], [second])
    waiting = acker.awaiting_broker()
    assert waiting["groups"] == 2 and 150 <= (waiting["oldest_ms"] or 0) < 2000, waiting
    first.set_result(None)
    await asyncio.sleep(0.05)
    waiting = acker.awaiting_broker()
    assert waiting["groups"] == 1 and (waiting["oldest_ms"] or 0) < 150, waiting
    second.set_result(None)
    await asyncio.sleep(0.05)
    assert acker.awaiting_broker() == {"groups": 0, "oldest_ms": None}


class _Send:
    """A send that the broker never acknowledges (a future that stays pending), named as surge's
    own deliveries are in a report."""

    def __init__(self, name: str, fut: asyncio.Future[None]) -> None:
        self.name, self.fut = name, fut

    def __await__(self) -> Any:
        return self.fut.__await__()

    def __repr__(self) -> str:
        return self.name


async def test_a_send_waiting_past_the_bound_is_reported_once_naming_what_it_still_waits_for(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A send group still unacknowledged past the producer's request timeout is stuck inside the
    producer (aiokafka would have failed or re-sent it): it is reported once, naming the sends not
    yet acknowledged (not those already acked) and what the producer holds, the producer's sender is
    woken, and /status counts it. (The producer helpers run on aiokafka's own classes in
    tests/test_compat.py.)"""
    from agents import acks

    woken: list[object] = []
    monkeypatch.setattr(acks, "kafka_producer", lambda p: p)
    monkeypatch.setattr(acks, "producer_backlog", lambda p: {"queued": {"replies[1]": {"ages_s": [41.0]}}})
    monkeypatch.setattr(acks, "wake_producer", lambda p: woken.append(p) or True)
    producer = object()
    acker = Acker(app=SimpleNamespace(consumer=None, crash=None, producer=producer))  # type: ignore[arg-type]
    loop = asyncio.get_running_loop()
    acked: asyncio.Future[None] = loop.create_future()
    acked.set_result(None)
    never: asyncio.Future[None] = loop.create_future()
    acker.ack_after(
        [], [_Send("send to replies key=b'u1'", acked), _Send("send to replies key=b'u2'", never)]
    )
    await asyncio.sleep(0.05)
    t0 = time.monotonic()
    assert acker.report_stuck_sends(t0, after_s=5.0) == 0  # not yet past the bound
    assert woken == []
    with caplog.at_level("ERROR", logger="surge.acks"):
        assert acker.report_stuck_sends(t0 + 6.0, after_s=5.0) == 1
        assert acker.report_stuck_sends(t0 + 60.0, after_s=5.0) == 0  # reported once
    [line] = [r.getMessage() for r in caplog.records]
    assert "key=b'u2'" in line and "key=b'u1'" not in line, line
    assert "replies[1]" in line and "woken" in line, line
    assert woken == [producer]
    assert acker.stuck_reported == 1 and acker.awaiting_broker()["groups"] == 1
    never.set_result(None)
    await asyncio.sleep(0.05)
    assert acker.awaiting_broker() == {"groups": 0, "oldest_ms": None}


async def test_a_queued_reply_names_itself_and_then_its_delivery() -> None:
    seq = ReplySequencer(_durable)
    record: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    ack = await seq.submit("t/u1/r-1/replies", record, _sender([], "t/u1/r-1/replies"))
    assert repr(ack) == "reply t/u1/r-1/replies (queued)"
    record.set_result(None)
    assert await ack == "t/u1/r-1/replies"
    assert repr(ack).startswith("reply t/u1/r-1/replies: <Future finished")


def test_a_group_of_producer_futures_lists_only_those_not_yet_acknowledged(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The risk role's batches wait on aiokafka's futures themselves (agents/risk.py): a stuck batch
    is reported once with the futures still pending, and a group within the bound is not."""
    from agents import acks

    monkeypatch.setattr(acks, "kafka_producer", lambda p: p)
    monkeypatch.setattr(acks, "producer_backlog", lambda p: {"queued": {}})
    monkeypatch.setattr(acks, "wake_producer", lambda p: False)
    loop = asyncio.new_event_loop()
    try:
        acked, waiting = loop.create_future(), loop.create_future()
        acked.set_result(None)
        old = acks.SendGroup(started=100.0, futures=[acked, waiting])
        young = acks.SendGroup(started=130.0, futures=[waiting])
        assert old.pending() == [repr(waiting)]
        with caplog.at_level("ERROR", logger="surge.acks"):
            app = SimpleNamespace(producer=object())
            assert acks.report_stuck(app, [old, young], now=141.0, after_s=40.0) == 1  # type: ignore[arg-type]
            assert acks.report_stuck(app, [old, young], now=142.0, after_s=40.0) == 0  # type: ignore[arg-type]
        assert old.reported and not young.reported
        [line] = [r.getMessage() for r in caplog.records]
        assert "after 41 s" in line and "was awake" in line and "pending" in line, line
    finally:
        loop.close()
