"""``surge shadow`` without a broker (pipeline/replay/shadow.py; docs/architecture.md, "Replay"): fakes
stand in for the Kafka clients and the candidate worker, so what the shadow does around them (its
READY file, watching its tasks, committing the sampler's offsets) is tested in a second.
The shadow against the real broker is in tests/test_replay_integration.py."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from aiokafka import TopicPartition

from pipeline.exceptions import SurgeError
from pipeline.replay import plan
from pipeline.replay import shadow as shadow_mod
from pipeline.replay.plan import ShadowTaskError
from pipeline.replay.shadow import Shadow, ShadowOptions
from pipeline.settings import Settings

TP = TopicPartition("surge.requests", 0)


class _Worker:
    """The candidate worker: ready at once."""

    def wait_ready(self, *_: Any) -> None:
        pass

    def stop(self) -> None:
        pass


async def _nothing(*_: Any, **__: Any) -> None:
    return None


def _shadow(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, **opts: Any) -> Shadow:
    """A shadow whose topics, candidate worker and reply collector are fakes."""
    monkeypatch.setattr(shadow_mod, "ensure_topics", _nothing)
    monkeypatch.setattr(shadow_mod, "clear_state", lambda _out: None)
    monkeypatch.setattr(shadow_mod, "start_worker", lambda *_a, **_k: _Worker())
    s = Settings.load(broker="kafka://127.0.0.1:1")
    sh = Shadow(ShadowOptions(percent=100, out_dir=tmp_path / "out", quiet=True, **opts), s, partitions=1)
    monkeypatch.setattr(sh.collector, "start", _nothing)
    # never started, its consumer is still closed: left open, aiokafka warned "Unclosed
    # AIOKafkaConsumer" as the test process exited
    monkeypatch.setattr(sh.collector, "stop", sh.collector.consumer.stop)
    return sh


async def _until(check: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


async def test_the_ready_file_says_whether_this_run_is_ready(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A READY an earlier run left in the folder is removed when the shadow starts (a script waiting
    for it would otherwise send before the shadow reads), written once it mirrors, removed at exit."""
    sh = _shadow(tmp_path, monkeypatch, duration_s=0.5)
    ready_file = tmp_path / "out" / "READY"
    ready_file.write_text("ready\n")  # left by an earlier run
    release = asyncio.Event()

    async def sample(ready: asyncio.Event) -> None:
        await release.wait()
        ready.set()
        await sh.stop.wait()

    async def read_live(ready: asyncio.Event) -> None:
        ready.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(sh, "_sample", sample)
    monkeypatch.setattr(sh, "_read_live", read_live)
    task = asyncio.create_task(sh.run())
    try:
        await asyncio.sleep(0.3)
        assert not ready_file.exists()  # starting, not ready
        release.set()
        await _until(ready_file.exists)
        report = await asyncio.wait_for(task, 10)
    finally:
        task.cancel()
    assert report["shadow"]["final"] and report["shadow"]["error"] is None
    assert not ready_file.exists()


