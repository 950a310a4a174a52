"""``surge replay``: recorded topic history through an isolated pipeline, compared with live
(docs/architecture.md, "Replay").

1. Find the range by record timestamp (``offsets_for_times``) with a consumer that has no group and
   commits nothing.
2. Create the replay's own topics (prefix ``<prefix>replay.<id>.``; the copied input keeps its records
   forever, whatever their age) and start a worker with the replay's app id, prefix, state folder,
   :data:`pipeline.replay.plan.REPLAY_DEFAULTS`, the model and ``--set`` settings, at a lower CPU
   priority (``SURGE_REPLAY_NICE``).
3. Copy the range into the replay's input topic, partition for partition, key, value and timestamp
   kept, except a request's ``reply_to`` (the replay's replies topic), throttled to
   ``SURGE_REPLAY_RATE_PER_S``. Risk events: the 24 h before ``--from`` first (warm-up, not compared),
   and the live rules.
4. Collect the replay's replies (or decisions), read the live ones for the same ids, compare, write
   ``report.json``, ``report.png`` and print a summary; delete the replay's topics.

The only topics it writes are its own (:meth:`ReplayNames.owns` is checked before each copy).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import secrets
import shutil
import sys
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError
from tqdm import tqdm

from pipeline.auth import request_signers
from pipeline.client import TopicReader, partitions_of
from pipeline.compat import READ_COMMITTED, track_sent_topics
from pipeline.devtools.broker import free_port
from pipeline.devtools.deployment import load_settings
from pipeline.devtools.procs import WorkerProcess
from pipeline.kafka_security import client_options
from pipeline.records import now_ms
from pipeline.replay import compare, plan
from pipeline.replay.plan import (
    Copy,
    PartitionRange,
    ReplayError,
    ReplayLabelsError,
    ReplayNames,
    Throttle,
)
from pipeline.replyto import ReplyToPolicy
from pipeline.risk.stages import key_partition
from pipeline.risk_client import read_rule_records
from pipeline.settings import Settings
from pipeline.topics import TopicNames

log = logging.getLogger("surge.replay")

READY = {"all": "surge worker ready", "risk": "surge risk ready"}


@dataclass(kw_only=True)
class CandidateOptions:
    """The candidate worker a replay or a shadow runs, and how it is fed: what ``surge replay`` and
    ``surge shadow`` are both asked."""

    #: the candidate's model (None: the live one)
    model: str | None = None
    #: candidate settings by field name (``--set``)
    sets: dict[str, str] = field(default_factory=dict)
    #: a cache mode of :data:`pipeline.replay.plan.CACHE_MODES`
    caches: str = "exact"
    out_dir: Path | None = None
    #: records/s copied at most (None: ``SURGE_REPLAY_RATE_PER_S``)
    rate_per_s: float | None = None
    quiet: bool = False
    #: how long to wait for the worker to be ready, seconds
    start_timeout_s: float = 300.0

    def rate(self, s: Settings) -> float:
        """Records/s the copy runs at most (0: no limit)."""
        return s.replay_rate_per_s if self.rate_per_s is None else self.rate_per_s

    def changed(self, s: Settings) -> list[str]:
        """The settings in which the candidate differs from the live settings ``s``."""
        return plan.changed_settings(self.model, s.model, self.sets)

    def worker_env(
        self, s: Settings, names: ReplayNames, out_dir: Path, *, partitions: int, role: str
    ) -> dict[str, str]:
        """The candidate worker's environment: its own names, state folder (:func:`state_dir`) and
        web port, the live settings ``s``, this model, cache mode and ``--set`` settings."""
        env = plan.worker_env(
            names,
            broker=s.broker,
            data_dir=str(state_dir(out_dir).absolute()),
            partitions=partitions,
            role=role,
            model=self.model,
            sets=self.sets,
            caches=self.caches,
            live=live_settings_env(s),
        )
        env["SURGE_WEB_PORT"] = str(free_port())
        return env


@dataclass
class ReplayOptions(CandidateOptions):
    """What ``surge replay`` was asked to do."""

    topic: str
    from_ms: int
    to_ms: int
    replay_id: str | None = None
    keep_topics: bool = False
    labels_path: Path | None = None
    warmup: bool = True


@dataclass
class ReplayResult:
    report: dict[str, Any]
    report_path: Path
    plot_path: Path | None
    names: ReplayNames
    #: the replay's replies (or decisions) by key, as dicts
    replies: dict[Any, dict[str, Any]]


def state_dir(out_dir: Path) -> Path:
    """The candidate worker's state folder (its RocksDB tables) under ``out_dir``."""
    return out_dir / "state"


