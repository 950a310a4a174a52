"""Two risk workers, one SIGKILLed under load and started again; a rolling restart (SIGTERM) of one.
Every event still gets a decision, every decision's features equal the brute-force recomputation,
and the rolling restart repeats no decision (docs/architecture.md, "Risk: takeover").

The survivor takes over the killed worker's partitions in a rebalance that comes while it has
batches in flight on its own, and gives half back when the other returns: a batch a rebalance
overtook must neither be committed past (Faust's own ack bookkeeping did: events were never decided
in 2 of 8 runs of this test's first half and 1 of 2 of the whole test) nor write the states of a partition that has moved."""

from __future__ import annotations

import asyncio
import shutil
import time
from typing import Any

import pytest

from agents.risk import ensure_risk_topics
from pipeline.risk.simulate import SimConfig, as_event, disorder, simulate
from pipeline.riskops import RISK_READY
from tests.test_risk_integration import assert_all_decided_as_recomputed, event, risk_client

pytestmark = [pytest.mark.integration, pytest.mark.heavy]


async def test_sigkill_of_one_of_two_risk_workers_then_its_return_leaves_no_event_undecided(
    deployment: Any,
) -> None:
    d = deployment(session_timeout_s=6)
    await ensure_risk_topics(d.settings)
    a = d.worker(role="risk", wait=False, worker_id="a")
    b = d.worker(role="risk", wait=False, worker_id="b", data_dir=str(d.tmp / "data-b"))
    for w in (a, b):
        await asyncio.to_thread(w.wait_ready, RISK_READY, 180)
    c = await risk_client(d)
    events = [as_event(e) for e in simulate(SimConfig(customers=80, days=1, seed=17, fraud_scale=20))][:700]
    events = disorder(events, share=0.05, late_share=0.0, grace_ms=5_000, seed=3)
    kill_at, back_at = len(events) // 3, 2 * len(events) // 3
    futs = {}
    back = None
    for i, e in enumerate(events):
        futs[e["event_id"]] = await c.send(e)
        if i == kill_at:
            await c.producer.flush()
            b.kill()  # SIGKILL, with a burst in flight on both workers
            # the survivor takes every partition over once the killed worker's session times out
            await asyncio.sleep(8)
        elif i == back_at:
            # it comes back on its own store: partitions move away from the survivor under load
            back = d.worker(role="risk", wait=False, worker_id="b", data_dir=str(d.tmp / "data-b"))
        elif back is not None:  # paced: the returning worker joins while these are being decided
            await asyncio.sleep(0.06)
        elif i % 25 == 0:
            await asyncio.sleep(0.02)
    await c.producer.flush()
    assert back is not None
    await asyncio.to_thread(back.wait_ready, RISK_READY, 180)
    await assert_all_decided_as_recomputed(d, c, futs)
    # the survivor took part in the first assignment, the takeover and the give-back at least
    status = await asyncio.to_thread(a.status)
    assert status["assignments"] >= 3, status
    assert status["unacked_by_partition"] == {}, status  # every record it read is finished


async def test_sigterm_under_load_drains_commits_and_repeats_no_decision(deployment: Any) -> None:
    """A rolling restart of the only risk worker: SIGTERM under load drains what was read, commits
    and leaves; the next worker goes on from there, so no event is decided twice."""
    d = deployment()
    await ensure_risk_topics(d.settings)
    first = d.worker(role="risk", wait=False)
    await asyncio.to_thread(first.wait_ready, RISK_READY, 180)
    c = await risk_client(d)
    events = [as_event(e) for e in simulate(SimConfig(customers=80, days=1, seed=19, fraud_scale=20))][:600]
    stop_at = len(events) // 2
    futs = {}
    for i, e in enumerate(events):
        futs[e["event_id"]] = await c.send(e)
        if i == stop_at:
            await c.producer.flush()
            in_flight = stop_at + 1 - len(c.decisions)
            first.terminate()  # SIGTERM
            assert await asyncio.to_thread(first.wait_exit, 60) == 0
            second = d.worker(role="risk", wait=False)
            await asyncio.to_thread(second.wait_ready, RISK_READY, 180)
        elif i % 25 == 0 and not stop_at - 100 < i < stop_at:  # a burst just before the SIGTERM
            await asyncio.sleep(0.02)
    await c.producer.flush()
    assert in_flight > 0, "nothing was in flight at the SIGTERM"
    report = await assert_all_decided_as_recomputed(d, c, futs)
    assert report["repeated_decisions"] == 0, report


async def test_a_sigkill_before_the_commit_reads_more_than_the_dedup_window_again_and_counts_it_once(
    deployment: Any,
) -> None:
    """Killed after its states reached the changelog and before its offsets were committed, a worker
    leaves its successor every record since the last commit to read again: far more, for a busy
    entity, than the 16 event ids it remembers. Each stage skips what its entity's position says it
    took (docs/architecture.md, "Risk: takeover"): no event counted twice, none called late, no
    decision repeated with other features."""
    # no commit within the test: the successor reads everything again
    d = deployment(commit_interval_ms=60_000)
    await ensure_risk_topics(d.settings)
    first = d.worker(role="risk", wait=False)
    await asyncio.to_thread(first.wait_ready, RISK_READY, 180)
    c = await risk_client(d)
    t0 = (int(time.time() * 1000) // 60_000 - 30) * 60_000
    # one account, card, device and ip, 40 events a second apart: every stage's entity takes all 40
    events = [
        event(f"burst-{i}", "acct-hot", t0 + 1_000 * i, device="dev-hot", ip="10.9.9.9", amount=3.0 + i)
        for i in range(40)
    ]
    futs = {e["event_id"]: await c.send(e) for e in events}
    await c.producer.flush()
    await asyncio.wait_for(asyncio.gather(*futs.values()), 60)
    while (await asyncio.to_thread(first.status))["unacked_by_partition"]:  # noqa: ASYNC110
        await asyncio.sleep(0.1)  # every state written and on the changelog, nothing committed
    first.kill()  # SIGKILL
    shutil.rmtree(d.env["SURGE_DATA_DIR"], ignore_errors=True)  # the states come from the changelog
    second = d.worker(role="risk", wait=False)
    await asyncio.to_thread(second.wait_ready, RISK_READY, 180)
    last = event("burst-40", "acct-hot", t0 + 40_000, device="dev-hot", ip="10.9.9.9", amount=43.0)
    futs[last["event_id"]] = await c.send(last)
    await c.producer.flush()
    decision = await asyncio.wait_for(futs[last["event_id"]], 60)
    for kind in ("account", "card", "device", "ip"):  # the 40 before it, each once
        assert decision.features[f"{kind}_count_1h"] == 40, decision.features
    report = await assert_all_decided_as_recomputed(d, c, futs)  # and no repeat that differs
    status = await asyncio.to_thread(second.status)
    assert status["reread_skipped"] == 4 * 40, status  # each stage read its 40 again and skipped them
    assert report["missing"] == 0
