"""The Acker's commits: what they carry, and that one the broker never answers holds nothing up."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from faust.types import TP

import agents.acks as acks
from agents.acks import Acker
from pipeline.offsets import PartitionLedger, decode_done


def _acker_with_a_hole() -> tuple[Acker, TP]:
    """An Acker whose partition released offsets 10-11, holds 12 unfinished and finished 13."""
    app = SimpleNamespace(consumer=None)  # commit_offsets is replaced in these tests
    acker = Acker(app=app)  # type: ignore[arg-type]
    tp = TP("work.batch", 3)
    ledger: PartitionLedger[None] = PartitionLedger(10)
    for offset in range(10, 14):
        ledger.read(offset, None)
    for offset in (10, 11, 13):
        ledger.finish(offset)
    acker._ledgers[tp] = ledger
    return acker, tp


async def test_a_commit_names_what_is_finished_past_the_committed_offset(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sent: list[dict[Any, tuple[int, str]]] = []

    async def commit(consumer: Any, offsets: dict[Any, tuple[int, str]]) -> bool:
        sent.append(dict(offsets))
        return True

    monkeypatch.setattr(acks, "commit_offsets", commit)
    acker, _ = _acker_with_a_hole()
    assert await acker.commit()
    ((offset, metadata),) = sent[0].values()
    assert offset == 12 and decode_done(metadata, offset) == {13}
    assert await acker.commit() and len(sent) == 1, "nothing changed: nothing sent again"


async def test_a_commit_the_broker_never_answers_does_not_hold_a_drain(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While the group coordinator is away (a broker restart) the client retries a commit for as
    long as it takes; a rebalance's drain, and with it the whole group, must not wait for that."""

    async def never(consumer: Any, offsets: Any) -> bool:
        await asyncio.Event().wait()
        return True

    monkeypatch.setattr(acks, "commit_offsets", never)
    monkeypatch.setattr(acks, "COMMIT_TIMEOUT_S", 0.2)
    acker, _ = _acker_with_a_hole()
    assert await asyncio.wait_for(acker.commit(), 5) is False


def test_status_shows_where_an_unfinished_record_holds_its_partition() -> None:
    """``/status`` names each partition with records in flight, the oldest unfinished offset (what
    a stuck record is) and the last one read; partitions with nothing in flight are left out."""
    acker, _ = _acker_with_a_hole()
    idle: PartitionLedger[None] = PartitionLedger(0)
    idle.read(0, None)
    idle.finish(0)
    acker._ledgers[TP("work.batch", 0)] = idle
    assert acker.describe() == {
        "work.batch[3]": {"in_flight": 1, "next_release": 12, "oldest_unfinished": 12, "last_read": 13}
    }
