"""A risk stage takes each partition's records in offset order (pipeline/in_order.py, agents/risk.py
``_in_order``; docs/architecture.md, "Risk: takeover").

An entity skips an item at or before the position it last took (input read again after a crash),
so a record taken after a later one of its partition was skipped for good: an event without a
decision. A worker that returned after a SIGKILL was seen taking offset 94 of its events partition
before 93 (its first delivery after the rebalance came from past its committed offset), and the
two-worker SIGKILL test then found an event that no stage had forwarded. The gate below drops a
record delivered past one not taken yet and reads the partition again from there, unless the
broker says nothing lies in between (a transaction marker)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from faust.types import TP

import agents.risk as risk_module
from agents.acks import Acker
from agents.risk import RiskAgents, Taken
from pipeline.in_order import InOrderGate, Verdict
from pipeline.risk.features import FeatureConfig
from pipeline.risk.stages import Stage, StateCache, new_item
from pipeline.settings import Settings

TOPIC = "t.risk.events"
TP0 = TP(TOPIC, 0)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_next_offset_is_taken_earlier_ones_are_repeats_and_later_ones_a_gap() -> None:
    gate: InOrderGate[str] = InOrderGate()
    gate.begin(0)
    gate.start_at("p", 20)
    assert gate.check("p", 19) is Verdict.REPEAT
    assert gate.check("p", 21) is Verdict.GAP
    assert gate.check("p", 20) is Verdict.TAKE
    gate.took("p", 20)
    assert gate.expected("p") == 21
    gate.start_at("p", 5)  # a start comes only before the first record: ignored afterwards
    assert gate.expected("p") == 21
    assert gate.check("q", 7) is Verdict.TAKE  # no start known: the first record is trusted


def test_records_past_a_gap_wait_for_the_seek_back_then_are_asked_about_again() -> None:
    clock = _Clock()
    gate: InOrderGate[str] = InOrderGate(reprobe_after_s=2.0, clock=clock)
    gate.begin(0)
    gate.start_at("p", 20)
    assert gate.check("p", 22) is Verdict.GAP
    gate.seeking("p")
    clock.now = 1.9
    assert gate.check("p", 23) is Verdict.WAIT  # the seek back is under way: no second question
    clock.now = 2.1
    assert gate.check("p", 24) is Verdict.GAP  # the seek may have been lost: ask again
    assert gate.check("p", 20) is Verdict.TAKE
    gate.took("p", 20)
    assert gate.check("p", 21) is Verdict.TAKE
    assert gate.dropped == 2


def test_an_empty_gap_is_stepped_over_and_a_rebalance_forgets_every_position() -> None:
    gate: InOrderGate[str] = InOrderGate()
    gate.begin(3)
    gate.start_at("p", 20)
    gate.gap_empty("p", 22)  # offset 20..21 hold no record (transaction markers)
    assert gate.check("p", 22) is Verdict.TAKE
    assert gate.empty_gaps == 1
    gate.begin(3)
    assert gate.expected("p") == 22
    gate.begin(4)
    assert gate.expected("p") is None


def test_what_the_broker_said_it_holds_answers_later_gaps_inside_it() -> None:
    """One answer lists the committed records from an offset on; a later gap within that stretch
    with no listed record in it needs no second question, across rebalances too (an offset never
    changes what it holds)."""
    gate: InOrderGate[str] = InOrderGate()
    gate.begin(0)
    assert not gate.known_empty("p", 21, 22)  # nothing said yet: ask
    gate.learn("p", 21, [22, 24, 26, 28])  # a producer writing one transaction per record
    assert gate.known_empty("p", 21, 22) and gate.known_empty("p", 23, 24) and gate.known_empty("p", 27, 28)
    assert not gate.known_empty("p", 23, 26), "24 lies between: a record not taken, read it again"
    assert not gate.known_empty("p", 29, 30), "past what the broker listed: ask again"
    assert not gate.known_empty("p", 20, 22), "before where it was asked: ask again"
    assert not gate.known_empty("q", 23, 24), "another partition"
    gate.begin(1)
    assert gate.known_empty("p", 25, 26)
    gate.learn("p", 40, [])  # nothing up to the log's end says nothing: the last answer stays
    assert gate.known_empty("p", 25, 26)
    assert gate.known_gaps == 5


def test_a_stage_skips_an_item_taken_after_a_later_one_of_its_entity() -> None:
    """Why the order matters: the entity's position rule (input read again after a crash) cannot
    tell an item taken out of order from one it already took."""
    stage = Stage("account", FeatureConfig(), 4, StateCache(100), lambda key, ctx: None)

    def item(eid: str, t: int) -> dict[str, Any]:
        e = {"event_id": eid, "type": "login", "account": "a1", "card": None, "device": None, "ip": None}
        e |= {"amount": 0.0, "currency": "EUR", "merchant": None, "country": "DE", "event_time_ms": t}
        return new_item(e, "v1", 0, 0)

    later = stage.run([(item("e94", 2_000), None)], [(0, 94, 0)])
    earlier = stage.run([(item("e93", 1_000), None)], [(0, 93, 0)])
    assert later.decide and not earlier.decide and earlier.reread == 1


# ---- the risk reader, with the worker's own Acker ---------------------------------------------------
class _Log:
    """One partition of the broker's log as the consumer delivers it: ``first`` is what the fetcher
    hands over (it may start past an offset a buffer clear threw away); a seek delivers the log
    again from its offset. ``offsets`` is what the log holds (gaps: transaction markers)."""

    def __init__(self, offsets: list[int], first: list[int | None]) -> None:
        self.offsets = offsets
        self.queue: asyncio.Queue[int | None] = asyncio.Queue()
        for o in first:
            self.queue.put_nowait(o)
        self.seeks: list[int] = []
        self.probes: list[int] = []

    # the consumer, as the Acker seeks it
    async def seek_wait(self, points: dict[TP, int]) -> None:
        offset = points[TP0]
        self.seeks.append(offset)
        for o in self.offsets:
            if o >= offset:
                self.queue.put_nowait(o)
        self.queue.put_nowait(None)  # the end of what the test delivers

    # the offset oracle
    async def starts_and_done(
        self, tps: list[tuple[str, int]]
    ) -> dict[tuple[str, int], tuple[int, set[int]]]:
        return {tp: (self.offsets[0], set()) for tp in tps}

    async def held_from(
        self, topic: str, partition: int, offset: int, max_records: int = 500, *, known_later: bool = False
    ) -> list[int]:
        self.probes.append(offset)
        return [o for o in self.offsets if o >= offset][:max_records]

    # the agent's stream (``noack().events()``, as agents.runtime.unacked reads it)
    def stream(self) -> Any:
        return SimpleNamespace(noack=lambda: SimpleNamespace(events=self.events))

    async def events(self) -> AsyncIterator[Any]:
        while (offset := await self.queue.get()) is not None:
            msg = SimpleNamespace(tp=TP0, topic=TOPIC, partition=0, offset=offset)
            yield SimpleNamespace(message=msg)


async def _read(log: _Log, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The offsets the stage's reader (``RiskAgents.run_stage``, with the worker's Acker) hands to
    its processor, in the order it hands them."""
    acker = Acker(SimpleNamespace(consumer=log), oracle=log)  # type: ignore[arg-type]
    taken: list[int] = []

    class _Batches:
        def __init__(self, max_records: int) -> None:
            pass

        async def put(self, t: Taken) -> None:
            taken.append(t.event.message.offset)

    async def idle(kind: str, batches: Any) -> None:
        await asyncio.Future()

    async def no_wait() -> None:
        return None

    monkeypatch.setattr(risk_module, "_Batches", _Batches)
    agents = SimpleNamespace(
        rt=SimpleNamespace(acker=acker, lifecycle=SimpleNamespace(hold_if_stopping=no_wait)),
        s=Settings(),
        gate=InOrderGate(),
        _buffers={},
        _process_loop=idle,
    )
    agents._in_order = functools.partial(RiskAgents._in_order, agents)
    # the stream ends after a seek's delivery; a reader that never seeks back is stopped after 2 s
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(RiskAgents.run_stage(agents, "account", log.stream()), 2)  # type: ignore[arg-type]
    return taken