def clear_state(out_dir: Path) -> None:
    """Remove the state folder under ``out_dir`` before a candidate worker starts on it. Table stores
    are named by table, not by app id, so what an earlier replay or shadow left there (one that ran
    to the end and deleted its changelogs, or one interrupted) would be taken for this worker's
    tables, with offsets its new changelogs never reach: the worker would refuse to start. A fresh
    worker restores its tables from its own changelogs (docs/architecture.md, "Replay")."""
    shutil.rmtree(state_dir(out_dir), ignore_errors=True)


def groupless_consumer(s: Settings, **kw: Any) -> AIOKafkaConsumer:
    """A consumer with no group: it reads assigned partitions and never commits anything."""
    return AIOKafkaConsumer(
        bootstrap_servers=s.bootstrap_servers,
        group_id=None,
        enable_auto_commit=False,
        fetch_max_wait_ms=50,
        max_partition_fetch_bytes=4 << 20,
        # what the live workers read: an aborted transaction's records are not copied
        isolation_level=READ_COMMITTED,
        **client_options(s),
        **kw,
    )


async def locate(
    consumer: AIOKafkaConsumer, topic: str, from_ms: int, to_ms: int
) -> tuple[list[int], list[PartitionRange]]:
    """The partitions of ``topic`` and the offsets of ``[from_ms, to_ms)`` in each (``offsets_for_times``)."""
    parts = await partitions_of(consumer, topic)
    if not parts:
        raise ReplayError(f"topic {topic!r} does not exist on the cluster; nothing to replay")
    tps = [TopicPartition(topic, p) for p in parts]
    starts = await consumer.offsets_for_times({tp: from_ms for tp in tps})
    stops = await consumer.offsets_for_times({tp: to_ms for tp in tps})
    ends = await consumer.end_offsets(tps)
    ranges = plan.plan_ranges(
        {tp.partition: (o.offset if o is not None else None) for tp, o in starts.items()},
        {tp.partition: (o.offset if o is not None else None) for tp, o in stops.items()},
        {tp.partition: end for tp, end in ends.items()},
    )
    return parts, ranges


async def read_ranges(consumer: AIOKafkaConsumer, topic: str, ranges: Iterable[PartitionRange]) -> list[Any]:
    """Every record of ``ranges`` (offsets ``[start, end)`` per partition), in offset order per partition."""
    todo = {r.partition: r for r in ranges if r.count}
    if not todo:
        return []
    tps = {p: TopicPartition(topic, p) for p in todo}
    consumer.assign(list(tps.values()))
    for p, r in todo.items():
        consumer.seek(tps[p], r.start)
    out: list[Any] = []
    open_parts = set(todo)
    idle = 0
    while open_parts and idle < 100:
        batch = await consumer.getmany(*[tps[p] for p in open_parts], timeout_ms=200, max_records=5000)
        idle = 0 if batch else idle + 1
        for tp, records in batch.items():
            r = todo[tp.partition]
            out.extend(rec for rec in records if rec.offset < r.end)
        for p in list(open_parts):  # a partition may end in a gap (compaction, transaction markers)
            if await consumer.position(tps[p]) >= todo[p].end:
                open_parts.discard(p)
    if open_parts:
        raise ReplayError(f"could not read partitions {sorted(open_parts)} of {topic!r} to their range end")
    return out


async def read_since(s: Settings, topics: Iterable[str], since_ms: int) -> list[Any]:
    """Every record of ``topics`` with a timestamp from ``since_ms`` on (those that exist), no group."""
    consumer = groupless_consumer(s)
    out: list[Any] = []
    try:
        await consumer.start()
        for topic in sorted(set(topics)):
            parts = await partitions_of(consumer, topic, tries=5)
            if not parts:
                continue
            tps = [TopicPartition(topic, p) for p in parts]
            starts = await consumer.offsets_for_times({tp: since_ms for tp in tps})
            ends = await consumer.end_offsets(tps)
            ranges = [
                PartitionRange(tp.partition, starts[tp].offset if starts[tp] else ends[tp], ends[tp])
                for tp in tps
            ]
            out += await read_ranges(consumer, topic, ranges)
    finally:
        await consumer.stop()
    return out