async def test_a_shadow_that_fails_before_it_starts_closes_its_reply_collector(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The reply collector's consumer is made with the shadow; a shadow whose topics cannot be made
    (the broker unreachable) still closes it."""
    sh = _shadow(tmp_path, monkeypatch)

    async def unreachable(*_a: Any, **_k: Any) -> None:
        raise OSError("broker unreachable")

    stopped: list[bool] = []
    close = sh.collector.consumer.stop

    async def stop() -> None:
        stopped.append(True)
        await close()

    monkeypatch.setattr(shadow_mod, "ensure_topics", unreachable)
    monkeypatch.setattr(sh.collector, "stop", stop)
    with pytest.raises(OSError, match="broker unreachable"):
        await sh.run()
    assert stopped, "the collector's consumer was left open"


@pytest.mark.parametrize("before_ready", [False, True])
async def test_a_failing_sampler_stops_the_shadow_with_its_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, before_ready: bool
) -> None:
    """The sampler's error is not swallowed: the shadow stops at once (not at --duration-s, nor after
    the 60 s it waits for readiness), writes its final report with the error, and raises a typed error
    (``surge`` exits 2)."""
    sh = _shadow(tmp_path, monkeypatch, duration_s=60)

    async def sample(ready: asyncio.Event) -> None:
        if not before_ready:
            ready.set()
            await asyncio.sleep(0.3)
        raise RuntimeError("broker gone")

    async def read_live(ready: asyncio.Event) -> None:
        ready.set()
        await asyncio.Event().wait()

    monkeypatch.setattr(sh, "_sample", sample)
    monkeypatch.setattr(sh, "_read_live", read_live)
    with pytest.raises(ShadowTaskError, match="sampler failed: RuntimeError: broker gone") as err:
        await asyncio.wait_for(sh.run(), 10)
    assert isinstance(err.value, SurgeError) and err.value.task == "sampler"
    report = json.loads((tmp_path / "out" / "shadow.json").read_text())
    assert report["shadow"]["final"] and "broker gone" in report["shadow"]["error"]
    assert not (tmp_path / "out" / "READY").exists()


async def test_a_failing_live_reply_reader_stops_the_shadow(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sh = _shadow(tmp_path, monkeypatch)  # no --duration-s: it would run until SIGINT

    async def sample(ready: asyncio.Event) -> None:
        ready.set()
        await sh.stop.wait()

    async def read_live(ready: asyncio.Event) -> None:
        ready.set()
        await asyncio.sleep(0.2)
        raise OSError("no route to host")

    monkeypatch.setattr(sh, "_sample", sample)
    monkeypatch.setattr(sh, "_read_live", read_live)
    with pytest.raises(ShadowTaskError, match="live-reply reader failed: OSError: no route to host"):
        await asyncio.wait_for(sh.run(), 10)


class _Consumer:
    """The sampler's consumer: one partition, at offset 0 of 4, one batch of records."""

    def __init__(self, *topics: str, **kw: Any) -> None:
        self.kw = kw
        self.commits: list[dict[TopicPartition, int]] = []
        values = [
            json.dumps({"request_id": f"r{i}", "user_id": "u", "prompt": "q"}).encode() for i in range(3)
        ]
        self.batches = [
            {
                TP: [
                    SimpleNamespace(key=b"u", value=v, partition=0, offset=i, timestamp=1000 + i, headers=())
                    for i, v in enumerate([*values, b"not json"])
                ]
            }
        ]

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def assignment(self) -> set[TopicPartition]:
        return {TP}

    async def position(self, tp: TopicPartition) -> int:
        return 0

    async def end_offsets(self, tps: list[TopicPartition]) -> dict[TopicPartition, int]:
        return dict.fromkeys(tps, 4)

    async def getmany(self, timeout_ms: int, max_records: int) -> dict[TopicPartition, list[Any]]:
        if self.batches:
            return self.batches.pop(0)
        await asyncio.sleep(timeout_ms / 1000)
        return {}

    async def commit(self, offsets: dict[TopicPartition, int]) -> None:
        self.commits.append(dict(offsets))


class _Producer:
    """Sends are acknowledged when the test says so."""

    def __init__(self, **kw: Any) -> None:
        self.acks: list[asyncio.Future[None]] = []

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def send(self, topic: str, **kw: Any) -> asyncio.Future[None]:
        self.acks.append(asyncio.get_running_loop().create_future())
        return self.acks[-1]


async def test_the_sampler_commits_a_record_only_once_its_copy_is_acknowledged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An auto-commit could commit records whose copies a crash then lost, and the restarted shadow
    would skip them: the sampler commits its start position (so a restart resumes there), then each
    batch after every copy of it is acknowledged. The live-reply reader starts from the timestamp of
    the first request the sampler has yet to read."""
    made: dict[str, Any] = {}

    def consumer(*topics: str, **kw: Any) -> _Consumer:
        made["consumer"] = _Consumer(*topics, **kw)
        return made["consumer"]

    def producer(**kw: Any) -> _Producer:
        made["producer"] = _Producer(**kw)
        return made["producer"]

    async def first_timestamps(
        _s: Settings, positions: dict[TopicPartition, int]
    ) -> dict[TopicPartition, int]:
        assert positions == {TP: 0}  # behind: 4 records unread
        return {TP: 1000}

    monkeypatch.setattr(shadow_mod, "AIOKafkaConsumer", consumer)
    monkeypatch.setattr(shadow_mod, "AIOKafkaProducer", producer)
    monkeypatch.setattr(shadow_mod, "track_sent_topics", lambda _p: None)
    monkeypatch.setattr(shadow_mod, "first_timestamps", first_timestamps, raising=False)
    sh = _shadow(tmp_path, monkeypatch, rate_per_s=0.0)
    ready = asyncio.Event()
    task = asyncio.create_task(sh._sample(ready))
    try:
        await asyncio.wait_for(ready.wait(), 5)
        c, p = made["consumer"], made["producer"]
        assert c.kw["enable_auto_commit"] is False
        assert c.commits == [{TP: 0}]  # where it starts
        assert sh.live_from_ms == 1000 - plan.LIVE_REPLY_SKEW_MS
        await _until(lambda: len(p.acks) == 3)
        await asyncio.sleep(0.3)
        assert c.commits == [{TP: 0}]  # nothing past a copy not yet acknowledged
        for ack in p.acks:
            ack.set_result(None)
        await _until(lambda: len(c.commits) == 2)
        assert c.commits[-1] == {TP: 4}  # the undecodable record too: nothing to copy
        assert sh.counts == {"read": 4, "sampled": 3, "copied": 3}
        sh.stop.set()
        await asyncio.wait_for(task, 5)  # a stopped sampler returns
    finally:
        task.cancel()
        await sh.collector.stop()  # made with the shadow, whose run this test leaves out