async def test_a_record_delivered_past_one_not_taken_waits_for_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # 22 was thrown away with a stream buffer; 23 and 24 came from the fetch position past it
    log = _Log(offsets=list(range(20, 26)), first=[20, 21, 23, 24])
    assert await _read(log, monkeypatch) == [20, 21, 22, 23, 24, 25]
    assert log.probes == [22]  # asked once: 24 came while the partition was read again from 22
    assert log.seeks == [22]


async def test_a_gap_the_log_does_not_hold_is_stepped_over_without_reading_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 22 is a transaction marker: no record there
    log = _Log(offsets=[20, 21, 23, 24], first=[20, 21, 23, 24, None])
    assert await _read(log, monkeypatch) == [20, 21, 23, 24]
    assert log.probes == [22] and log.seeks == []


async def test_a_producer_writing_a_transaction_per_record_costs_one_question_per_fetch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # records at even offsets, a marker after each: every record lies past a gap
    log = _Log(offsets=list(range(20, 60, 2)), first=[*range(20, 60, 2), None])
    assert await _read(log, monkeypatch) == list(range(20, 60, 2))
    assert log.probes == [21] and log.seeks == [], "one answer covered every later gap"


async def test_the_first_record_past_the_committed_offset_waits_for_the_ones_before_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # the returning worker's first delivery after the rebalance: 94 before its committed 93
    log = _Log(offsets=[93, 94, 95], first=[94, 95])
    assert await _read(log, monkeypatch) == [93, 94, 95]