async def create_own_topics(
    s: Settings, names: ReplayNames, topics: Mapping[str, dict[str, str]], partitions: int
) -> None:
    """Create the replay's topics with their configs (only names the replay owns)."""
    for name in topics:
        if not names.owns(name):
            raise ReplayError(f"refusing to create {name!r}: not a topic of replay {names.replay_id}")
    admin = AIOKafkaAdminClient(bootstrap_servers=s.bootstrap_servers, **client_options(s))
    try:
        await admin.start()
        existing = set(await admin.list_topics())
        new = [
            NewTopic(n, partitions, s.replication_factor, topic_configs=dict(c))
            for n, c in topics.items()
            if n not in existing
        ]
        if new:
            with contextlib.suppress(TopicAlreadyExistsError):
                await admin.create_topics(new)
    finally:
        await admin.close()


async def delete_own_topics(s: Settings, names: ReplayNames) -> list[str]:
    """Delete every topic the replay owns (its prefix or its app id); nothing else."""
    admin = AIOKafkaAdminClient(bootstrap_servers=s.bootstrap_servers, **client_options(s))
    try:
        await admin.start()
        mine = sorted(t for t in await admin.list_topics() if names.owns(t))
        if mine:
            await admin.delete_topics(mine)
        return mine
    finally:
        await admin.close()


class Collector(TopicReader):
    """Reads an output topic of the replay from the beginning (no group), keeping each key's first
    record and when it arrived (monotonic seconds)."""

    topic_kind = "output topic"

    def __init__(self, s: Settings, topic: str, key_of: Callable[[dict[str, Any]], Any]) -> None:
        super().__init__(groupless_consumer(s, auto_offset_reset="earliest"), topic, from_beginning=True)
        self.s = s
        self.key_of = key_of
        self.records: dict[Any, dict[str, Any]] = {}
        self.arrived: dict[Any, float] = {}
        self.changed = asyncio.Event()

    def _missing_topic(self) -> Exception:
        return ReplayError(f"{self.topic_kind} {self.topic!r} does not exist")

    async def _read(self) -> None:
        async for msg in self.consumer:
            try:
                data = json.loads(msg.value)
                key = self.key_of(data)
            except (ValueError, KeyError, TypeError):
                log.warning("undecodable record at %s[%d]@%d", msg.topic, msg.partition, msg.offset)
                continue
            if key not in self.records:
                self.records[key] = data
                self.arrived[key] = time.monotonic()
                self.changed.set()

    async def wait_for(self, keys: set[Any], idle_timeout_s: float, bar: tqdm | None = None) -> None:
        """Until every key of ``keys`` has a record, or nothing new came for ``idle_timeout_s``."""
        last = time.monotonic()
        done = 0
        while True:
            have = sum(1 for k in keys if k in self.records)
            if bar is not None and have > done:
                bar.update(have - done)
            if have > done:
                done, last = have, time.monotonic()
            if have >= len(keys):
                return
            if time.monotonic() - last > idle_timeout_s:
                return
            self.changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), 1.0)


def start_worker(env: Mapping[str, str], log_path: Path, role: str, nice: int) -> WorkerProcess:
    """A ``surge worker`` for the replay, at niceness ``nice`` (the OS serves live workers first)."""
    w = WorkerProcess(env, log_path, role=role)
    if nice > 0:
        w.argv = ["nice", "-n", str(nice), *w.argv]
    return w.start()


def live_settings_env(s: Settings) -> dict[str, str]:
    """The ``SURGE_*`` variables behind the live settings ``s`` (those not left at their default)."""
    return plan.live_env({name: getattr(s, name) for name in s.model_fields_set})


def request_key(reply: dict[str, Any]) -> tuple[str, str]:
    return (str(reply["user_id"]), str(reply["request_id"]))


def event_key(decision: dict[str, Any]) -> str:
    return str(decision["event_id"])


def load_labels(path: Path | None) -> dict[str, int]:
    """``event_id → label`` from a JSON-lines file written by ``surge risk simulate`` (objects without
    an ``event_id`` and a ``label``, such as its ``sim_config`` line, are skipped).

    Raises :class:`~pipeline.replay.plan.ReplayLabelsError` for a file that cannot be read, a line that
    is not a JSON object, or a label other than 0 or 1.
    """
    if path is None:
        return {}
    out: dict[str, int] = {}
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, start=1):
                line = line.strip()
                if not line:
                    continue
                try:
                    row = json.loads(line)
                except ValueError as e:
                    raise ReplayLabelsError(str(path), f"not JSON ({e})", n) from e
                if not isinstance(row, dict):
                    raise ReplayLabelsError(str(path), "not a JSON object", n)
                if "event_id" not in row or "label" not in row:
                    continue
                label = row["label"]
                if label not in (0, 1):
                    raise ReplayLabelsError(str(path), f"label {label!r} is not 0 or 1", n)
                out[str(row["event_id"])] = int(label)
    except OSError as e:
        raise ReplayLabelsError(str(path), f"cannot be read ({e.strerror or e})") from e
    except UnicodeDecodeError as e:
        raise ReplayLabelsError(str(path), "not UTF-8 text") from e
    return out


async def read_live_rules(s: Settings, topic: str) -> list[tuple[bytes | None, bytes | None]]:
    """The committed records of the live rules ``topic`` as ``(key, value)``, read as the risk workers
    read it (``read_committed``: a rule of an aborted or open transaction is never applied live, so
    it is not copied either); none if the topic does not exist."""
    return await read_rule_records(s.bootstrap_servers, topic, client_options(s), tries=5)


async def _copy(
    producer: AIOKafkaProducer,
    names: ReplayNames,
    target: str,
    records: list[tuple[Any, bytes]],
    throttle: Throttle,
    sent_at: dict[Any, float],
    bar: tqdm | None,
) -> None:
    """Copy ``(record, value)`` pairs to ``target``: same partition, key and timestamp."""
    if not names.owns(target):
        raise ReplayError(f"refusing to write {target!r}: not a topic of replay {names.replay_id}")
    pending = []
    for i, (rec, value) in enumerate(records):
        wait = throttle.delay()
        if wait > 0:
            await asyncio.sleep(wait)
        fut = await producer.send(
            target,
            value=value,
            key=rec.key,
            partition=rec.partition,
            timestamp_ms=rec.timestamp,
            headers=list(rec.headers or []),
        )
        key = getattr(rec, "_surge_key", None)
        if key is not None:
            sent_at.setdefault(key, time.monotonic())
        pending.append(fut)
        if len(pending) >= 500 or i == len(records) - 1:
            for f in pending:
                await f
            if bar is not None:
                bar.update(len(pending))
            pending = []


class _Rec:
    """A consumer record with the key the replay joins it on."""

    __slots__ = ("_surge_key", "headers", "key", "offset", "partition", "timestamp", "value")

    def __init__(self, rec: Any, key: Any, headers: Any = None) -> None:
        """``headers``: what the copy is sent with, when not the record's own (a rewritten request's)."""
        self.key, self.value, self.partition, self.offset = rec.key, rec.value, rec.partition, rec.offset
        self.timestamp, self.headers = rec.timestamp, rec.headers if headers is None else headers
        self._surge_key = key


async def run_replay(opts: ReplayOptions, settings: Settings | None = None) -> ReplayResult:
    """Replay ``opts`` against the cluster of ``settings`` (default: the environment's)."""
    s = settings or Settings.load()
    plan.check_range(opts.from_ms, opts.to_ms)
    if opts.topic not in plan.SOURCES:
        raise ReplayError(f"--topic {opts.topic!r}: one of {', '.join(plan.SOURCES)}")
    labels = load_labels(opts.labels_path)  # a bad file is refused before anything connects
    risk = opts.topic == "risk-events"
    rid = opts.replay_id or plan.new_replay_id(now_ms(), secrets.token_hex(3))
    names = ReplayNames(s.app_id, s.topic_prefix, rid)
    live_t, own_t = TopicNames(s.topic_prefix), names.topics
    source = live_t.risk_events if risk else live_t.requests
    target = own_t.risk_events if risk else own_t.requests
    out_dir = Path(opts.out_dir or f"replay-{rid}")
    await asyncio.to_thread(out_dir.mkdir, parents=True, exist_ok=True)
    rate = opts.rate(s)
    say = (lambda *_: None) if opts.quiet else (lambda m: print(m, file=sys.stderr, flush=True))

    consumer = groupless_consumer(s)
    try:
        await consumer.start()
        parts, ranges = await locate(consumer, source, opts.from_ms, opts.to_ms)
        records = await read_ranges(consumer, source, ranges)
        warm: list[Any] = []
        if risk and opts.warmup:
            _, warm_ranges = await locate(consumer, source, opts.from_ms - plan.RISK_WARMUP_MS, opts.from_ms)
            warm = await read_ranges(consumer, source, warm_ranges)
    finally:
        await consumer.stop()
    rules = await read_live_rules(s, live_t.risk_rules) if risk else []
    if not risk:
        dropped = plan.sent_on_originals(
            [(r.partition, r.key, r.value) for r in records], home=lambda key: key_partition(key, len(parts))
        )
        records = [r for i, r in enumerate(records) if i not in dropped]
    if not records:
        raise ReplayError(
            f"no records on {source!r} between {opts.from_ms} and {opts.to_ms} ms "
            f"({(opts.to_ms - opts.from_ms) / 1000:.0f} s); nothing to replay"
        )
    say(
        f"replay {rid}: {len(records)} records of {source} in range"
        + (f", {len(warm)} warm-up events from the 24 h before" if risk else "")
    )

    # the copies and the keys they are joined on
    live_policy = ReplyToPolicy(live_t, s.app_id, s.reply_topic_pattern)
    # a copy's reply_to is rewritten: one live signed, the replay signs again with the same key
    signers = request_signers(s)
    copies: list[tuple[Any, bytes]] = []
    live_reply_topics: set[str] = set()
    expected: list[Any] = []
    for rec in records:
        if risk:
            ids = _event_id(rec.value)
            copies.append((_Rec(rec, ids), rec.value))
            if ids is not None:
                expected.append(ids)
        else:
            c: Copy = plan.rewrite_request(rec.value, own_t.replies, live_policy, rec.headers, signers)
            copies.append((_Rec(rec, c.ids, c.headers), c.value))
            if c.ids is not None:
                expected.append(c.ids)
                if c.live_reply_topic:
                    live_reply_topics.add(c.live_reply_topic)
    warm_copies = [(_Rec(rec, None), rec.value) for rec in warm]

    role = "risk" if risk else "all"
    env = opts.worker_env(s, names, out_dir, partitions=len(parts), role=role)
    replay_settings = load_settings(env)
    changed = opts.changed(s)
    keep_forever = {"retention.ms": "-1"}
    own = {target: keep_forever}
    deleted: list[str] | None = None  # the replay's topics, once deleted at the end
    try:
        await create_own_topics(s, names, own, len(parts))
        from pipeline.admin import ensure_topics

        if risk:
            from agents.risk import ensure_risk_topics

            await ensure_risk_topics(replay_settings)
        else:
            await ensure_topics(replay_settings, broker_time=False)  # the copies keep their timestamps

        out_topic = own_t.risk_decisions if risk else own_t.replies
        collector = Collector(s, out_topic, event_key if risk else request_key)
        worker: WorkerProcess | None = None
        producer = AIOKafkaProducer(
            bootstrap_servers=s.bootstrap_servers,
            acks="all",
            linger_ms=5,
            max_request_size=8 << 20,
            **client_options(s),
        )
        track_sent_topics(producer)
        sent_at: dict[Any, float] = {}
        t0 = time.monotonic()
        try:
            await producer.start()
            if rules:
                if not names.owns(own_t.risk_rules):
                    raise ReplayError(f"refusing to write {own_t.risk_rules!r}")
                for rule_key, rule_value in rules:
                    await producer.send_and_wait(own_t.risk_rules, value=rule_value, key=rule_key)
            await collector.start()
            say(f"starting the replay worker (app id {names.app_id}, prefix {names.prefix}) ...")
            await asyncio.to_thread(clear_state, out_dir)
            worker = start_worker(env, out_dir / "worker.log", role, s.replay_nice)
            await asyncio.to_thread(worker.wait_ready, READY[role], opts.start_timeout_s)
            ready_s = time.monotonic() - t0
            bar = (
                None if opts.quiet else tqdm(total=len(copies) + len(warm_copies), desc="copied", unit="rec")
            )
            throttle = Throttle(rate, time.monotonic)
            t_copy = time.monotonic()
            await _copy(producer, names, target, warm_copies, throttle, {}, bar)
            await _copy(producer, names, target, copies, throttle, sent_at, bar)
            if bar is not None:
                bar.close()
            want = set(expected)
            rbar = None if opts.quiet else tqdm(total=len(want), desc="replies", unit="rec")
            await collector.wait_for(want, s.replay_idle_timeout_s, rbar)
            if rbar is not None:
                rbar.close()
            t_done = max(
                [collector.arrived[k] for k in want if k in collector.arrived], default=time.monotonic()
            )
        finally:
            await collector.stop()
            await producer.stop()
            if worker is not None:
                await asyncio.to_thread(worker.stop)
        replies = {k: v for k, v in collector.records.items() if k in set(expected)}
        latency = {k: (collector.arrived[k] - sent_at[k]) * 1000 for k in replies if k in sent_at}

        # what live traffic got, read without a group
        if risk:
            live_out = await read_since(s, [live_t.risk_decisions], opts.from_ms)
        else:
            live_out = await read_since(s, live_reply_topics or {live_t.replies}, opts.from_ms)
        live: dict[Any, dict[str, Any]] = {}
        want = set(expected)
        for rec in live_out:
            try:
                data = json.loads(rec.value)
                key = event_key(data) if risk else request_key(data)
            except (ValueError, KeyError, TypeError):
                continue
            if key in want and key not in live:
                live[key] = data
        if risk:
            report = compare.compare_risk(
                expected, live, replies, replay_latency_ms=latency, labels=labels, changed=changed
            )
        else:
            report = compare.compare_requests(
                expected, live, replies, replay_latency_ms=latency, changed=changed
            )

        span_s = (opts.to_ms - opts.from_ms) / 1000
        stamps = [r.timestamp for r in records]
        processing_s = max(1e-3, t_done - t_copy)
        report["replay"] = {
            "id": rid,
            "app_id": names.app_id,
            "topic_prefix": names.prefix,
            "source_topic": source,
            "from_ms": opts.from_ms,
            "to_ms": opts.to_ms,
            "records": len(records),
            "warmup_records": len(warm),
            "partitions": len(parts),
            "model": replay_settings.served_model,
            "sets": opts.sets,
            "caches": opts.caches,
            "defaults": {
                k: v
                for k, v in {**plan.REPLAY_DEFAULTS, **plan.CACHE_MODES[opts.caches]}.items()
                if k not in opts.sets
            },
            "rate_limit_per_s": rate,
            "worker_start_s": round(ready_s, 2),
            "processing_s": round(processing_s, 3),
            "range_s": span_s,
            "recorded_span_s": round((max(stamps) - min(stamps)) / 1000, 3),
            "speed_factor": round(span_s / processing_s, 2),
            "speed_factor_with_start": round(span_s / (t_done - t0), 2),
            "live_reply_topics": sorted(live_reply_topics) if not risk else [live_t.risk_decisions],
        }
        if not opts.keep_topics:
            deleted = await delete_own_topics(s, names)
            report["replay"]["deleted_topics"] = deleted
    finally:
        if deleted is None and not opts.keep_topics:
            # a replay that failed at any step leaves nothing behind on the cluster either
            with contextlib.suppress(Exception):
                await delete_own_topics(s, names)
    report_path = out_dir / "report.json"
    report_path.write_text(json.dumps(compare.public(report), indent=2, default=str) + "\n", encoding="utf-8")
    from pipeline.replay.plot import plot_report

    plot_path = plot_report(report, out_dir / "report.png", title=f"surge replay {rid} ({opts.topic})")
    if not opts.quiet:
        for line in compare.summary_lines(report):
            print(line)
        r = report["replay"]
        print(
            f"range {r['range_s']:.0f} s replayed in {r['processing_s']:.1f} s = {r['speed_factor']}x real time "
            f"({r['speed_factor_with_start']}x with the worker's {r['worker_start_s']:.0f} s start)"
        )
        print(f"report: {report_path}  plot: {plot_path}")
    return ReplayResult(report, report_path, plot_path, names, replies)


def _event_id(raw: bytes | None) -> str | None:
    from pipeline.risk.records import salvage_event_ids

    ids = salvage_event_ids(raw)
    return None if ids is None else ids[0]


def run(opts: ReplayOptions) -> ReplayResult:
    """Blocking entry point of ``surge replay``."""
    os.environ.setdefault("TQDM_MININTERVAL", "1")
    return asyncio.run(run_replay(opts))
