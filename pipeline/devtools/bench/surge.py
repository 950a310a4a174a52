"""``surge bench surge``: the default path in open-loop steps around the model-alone limit L.

Default path: the FAQ answerer over MiniLM, exact and semantic caches and merging on, rate limits on,
degradation on, one worker, the class deadlines of the settings. Nothing is relaxed for the benchmark
except that users and tenants are spread so that no user or tenant exceeds its rate (a refusal is
then a finding, not the workload's doing).

Workload (:class:`QuestionStream`): questions the answerer was not trained on, the held-out rows of
banking77 (:func:`models.faq_train.split_banking77`, 15%, seed 77; the CSV is read only here; the few
held-out rows that repeat a training question are left out), in the
merging workload's mix: 50% unique questions, 30% exact repeats of an earlier one, 20% light edits of
one (:func:`pipeline.devtools.bench.merging.light_edit`). The held-out rows (~1500) run out after a few
thousand requests; each later pass over them adds a customer's own detail (an order, card or ticket
number, distinct per question), which the dedup guard treats as a different question, so a unique
question keeps costing a model call, as in a real surge. Classes realtime:interactive:batch:offline
1:4:4:1, tiers free:standard:premium 2:7:1 (free-tier interactive work is what level 3 may template).

Steps: first L, questions/s of the FAQ answerer alone (embed + classify, batches of its own
``max_batch_size``, in this process, one torch thread like the worker, on held-out questions, as
``surge faq eval`` runs it). Then open loop, a plain aiokafka producer sending on a schedule
whatever the replies do: 0.5 L for 30 s, 0.8 L for 60 s, 2 L for 60 s, 0.5 L for 60 s, then a drain.
``--quick``: 5 s steps at a quarter of those rates.

Measured: every reply record on the reply topic (a plain consumer on all partitions, not the one the
pipeline uses), latency from ``created_at`` (the request's scheduled send time, so a sender that falls
behind is not hidden) to the reply's arrival; the pipeline's consumer-group lag on its input topics
every second (the backlog waiting in Kafka); the worker's
``/metrics`` every 0.5 s (``surge_degradation_level``, ``requests_queue_depth``,
``requests_in_queue_per_worker``) and the VmRSS of its process tree. Targets: see :func:`targets`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import random
import sys
import time
import urllib.request
from collections import Counter, defaultdict
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pipeline.client import partitions_of
from pipeline.compat import refresh_metadata, track_sent_topics
from pipeline.dedup import normalize
from pipeline.devtools.bench.background import Background, plain_consumer
from pipeline.devtools.bench.banking77 import copy_source, light_edit, resolve_csv, unseen_questions
from pipeline.devtools.bench.common import (
    BenchDeployment,
    BenchEnv,
    BenchError,
    BenchRun,
    latency_summary,
    scrape,
    target,
)
from pipeline.devtools.bench.report import figure, report
from pipeline.kafka_security import client_options
from pipeline.settings import PRIORITIES, Settings
from pipeline.topics import TopicNames

#: realtime:interactive:batch:offline
CLASS_MIX: tuple[tuple[str, float], ...] = (("realtime", 1), ("interactive", 4), ("batch", 4), ("offline", 1))
TIER_MIX: tuple[tuple[str, float], ...] = (("free", 2), ("standard", 7), ("premium", 1))
UNIQUE_SHARE, REPEAT_SHARE = 0.5, 0.3  # the rest are light edits
#: how a later pass over the held-out questions makes one a different customer's question
DETAILS = (
    "{q} My order number is {n}.",
    "{q} (card ending {n})",
    "Ticket {n}: {q}",
    "{q} Reference {n}.",
    "Account {n} here. {q}",
)
SCRAPE_INTERVAL_S = 0.5


# ---- workload ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Question:
    text: str
    intent: str
    kind: str  # unique | repeat | edit
    source: int | None  # index (in the stream) of the unique question a repeat or edit copies
    tenant: str


class QuestionStream:
    """An endless stream of held-out questions in the merging workload's mix (see the module doc)."""

    def __init__(
        self,
        rows: Sequence[tuple[str, str]],
        seed: int = 9,
        tenants: int = 1,
        exclude: Iterable[str] = (),
    ) -> None:
        """``rows``: held-out (text, intent) pairs; ``exclude``: normalised texts the answerer was trained
        on (a held-out row that repeats one of them is left out)."""
        self.rng = random.Random(seed)
        trained = set(exclude)
        seen: set[str] = set()
        self.excluded = 0
        self.pool: list[tuple[str, str]] = []
        for text, intent in rows:
            key = normalize(text)
            if key in trained:
                self.excluded += 1
            elif key and key not in seen:
                seen.add(key)
                self.pool.append((text, intent))
        if len(self.pool) < 50:
            raise BenchError(f"only {len(self.pool)} distinct held-out questions; at least 50 needed")
        self.rng.shuffle(self.pool)
        self.tenants = [f"t{i}" for i in range(tenants)] if tenants > 1 else ["default"]
        self.items: list[Question] = []
        self.unique_idx: list[int] = []
        self.pool_taken = 0

    def _new_unique(self) -> Question:
        k = self.pool_taken
        self.pool_taken += 1
        text, intent = self.pool[k % len(self.pool)]
        passes = k // len(self.pool)
        if passes:
            n = 1000 + (k * 7919) % 9000 if passes % 2 else 10000 + (k * 104729) % 90000
            text = self.rng.choice(DETAILS).format(q=text, n=n)
        tenant = self.tenants[len(self.unique_idx) % len(self.tenants)]
        return Question(text, intent, "unique", None, tenant)

    def next(self) -> Question:
        r = self.rng.random()
        if not self.unique_idx or r < UNIQUE_SHARE:
            q = self._new_unique()
            self.unique_idx.append(len(self.items))
        else:
            src = copy_source(self.rng, self.unique_idx)
            base = self.items[src]
            if r < UNIQUE_SHARE + REPEAT_SHARE:
                q = Question(base.text, base.intent, "repeat", src, base.tenant)
            else:
                q = Question(light_edit(base.text, self.rng), base.intent, "edit", src, base.tenant)
        self.items.append(q)
        return q


@dataclass
class Population:
    """Users per (tenant, tier), taken round robin so each user sends at an even pace below its rate."""

    users: dict[str, int]
    rng: random.Random = field(default_factory=lambda: random.Random(11))
    _turn: dict[tuple[str, str], int] = field(default_factory=dict)

    @classmethod
    def for_rate(cls, peak_rps: float, s: Settings) -> Population:
        total = sum(w for _, w in TIER_MIX)
        users = {}
        for tier, w in TIER_MIX:
            per_user = getattr(s, f"user_rate_per_s_{tier}")
            # each user at most 40% of its rate at the peak, at least 4 users per tier
            users[tier] = max(4, math.ceil(peak_rps * w / total / (0.4 * per_user)))
        return cls(users)

    def pick(self, tenant: str) -> tuple[str, str, str]:
        """(tier, priority, user_id) of the next request of ``tenant``."""
        tier = self.rng.choices([t for t, _ in TIER_MIX], [w for _, w in TIER_MIX])[0]
        cls_ = self.rng.choices([c for c, _ in CLASS_MIX], [w for _, w in CLASS_MIX])[0]
        k = self._turn.get((tenant, tier), 0)
        self._turn[(tenant, tier)] = k + 1
        return tier, cls_, f"{tenant}-{tier}-u{k % self.users[tier]}"


def tenants_for(peak_rps: float, s: Settings) -> int:
    """Tenants needed so that no tenant's per-partition bucket sees more than half its rate at the peak,
    allowing a 1.5x skew between partitions."""
    return max(1, math.ceil(3.0 * peak_rps / s.tenant_rate_per_s))


# ---- the model alone -----------------------------------------------------------------------------
def measure_limit(texts: Sequence[str], batches: int) -> dict[str, Any]:
    """Questions/s of the FAQ answerer alone on full batches (one warm-up batch first), one torch thread."""
    import torch

    from models.faq import FAQAnswerer

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        faq = FAQAnswerer()
        faq.load()
        size = faq.max_batch_size
        need = size * (batches + 1)
        pool = [texts[i % len(texts)] for i in range(need)]
        faq.probabilities(pool[:size])
        secs: list[float] = []
        for b in range(1, batches + 1):
            t0 = time.perf_counter()
            faq.probabilities(pool[b * size : (b + 1) * size])
            secs.append(time.perf_counter() - t0)
    finally:
        torch.set_num_threads(before)
    return {
        "questions_per_s": round(size * batches / sum(secs), 2),
        "batch_size": size,
        "batches": batches,
        "batch_seconds": [round(x, 3) for x in secs],
        "torch_threads": 1,
    }


# ---- processes -----------------------------------------------------------------------------------
def tree_pids(pid: int) -> list[int]:
    """``pid`` and its descendants (those still there)."""
    found: list[int] = []
    seen: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        try:
            for task in Path(f"/proc/{p}/task").iterdir():
                with contextlib.suppress(OSError):
                    todo.extend(int(c) for c in (task / "children").read_text().split())
        except (OSError, ValueError):
            continue
        found.append(p)
    return found


def tree_rss_kb(pid: int) -> int | None:
    """VmRSS of ``pid`` and its descendants, kB (None when it is gone)."""
    total, found = 0, False
    for p in tree_pids(pid):
        with contextlib.suppress(OSError, ValueError):
            for line in Path(f"/proc/{p}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
                    found = True
                    break
    return total if found else None


def tree_cpu_s(pid: int) -> float | None:
    """CPU seconds (user + system) ``pid`` and its descendants have used so far (None when gone)."""
    ticks, found = 0, False
    for p in tree_pids(pid):
        with contextlib.suppress(OSError, ValueError, IndexError):
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])  # utime, stime
            found = True
    return ticks / os.sysconf("SC_CLK_TCK") if found else None


def http_json(port: int, path: str, timeout_s: float = 1.0) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout_s) as r:
            return r.read().decode()
    except Exception:
        return None


@dataclass
class Sample:
    """One scrape of one worker."""

    t: float  # wall clock, s
    worker: str
    up: bool
    level: float | None = None
    depth: dict[str, float] = field(default_factory=dict)
    per_worker: float | None = None
    rss_kb: int | None = None
    cpu_s: float | None = None
    assigned: int | None = None


class Scraper(Background):
    """Scrapes ``/metrics`` (and ``/status`` when asked) of the workers ``targets()`` names, every 0.5 s."""

    def __init__(
        self, targets: Callable[[], Iterable[tuple[str, int, int | None]]], with_status: bool = False
    ) -> None:
        super().__init__()
        self.targets = targets  # (name, web port, pid or None)
        self.with_status = with_status
        self.samples: list[Sample] = []

    def _one(self, name: str, port: int, pid: int | None) -> Sample:
        t = time.time()
        text = http_json(port, "/metrics")
        s = Sample(
            t,
            name,
            text is not None,
            rss_kb=tree_rss_kb(pid) if pid else None,
            cpu_s=tree_cpu_s(pid) if pid else None,
        )
        if text is not None:
            with contextlib.suppress(Exception):
                m = scrape(text)
                for (n, lab), v in m.items():
                    if n == "surge_degradation_level":
                        s.level = v
                    elif n == "requests_in_queue_per_worker":
                        s.per_worker = v
                    elif n == "requests_queue_depth":
                        s.depth[dict(lab).get("priority", "?")] = v
        if self.with_status:
            body = http_json(port, "/status")
            if body is not None:
                with contextlib.suppress(Exception):
                    s.assigned = int(json.loads(body)["assigned"])
        return s

    async def _loop(self) -> None:
        while True:
            t0 = time.monotonic()
            for name, port, pid in list(self.targets()):
                self.samples.append(await asyncio.to_thread(self._one, name, port, pid))
            await asyncio.sleep(max(0.05, SCRAPE_INTERVAL_S - (time.monotonic() - t0)))


class LagSampler(Background):
    """The pipeline's consumer-group lag (end offset minus committed offset) on its input topics (the
    request topic and the four work topics), every second: the backlog that waits in Kafka, which the
    workers' in-memory queue depth does not show."""

    def __init__(
        self,
        bootstrap: str,
        group: str,
        topics: Sequence[str],
        interval_s: float = 1.0,
        security: dict[str, Any] | None = None,
    ) -> None:
        super().__init__()
        self.bootstrap = bootstrap
        self.security = security or {}
        self.group = group
        self.topics = list(topics)
        self.interval_s = interval_s
        self.samples: list[tuple[float, dict[str, int] | None]] = []

    async def _loop(self) -> None:
        from aiokafka import TopicPartition
        from aiokafka.admin import AIOKafkaAdminClient

        # committed offsets never go back; a group coordinator still loading after a broker restart
        # answers without them, which must not read as a sudden backlog
        done_at: dict[Any, int] = {}
        while True:
            admin = AIOKafkaAdminClient(
                bootstrap_servers=self.bootstrap, request_timeout_ms=3000, **self.security
            )
            consumer = plain_consumer(self.bootstrap, self.security)
            try:
                await asyncio.wait_for(admin.start(), 5)
                await asyncio.wait_for(consumer.start(), 5)
                await refresh_metadata(consumer)
                tps = [
                    TopicPartition(t, p)
                    for t in self.topics
                    for p in sorted(consumer.partitions_for_topic(t) or ())
                ]
                while True:
                    t0 = time.monotonic()
                    committed = await asyncio.wait_for(admin.list_consumer_group_offsets(self.group), 3)
                    ends = await asyncio.wait_for(consumer.end_offsets(tps), 3)
                    lag: dict[str, int] = dict.fromkeys(self.topics, 0)
                    for tp in tps:
                        c = committed.get(tp)
                        done = max(done_at.get(tp, 0), c.offset if c is not None and c.offset >= 0 else 0)
                        done_at[tp] = done
                        lag[tp.topic] += max(0, ends.get(tp, 0) - done)
                    self.samples.append((time.time(), lag))
                    await asyncio.sleep(max(0.05, self.interval_s - (time.monotonic() - t0)))
            except asyncio.CancelledError:
                raise
            except Exception:  # the broker restarting: note the gap and reconnect
                self.samples.append((time.time(), None))
                await asyncio.sleep(self.interval_s)
            finally:
                for c in (consumer, admin):
                    with contextlib.suppress(Exception):
                        await asyncio.wait_for(c.stop() if c is consumer else c.close(), 5)

    def totals(self) -> list[tuple[float, int]]:
        return [(t, sum(lag.values())) for t, lag in self.samples if lag is not None]

    def peak_by_topic(self, start: float = 0.0, end: float = float("inf")) -> dict[str, int]:
        """The largest lag of each topic (by its suffix: requests, work.realtime, ...) in [start, end)."""
        out: dict[str, int] = {}
        for t, lag in self.samples:
            if lag is None or not start <= t < end:
                continue
            for topic, v in lag.items():
                key = topic.split(".", 1)[-1]
                out[key] = max(out.get(key, 0), v)
        return out


def quiet_kafka_logs() -> None:
    """aiokafka logs every reconnect attempt at ERROR; the benchmarks report what matters themselves."""
    import logging

    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)


# ---- sending and reading -------------------------------------------------------------------------
@dataclass
class Sent:
    rid: str
    index: int  # position in the question stream
    priority: str
    tier: str
    tenant: str
    kind: str
    created_ms: int
    lag_ms: float  # how late against its schedule it was sent
    step: str
    partition: int | None = None
    acked: bool | None = None  # None while the producer has not answered
    produce_error: str | None = None


@dataclass
class Seen:
    """One reply record as read off the reply topic."""

    rid: str
    recv: float  # wall clock, s
    partition: int
    offset: int
    ts_ms: int  # the record's timestamp (when the worker produced it)
    reply: dict[str, Any]


class ReplyReader(Background):
    """A plain consumer (no group) on every partition of the reply topic, keeping every record."""

    def __init__(self, bootstrap: str, topic: str, security: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.topic = topic
        self.consumer = plain_consumer(
            bootstrap, security, auto_offset_reset="earliest", fetch_max_wait_ms=50
        )
        self.seen: list[Seen] = []
        self.by_rid: dict[str, list[Seen]] = defaultdict(list)
        self.undecodable = 0
        self.bootstrap, self.security = bootstrap, security
        #: where the live loop started reading, per partition (what :meth:`catch_up` reads again from)
        self.starts: dict[int, int] = {}
        #: replies on the topic that the live loop had not read when it stopped (found by catch_up)
        self.missed_live = 0

    async def start(self) -> None:
        from aiokafka import TopicPartition

        await self.consumer.start()
        parts = await partitions_of(self.consumer, self.topic, 100)
        if not parts:
            raise BenchError(f"reply topic {self.topic!r} does not exist")
        tps = [TopicPartition(self.topic, p) for p in parts]
        self.consumer.assign(tps)
        await self.consumer.seek_to_end(*tps)
        for tp in tps:
            self.starts[tp.partition] = await self.consumer.position(tp)
        await super().start()

    def _keep(self, m: Any, recv: float) -> None:
        try:
            reply = json.loads(m.value)
            rid = str(reply["request_id"])
        except Exception:
            self.undecodable += 1
            return
        s = Seen(rid, recv, m.partition, m.offset, int(m.timestamp or 0), reply)
        self.seen.append(s)
        self.by_rid[rid].append(s)

    async def catch_up(self, timeout_s: float = 60.0) -> int:
        """Called after :meth:`stop`: read the reply topic again, from where the live loop started to
        its end now, with a fresh consumer, and keep the replies the live loop had not read (a load
        generator starved of CPU falls behind; the count must not depend on it). Their ``recv`` is the
        record's timestamp, when the worker produced it. Returns how many were added."""
        from aiokafka import TopicPartition

        have = {(x.partition, x.offset) for x in self.seen}
        consumer = plain_consumer(self.bootstrap, self.security, auto_offset_reset="earliest")
        added = 0
        try:
            await consumer.start()
            tps = [TopicPartition(self.topic, p) for p in self.starts]
            consumer.assign(tps)
            for tp in tps:
                consumer.seek(tp, self.starts[tp.partition])
            async for _, m in read_to_end(consumer, tps, timeout_s):
                if (m.partition, m.offset) not in have:
                    self._keep(m, (m.timestamp or 0) / 1000)
                    added += 1
        finally:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(consumer.stop(), 10)
        self.missed_live += added
        return added

    async def _loop(self) -> None:
        while True:
            try:
                batch = await self.consumer.getmany(timeout_ms=200)
            except asyncio.CancelledError:
                raise
            except Exception:  # the broker restarting: the consumer reconnects by itself
                await asyncio.sleep(0.2)
                continue
            now = time.time()
            for records in batch.values():
                for m in records:
                    self._keep(m, now)

    async def stop(self) -> None:
        await super().stop()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.consumer.stop(), 10)


async def read_to_end(consumer: Any, tps: Sequence[Any], timeout_s: float) -> AsyncIterator[tuple[Any, Any]]:
    """Each ``(partition, record)`` of ``tps`` (assigned to ``consumer`` and positioned) up to their end
    offsets as they are now, or until ``timeout_s``."""
    ends = await consumer.end_offsets(tps)
    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end:
        positions = [await consumer.position(tp) for tp in tps]
        if all(pos >= ends[tp] for pos, tp in zip(positions, tps, strict=True)):
            return
        batch = await consumer.getmany(timeout_ms=500, max_records=5000)
        for tp, records in batch.items():
            for m in records:
                if m.offset < ends[tp]:
                    yield tp, m


async def catch_up(reader: ReplyReader, scenario: str) -> None:
    """:meth:`ReplyReader.catch_up`, said on stderr; a failure is said, never fatal to the results."""
    try:
        missed = await reader.catch_up()
    except Exception as exc:
        print(f"{scenario}: could not read the reply topic again ({exc!r})", file=sys.stderr)
        return
    if missed:
        print(
            f"{scenario}: {missed} replies were on the topic but not yet read live; counted", file=sys.stderr
        )


class Sender:
    """An open-loop producer: sends each request at its scheduled time, whatever the replies do."""

    def __init__(
        self,
        bootstrap: str,
        topic: str,
        stream: QuestionStream,
        pop: Population,
        security: dict[str, Any] | None = None,
    ) -> None:
        from aiokafka import AIOKafkaProducer

        self.topic = topic
        self.stream = stream
        self.pop = pop
        self.producer = AIOKafkaProducer(
            bootstrap_servers=bootstrap,
            acks="all",
            linger_ms=5,
            request_timeout_ms=60_000,
            max_request_size=8 << 20,
            **(security or {}),
        )
        track_sent_topics(self.producer)
        self.sent: dict[str, Sent] = {}
        self.order: list[Sent] = []
        self._futs: list[asyncio.Future[Any]] = []

    async def start(self) -> None:
        await self.producer.start()

    async def send_one(self, step: str, due_wall: float) -> Sent:
        """Send the next question; ``created_at`` is its scheduled time (``due_wall``), so a sender that
        falls behind (the broker away, say) shows up in the latency instead of hiding it."""
        q = self.stream.next()
        i = len(self.stream.items) - 1
        tier, prio, user = self.pop.pick(q.tenant)
        rid = f"q{i}"
        created = int(due_wall * 1000)
        lag_ms = max(0.0, (time.time() - due_wall) * 1000)
        rec = Sent(rid, i, prio, tier, q.tenant, q.kind, created, lag_ms, step)
        body = {
            "request_id": rid,
            "user_id": user,
            "tenant": q.tenant,
            "tier": tier,
            "priority": prio,
            "prompt": q.text,
            "created_at": created,
        }
        self.sent[rid] = rec
        self.order.append(rec)
        try:
            fut = await self.producer.send(self.topic, json.dumps(body).encode(), key=user.encode())
        except Exception as exc:
            rec.acked, rec.produce_error = False, repr(exc)
            return rec

        def done(f: asyncio.Future[Any], rec: Sent = rec) -> None:
            if f.cancelled():
                rec.acked, rec.produce_error = False, "cancelled"
            elif f.exception() is not None:
                rec.acked, rec.produce_error = False, repr(f.exception())
            else:
                rec.acked, rec.partition = True, f.result().partition

        fut.add_done_callback(done)
        self._futs.append(fut)
        return rec

    async def run(
        self, rate_per_s: float, duration_s: float, step: str, tick: Callable[[], None] | None = None
    ) -> tuple[float, float]:
        """Send at ``rate_per_s`` for ``duration_s``; returns (start, end) wall times."""
        start_wall, start = time.time(), time.perf_counter()
        n = max(1, round(rate_per_s * duration_s))
        next_tick = start + 5.0
        for i in range(n):
            due = start + i / rate_per_s
            delay = due - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            await self.send_one(step, start_wall + i / rate_per_s)
            if tick is not None and time.perf_counter() >= next_tick:
                next_tick += 5.0
                tick()
        end = start + duration_s
        if (left := end - time.perf_counter()) > 0:
            await asyncio.sleep(left)
        return start_wall, start_wall + duration_s

    async def run_until(
        self, rate_per_s: float, stop: asyncio.Event, step: str, tick: Callable[[], None] | None = None
    ) -> tuple[float, float]:
        """Send at ``rate_per_s`` until ``stop`` is set; returns (start, end) wall times."""
        start_wall, start = time.time(), time.perf_counter()
        next_tick = start + 5.0
        i = 0
        while not stop.is_set():
            delay = start + i / rate_per_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
                if stop.is_set():
                    break
            await self.send_one(step, start_wall + i / rate_per_s)
            i += 1
            if tick is not None and time.perf_counter() >= next_tick:
                next_tick += 5.0
                tick()
        return start_wall, time.time()

    async def flush(self, timeout_s: float = 90.0) -> None:
        if self._futs:
            await asyncio.wait(self._futs, timeout=timeout_s)

    async def stop(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.producer.stop(), 30)


async def trace_requests(
    bootstrap: str,
    topics: TopicNames,
    rids: Iterable[str],
    security: dict[str, Any] | None = None,
    timeout_s: float = 60.0,
    group: str | None = None,
) -> dict[str, Any]:
    """Where requests without a reply went: every record of the request, work, dead-letter and reply
    topics read again from the beginning by a fresh consumer, looking for each request_id. A reply
    found now was missed by the live reader (a harness fault, reported as such)."""

    wanted = {r: {"request": [], "work": [], "deadletter": [], "replies_on_rescan": 0} for r in rids}
    if not wanted:
        return {}
    try:
        return await _trace(bootstrap, topics, wanted, security, timeout_s, group)
    except Exception as exc:  # a diagnosis, never a reason to lose the run's results
        return {"error": repr(exc)}


async def _committed(
    bootstrap: str, group: str, security: dict[str, Any] | None
) -> dict[tuple[str, int], int]:
    """The consumer group's committed offsets, ``{(topic, partition): offset}``."""
    from aiokafka.admin import AIOKafkaAdminClient

    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=5000, **(security or {}))
    try:
        await admin.start()
        got = await admin.list_consumer_group_offsets(group)
        return {(tp.topic, tp.partition): c.offset for tp, c in got.items() if c.offset >= 0}
    finally:
        with contextlib.suppress(Exception):
            await admin.close()


async def _trace(
    bootstrap: str,
    topics: TopicNames,
    wanted: dict[str, Any],
    security: dict[str, Any] | None,
    timeout_s: float,
    group: str | None,
) -> dict[str, Any]:
    import base64

    from aiokafka import TopicPartition

    needles = {f'"{r}"'.encode(): r for r in wanted}
    consumer = plain_consumer(bootstrap, security, auto_offset_reset="earliest")
    try:
        await consumer.start()
        await refresh_metadata(consumer)
        names = [topics.requests, *map(topics.work, PRIORITIES), topics.deadletter, topics.replies]
        tps = [TopicPartition(t, p) for t in names for p in sorted(consumer.partitions_for_topic(t) or ())]
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        committed = await _committed(bootstrap, group, security) if group else {}
        async for tp, m in read_to_end(consumer, tps, timeout_s):
            value = m.value or b""
            if tp.topic == topics.deadletter:
                with contextlib.suppress(Exception):
                    value = base64.b64decode(json.loads(value)["raw_b64"])
            for needle, rid in needles.items():
                if needle not in value:
                    continue
                where = f"{tp.topic}[{tp.partition}]@{m.offset}"
                w = wanted[rid]
                if tp.topic == topics.replies:
                    w["replies_on_rescan"] += 1
                elif tp.topic == topics.requests:
                    done = committed.get((tp.topic, tp.partition))
                    if done is not None:
                        where += " (committed past it)" if done > m.offset else " (not yet consumed)"
                    w["request"].append(where)
                elif tp.topic == topics.deadletter:
                    with contextlib.suppress(Exception):
                        where += ": " + str(json.loads(m.value).get("reason"))
                    w["deadletter"].append(where)
                else:
                    done = committed.get((tp.topic, tp.partition))
                    if done is not None:
                        where += " (committed past it)" if done > m.offset else " (not yet consumed)"
                    w["work"].append(where)
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(consumer.stop(), 10)
    found = list(wanted.values())
    return {
        "summary": {
            "traced": len(found),
            "reply_found_on_rescan (missed by the live reader)": sum(
                1 for w in found if w["replies_on_rescan"]
            ),
            "not on the request topic": sum(1 for w in found if not w["request"]),
            "dead-lettered": sum(1 for w in found if w["deadletter"]),
            "on a work topic, no reply": sum(
                1 for w in found if w["work"] and not w["replies_on_rescan"] and not w["deadletter"]
            ),
            "of which the group committed past it (lost by the pipeline)": sum(
                1
                for w in found
                if not w["replies_on_rescan"] and any("committed past" in x for x in w["work"])
            ),
            "of which still waiting in Kafka (not yet consumed)": sum(
                1
                for w in found
                if not w["replies_on_rescan"] and any("not yet consumed" in x for x in w["work"])
            ),
            "never forwarded, the group committed past it (lost at intake)": sum(
                1
                for w in found
                if not w["work"]
                and not w["replies_on_rescan"]
                and not w["deadletter"]
                and any("committed past" in x for x in w["request"])
            ),
            "never forwarded to a work topic, no reply": sum(
                1
                for w in found
                if w["request"] and not w["work"] and not w["replies_on_rescan"] and not w["deadletter"]
            ),
        },
        "requests": dict(list(wanted.items())[:20]),
    }


async def wait_answered(
    sender: Sender, reader: ReplyReader, timeout_s: float, settle_s: float = 2.0, idle_s: float = 20.0
) -> float:
    """The drain: wait until every acked request has a reply (then ``settle_s`` more for late repeats),
    or no new reply came for ``idle_s`` (a backlog still being worked off is waited for, a stall is
    not), or ``timeout_s``; returns the seconds waited."""
    t0 = time.monotonic()
    seen, last_progress = len(reader.seen), t0
    while time.monotonic() - t0 < timeout_s:
        if all(r.rid in reader.by_rid for r in sender.order if r.acked is not False):
            break
        if len(reader.seen) != seen:
            seen, last_progress = len(reader.seen), time.monotonic()
        elif time.monotonic() - last_progress > idle_s:
            break
        await asyncio.sleep(0.25)
    await asyncio.sleep(settle_s)
    return time.monotonic() - t0


# ---- analysis ------------------------------------------------------------------------------------
def reply_code(reply: dict[str, Any]) -> str:
    err = reply.get("error") or {}
    return str(err.get("code") or "unknown")


def is_template(reply: dict[str, Any]) -> bool:
    return reply.get("served_from") == "template" or reply.get("finish_reason") == "template"


def template_violation(reply: dict[str, Any], sent: Sent) -> str | None:
    """Why a template reply was not allowed (docs/architecture.md, "Degradation"), or None when it was."""
    if not is_template(reply):
        return None
    if sent.priority == "realtime":
        return "realtime templated"
    if sent.priority == "interactive" and sent.tier != "free":
        return f"interactive {sent.tier}-tier templated"
    if int(reply.get("degradation_level") or 0) < 3:
        return f"template at level {reply.get('degradation_level')}"
    return None


def latency_ms(sent: Sent, seen: Seen) -> float:
    return seen.recv * 1000 - sent.created_ms


def class_summary(
    recs: Sequence[Sent], by_rid: dict[str, list[Seen]], deadline_ms: int | None
) -> dict[str, Any]:
    """Counts, latencies and misses of a set of requests (one class of one step, say)."""
    acked = [r for r in recs if r.acked is not False]
    answered = [r for r in acked if r.rid in by_rid]
    first = {r.rid: by_rid[r.rid][0] for r in answered}
    ok = [r for r in answered if first[r.rid].reply.get("status") == "ok"]
    templ = [r for r in ok if is_template(first[r.rid].reply)]
    errors = Counter(
        reply_code(first[r.rid].reply) for r in answered if first[r.rid].reply.get("status") != "ok"
    )
    served = Counter(str(first[r.rid].reply.get("served_from") or "none") for r in ok)
    lat_all = [latency_ms(r, first[r.rid]) for r in answered]
    lat_ok = [latency_ms(r, first[r.rid]) for r in ok]
    expired = errors.get("deadline_exceeded", 0)
    late = sum(1 for x in lat_ok if deadline_ms is not None and x > deadline_ms)
    missing = len(acked) - len(answered)
    misses = expired + late + missing
    dup = sum(1 for r in answered if len(by_rid[r.rid]) > 1)
    return {
        "offered": len(recs),
        "produce_failed": len(recs) - len(acked),
        "answered": len(answered),
        "missing": missing,
        "duplicated": dup,
        "ok": len(ok),
        "template": len(templ),
        "errors": dict(errors),
        "served_from": dict(served),
        "deadline_ms": deadline_ms,
        "deadline_exceeded": expired,
        "late_ok": late,
        "misses": misses,
        "miss_rate": round(misses / len(acked), 4) if acked else None,
        "latency_all": latency_summary(lat_all),
        "latency_ok": latency_summary(lat_ok),
    }


def exactly_once(recs: Sequence[Sent], by_rid: dict[str, list[Seen]]) -> dict[str, int]:
    acked = [r for r in recs if r.acked is not False]
    return {
        "acked": len(acked),
        "missing": sum(1 for r in acked if r.rid not in by_rid),
        "duplicated": sum(1 for r in acked if len(by_rid.get(r.rid, ())) > 1),
        "extra_replies": sum(max(0, len(by_rid.get(r.rid, ())) - 1) for r in acked),
    }


def settled_after(points: Sequence[tuple[float, bool]], t0: float) -> float | None:
    """Seconds from ``t0`` until the condition holds at every later point; None if it does not at the end."""
    after = [(t, ok) for t, ok in points if t >= t0]
    if not after or not after[-1][1]:
        return None
    last_bad = max((t for t, ok in after if not ok), default=None)
    if last_bad is None:
        return 0.0
    nxt = min(t for t, ok in after if t > last_bad)
    return max(0.0, nxt - t0)


def max_known(values: Iterable[float | None]) -> float | None:
    """The largest of ``values``, or None when any of them is None (unknown)."""
    vals = list(values)
    known = [v for v in vals if v is not None]
    return max(known) if len(known) == len(vals) else None


def bins(values: Iterable[tuple[float, float]], t0: float, width: float = 1.0) -> dict[int, list[float]]:
    out: dict[int, list[float]] = defaultdict(list)
    for t, v in values:
        out[int((t - t0) // width)].append(v)
    return out


# ---- the run -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Step:
    name: str
    multiple: float  # of L
    duration_s: float


@dataclass(frozen=True)
class Plan:
    steps: tuple[Step, ...]
    rate_scale: float
    limit_batches: int
    drain_s: float  # the longest drain
    drain_idle_s: float  # the drain ends sooner when no reply came for this long


def _steps(*durations_s: float) -> tuple[Step, ...]:
    """The four steps, 0.5 L, 0.8 L, 2 L and 0.5 L again, lasting ``durations_s``."""
    multiples = (("0.5L", 0.5), ("0.8L", 0.8), ("2L", 2.0), ("0.5L-after", 0.5))
    return tuple(Step(name, m, d) for (name, m), d in zip(multiples, durations_s, strict=True))


FULL = Plan(_steps(30, 60, 60, 60), rate_scale=1.0, limit_batches=12, drain_s=180, drain_idle_s=20)
QUICK = Plan(_steps(5, 5, 5, 5), rate_scale=0.25, limit_batches=3, drain_s=45, drain_idle_s=15)


def _progress(tag: str, sender: Sender, reader: ReplyReader, scraper: Scraper) -> Callable[[], None]:
    def tick() -> None:
        last = scraper.samples[-1] if scraper.samples else None
        depth = sum(last.depth.values()) if last else None
        rss = f"{last.rss_kb / 1024:.0f} MiB" if last and last.rss_kb else "?"
        answered = sum(1 for r in sender.order if r.rid in reader.by_rid)
        print(
            f"  {tag}: sent {len(sender.order)}, answered {answered}, level "
            f"{None if not last else last.level}, queue {depth}, rss {rss}",
            file=sys.stderr,
            flush=True,
        )

    return tick


@dataclass
class Watch:
    """The open-loop load on a deployment and what watches it: its sender, a reader of every reply,
    scrapes of its workers and its consumer group's Kafka lag; started and stopped together."""

    d: BenchDeployment
    sender: Sender
    reader: ReplyReader
    scraper: Scraper
    lag: LagSampler
    security: dict[str, Any]

    @classmethod
    async def start(
        cls, d: BenchDeployment, stream: QuestionStream, pop: Population, scraper: Scraper
    ) -> Watch:
        """Create the deployment's topics, then start everything (``scraper``: of the workers to watch)."""
        from pipeline.admin import ensure_topics

        await ensure_topics(d.settings())
        quiet_kafka_logs()
        sec = client_options(d.settings())
        reader = ReplyReader(d.bootstrap, d.topics.replies, sec)
        sender = Sender(d.bootstrap, d.topics.requests, stream, pop, sec)
        inputs = [d.topics.requests, *map(d.topics.work, PRIORITIES)]
        lag = LagSampler(d.bootstrap, d.env["SURGE_APP_ID"], inputs, security=sec)
        await reader.start()
        await sender.start()
        await scraper.start()
        await lag.start()
        return cls(d, sender, reader, scraper, lag, sec)

    async def stop(self) -> None:
        await self.lag.stop()
        await self.scraper.stop()
        await self.sender.stop()
        await self.reader.stop()

    async def trace_unanswered(self) -> dict[str, Any]:
        """:func:`trace_requests` of the first 50 acked requests that got no reply."""
        unanswered = [
            r.rid for r in self.sender.order if r.acked is not False and r.rid not in self.reader.by_rid
        ]
        d = self.d
        return await trace_requests(
            d.bootstrap, d.topics, unanswered[:50], self.security, group=d.env["SURGE_APP_ID"]
        )


async def _drive(
    d: BenchDeployment, plan: Plan, limit: float, stream: QuestionStream, pop: Population
) -> dict[str, Any]:
    worker = d.workers[0]
    scraper = Scraper(lambda: [("w0", worker.web_port, worker.proc.pid if worker.proc else None)])
    watch = await Watch.start(d, stream, pop, scraper)
    sender, reader = watch.sender, watch.reader
    windows: list[dict[str, Any]] = []
    try:
        for st in plan.steps:
            rate = st.multiple * limit * plan.rate_scale
            print(f"surge: step {st.name}: {rate:.1f} req/s for {st.duration_s:.0f} s", file=sys.stderr)
            t0, t1 = await sender.run(
                rate, st.duration_s, st.name, _progress(st.name, sender, reader, scraper)
            )
            window = {"name": st.name, "multiple": st.multiple, "rate_rps": round(rate, 2)}
            windows.append({**window, "start": t0, "end": t1, "duration_s": st.duration_s})
        await sender.flush()
        print(f"surge: draining (up to {plan.drain_s:.0f} s)", file=sys.stderr)
        drained = await wait_answered(sender, reader, plan.drain_s, idle_s=plan.drain_idle_s)
        # keep scraping a little past the drain so the level and queue can be seen settling
        await asyncio.sleep(1.0)
    finally:
        await watch.stop()
    await catch_up(reader, "surge")
    return {
        "trace_of_unanswered": await watch.trace_unanswered(),
        "lag": watch.lag,
        "windows": windows,
        "sender": sender,
        "reader": reader,
        "scraper": scraper,
        "drain_waited_s": drained,
    }


def analyse(
    run: dict[str, Any], limit: float, deadlines: dict[str, int | None]
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    sender: Sender = run["sender"]
    reader: ReplyReader = run["reader"]
    samples: list[Sample] = run["scraper"].samples
    lag_totals = run["lag"].totals()
    windows: list[dict[str, Any]] = run["windows"]
    by_rid = reader.by_rid
    steps: dict[str, Any] = {}
    for w in windows:
        recs = [r for r in sender.order if r.step == w["name"]]
        span = [s for s in samples if w["start"] <= s.t < w["end"]]
        first_in = [
            sender.sent[rid]
            for rid, seen in by_rid.items()
            if rid in sender.sent and w["start"] <= seen[0].recv < w["end"]
        ]
        useful = [
            r
            for r in first_in
            if by_rid[r.rid][0].reply.get("status") == "ok" and not is_template(by_rid[r.rid][0].reply)
        ]
        lags = [r.lag_ms for r in recs]
        rss = [s.rss_kb for s in span if s.rss_kb]
        cpu = [(s.t, s.cpu_s) for s in span if s.cpu_s is not None]
        cpu_used = cpu[-1][1] - cpu[0][1] if len(cpu) > 1 else None
        steps[w["name"]] = {
            "offered_rps": w["rate_rps"],
            "duration_s": w["duration_s"],
            "sent": len(recs),
            "sender_lag_ms": {
                "p99": round(sorted(lags)[int(0.99 * (len(lags) - 1))], 1) if lags else None,
                "max": round(max(lags), 1) if lags else None,
            },
            "replies": exactly_once(recs, by_rid),
            "answered_in_window_rps": round(len(first_in) / w["duration_s"], 2),
            "ok_in_window_rps": round(
                sum(1 for r in first_in if by_rid[r.rid][0].reply.get("status") == "ok") / w["duration_s"], 2
            ),
            "useful_in_window_rps": round(len(useful) / w["duration_s"], 2),
            "useful_unique_in_window_rps": round(
                sum(1 for r in useful if r.kind == "unique") / w["duration_s"], 2
            ),
            "classes": {
                p: class_summary([r for r in recs if r.priority == p], by_rid, deadlines[p])
                for p in PRIORITIES
            },
            "max_degradation_level": max((s.level for s in span if s.level is not None), default=None),
            "max_queue_depth": max((sum(s.depth.values()) for s in span if s.depth), default=None),
            "max_kafka_lag": max((v for t, v in lag_totals if w["start"] <= t < w["end"]), default=None),
            "max_kafka_lag_by_topic": run["lag"].peak_by_topic(w["start"], w["end"]),
            "peak_rss_mib": round(max(rss) / 1024, 1) if rss else None,
            # the worker's CPU (all its threads) over the step: cores busy, and ms per answered request
            "worker_cpu_cores": round(cpu_used / (cpu[-1][0] - cpu[0][0]), 3)
            if cpu_used is not None
            else None,
            "worker_cpu_ms_per_answer": round(cpu_used * 1000 / len(first_in), 2)
            if cpu_used is not None and first_in
            else None,
            "scrapes": len(span),
            "scrapes_failed": sum(1 for s in span if not s.up),
        }
    # templates: every reply record, repeats included
    violations: Counter[str] = Counter()
    templates = 0
    examples: list[dict[str, Any]] = []
    for seen in reader.seen:
        rec = sender.sent.get(seen.rid)
        if rec is None or not is_template(seen.reply):
            continue
        templates += 1
        why = template_violation(seen.reply, rec)
        if why:
            violations[why] += 1
            if len(examples) < 5:
                examples.append(
                    {
                        "request_id": seen.rid,
                        "priority": rec.priority,
                        "tier": rec.tier,
                        "why": why,
                        "degradation_level": seen.reply.get("degradation_level"),
                    }
                )
    # recovery after the surge
    surge = next((w for w in windows if w["multiple"] >= 1.5), None)
    recovery: dict[str, Any] = {}
    if surge is not None:
        end = surge["end"]
        level_pts = [(s.t, (s.level or 0) == 0) for s in samples if s.up and s.level is not None]
        first_step = windows[0]
        base = [
            sum(s.depth.values())
            for s in samples
            if first_step["start"] <= s.t < first_step["end"] and s.depth
        ]
        depth_ok = max(8.0, max(base, default=0.0))
        depth_pts = [(s.t, sum(s.depth.values()) <= depth_ok) for s in samples if s.up and s.depth]
        lag_ok = max(
            20.0, max((v for t, v in lag_totals if first_step["start"] <= t < first_step["end"]), default=0)
        )
        kafka_s = settled_after([(t, v <= lag_ok) for t, v in lag_totals], end)
        before = [r for r in sender.order if r.created_ms / 1000 < end and r.acked is not False]
        missing = [r for r in before if r.rid not in by_rid]
        last_reply = max((by_rid[r.rid][0].recv for r in before if r.rid in by_rid), default=None)
        replies_s = None if missing or last_reply is None else round(max(0.0, last_reply - end), 2)
        queue_s = settled_after(depth_pts, end)
        drained_s = max_known((replies_s, queue_s, kafka_s))
        recovery = {
            "level_0_after_s": settled_after(level_pts, end),
            "backlog_replies_drained_after_s": replies_s,
            "backlog_queue_drained_after_s": None if queue_s is None else round(queue_s, 2),
            "queue_depth_drained_at_most": depth_ok,
            "backlog_kafka_drained_after_s": None if kafka_s is None else round(kafka_s, 2),
            "kafka_lag_drained_at_most": lag_ok,
            "backlog_drained_after_s": None if drained_s is None else round(drained_s, 2),
            "requests_before_surge_end_unanswered": len(missing),
        }
        if recovery["level_0_after_s"] is not None:
            recovery["level_0_after_s"] = round(recovery["level_0_after_s"], 2)
    errs: Counter[str] = Counter(
        f"{reply_code(by_rid[r.rid][0].reply)}/{r.tier}"
        for r in sender.order
        if r.rid in by_rid and by_rid[r.rid][0].reply.get("status") != "ok"
    )
    overall = exactly_once(sender.order, by_rid)
    overall["unexpected_reply_records"] = sum(len(v) for k, v in by_rid.items() if k not in sender.sent)
    overall["undecodable_reply_records"] = reader.undecodable
    overall["replies_read_after_the_run"] = reader.missed_live
    overall["produce_failed"] = sum(1 for r in sender.order if r.acked is False)
    sustained = max((s["useful_in_window_rps"] for s in steps.values()), default=None)
    result = {
        "steps": steps,
        "replies": overall,
        "errors_by_code_and_tier": dict(errs),
        "templates": {"replies": templates, "violations": dict(violations), "violation_examples": examples},
        "recovery": recovery,
        "max_sustained_useful_rps": sustained,
        "max_sustained_useful_vs_limit": round(sustained / limit, 3) if sustained else None,
        "kinds": dict(Counter(r.kind for r in sender.order)),
        "served_from_overall": dict(
            Counter(
                str(v[0].reply.get("served_from") or v[0].reply.get("status"))
                for k, v in by_rid.items()
                if k in sender.sent
            )
        ),
    }
    return result, targets(result, windows, limit)


def _step_of(
    result: dict[str, Any], windows: list[dict[str, Any]], multiple: float, nth: int = 0
) -> dict[str, Any] | None:
    names = [w["name"] for w in windows if abs(w["multiple"] - multiple) < 1e-9]
    return result["steps"].get(names[nth]) if len(names) > nth else None


def targets(result: dict[str, Any], windows: list[dict[str, Any]], limit: float) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    s08 = _step_of(result, windows, 0.8)
    s2 = _step_of(result, windows, 2.0)
    s05a, s05b = _step_of(result, windows, 0.5, 0), _step_of(result, windows, 0.5, 1)
    if s08:
        errs = sum(sum(c["errors"].values()) for c in s08["classes"].values())
        out.append(target("0.8L error replies", float(errs), "<=", 0.0))
        out.append(
            target("0.8L realtime p99 ms", s08["classes"]["realtime"]["latency_ok"]["p99_ms"], "<=", 200.0)
        )
        out.append(
            target(
                "0.8L interactive p99 ms", s08["classes"]["interactive"]["latency_ok"]["p99_ms"], "<=", 500.0
            )
        )
    out.append(
        target("max sustained useful throughput / L", result["max_sustained_useful_vs_limit"], ">=", 0.8)
    )
    if s2:
        r = s2["replies"]
        out.append(
            target("2L requests without exactly one reply", float(r["missing"] + r["duplicated"]), "<=", 0.0)
        )
        out.append(target("2L realtime miss rate", s2["classes"]["realtime"]["miss_rate"], "<=", 0.01))
        out.append(target("2L interactive miss rate", s2["classes"]["interactive"]["miss_rate"], "<=", 0.05))
    out.append(
        target(
            "templates where levels forbid them",
            float(sum(result["templates"]["violations"].values())),
            "<=",
            0.0,
        )
    )
    rec = result["recovery"]
    out.append(target("level 0 after the surge, s", rec.get("level_0_after_s"), "<=", 30.0))
    out.append(target("backlog drained after the surge, s", rec.get("backlog_drained_after_s"), "<=", 60.0))
    if s05a and s05b and s05a["peak_rss_mib"] and s05b["peak_rss_mib"]:
        drift = abs(s05b["peak_rss_mib"] / s05a["peak_rss_mib"] - 1)
        result["rss_drift_second_vs_first_half_L"] = round(drift, 4)
        out.append(target("peak RSS drift, second 0.5L step vs first", drift, "<=", 0.10))
    else:
        out.append(target("peak RSS drift, second 0.5L step vs first", None, "<=", 0.10))
    return out


# ---- plot ----------------------------------------------------------------------------------------
CLASS_COLORS = {"realtime": "#e53e3e", "interactive": "#dd6b20", "batch": "#2b6cb0", "offline": "#718096"}


def timeline_plot(
    path: Path,
    title: str,
    sender: Sender,
    reader: ReplyReader,
    samples: Sequence[Sample],
    t0: float,
    marks: Sequence[tuple[float, str]] = (),
    spans: Sequence[tuple[float, float]] = (),
    deadlines: dict[str, int | None] | None = None,
    with_assigned: bool = False,
    lag: Sequence[tuple[float, int]] = (),
) -> None:
    """Rates, latency per class, queue depth, degradation level and RSS (or assigned partitions) over time."""
    rows = 5
    with figure(path, title, nrows=rows, ncols=1, figsize=(11, 2.3 * rows), sharex=True) as (_, ax):
        sent_b = bins(((r.created_ms / 1000, 1.0) for r in sender.order), t0)
        first = {rid: v[0] for rid, v in reader.by_rid.items() if rid in sender.sent}
        rep_b = bins(((s.recv, 1.0) for s in first.values()), t0)
        dup_b = bins(
            (
                (v[k].recv, 1.0)
                for rid, v in reader.by_rid.items()
                if rid in sender.sent
                for k in range(1, len(v))
            ),
            t0,
        )
        xs = range(0, max([*sent_b, *rep_b, 0]) + 1)
        ax[0].plot(list(xs), [len(sent_b.get(x, ())) for x in xs], label="sent/s", color="#2b6cb0")
        ax[0].plot(list(xs), [len(rep_b.get(x, ())) for x in xs], label="first replies/s", color="#38a169")
        if dup_b:
            ax[0].plot(
                list(xs), [len(dup_b.get(x, ())) for x in xs], label="repeated replies/s", color="#e53e3e"
            )
        ax[0].set_ylabel("req/s")
        ax[0].legend(fontsize=7, loc="upper left")
        for p in PRIORITIES:
            lat = bins(
                (
                    (r.created_ms / 1000, latency_ms(r, first[r.rid]))
                    for r in sender.order
                    if r.priority == p and r.rid in first
                ),
                t0,
            )
            ks = sorted(lat)
            ax[1].plot(
                ks,
                [sorted(lat[k])[len(lat[k]) // 2] for k in ks],
                color=CLASS_COLORS[p],
                lw=0.8,
                label=f"{p} p50",
            )
            ax[1].plot(ks, [max(lat[k]) for k in ks], color=CLASS_COLORS[p], lw=0.5, ls=":", label=f"{p} max")
            if deadlines and deadlines.get(p):
                ax[1].axhline(deadlines[p], color=CLASS_COLORS[p], lw=0.5, ls="--")
        ax[1].set_yscale("log")
        ax[1].set_ylabel("latency ms (by send time)")
        ax[1].legend(fontsize=6, ncol=4, loc="upper left")
        workers = sorted({s.worker for s in samples})
        for w in workers:
            ws = [s for s in samples if s.worker == w and s.up]
            tag = f" {w}" if len(workers) > 1 else ""
            for p in PRIORITIES:
                ax[2].plot(
                    [s.t - t0 for s in ws],
                    [s.depth.get(p, 0) for s in ws],
                    color=CLASS_COLORS[p],
                    lw=0.8,
                    label=f"{p}{tag}" if w == workers[0] else None,
                )
            ax[2].plot(
                [s.t - t0 for s in ws],
                [s.per_worker or 0 for s in ws],
                color="black",
                lw=0.6,
                ls="--",
                label="in queue per worker" if w == workers[0] else None,
            )
            ax[3].step([s.t - t0 for s in ws], [s.level or 0 for s in ws], where="post", label=w)
            if with_assigned:
                ax[4].step(
                    [s.t - t0 for s in samples if s.worker == w],
                    [(s.assigned or 0) if s.up else 0 for s in samples if s.worker == w],
                    where="post",
                    label=w,
                )
            else:
                ax[4].plot(
                    [s.t - t0 for s in ws if s.rss_kb], [s.rss_kb / 1024 for s in ws if s.rss_kb], label=w
                )
        ax[2].set_ylabel("in-memory queue depth")
        ax[2].legend(fontsize=6, ncol=3, loc="upper left")
        if lag:
            twin = ax[2].twinx()
            twin.plot([t - t0 for t, _ in lag], [v for _, v in lag], color="#805ad5", lw=1.0)
            twin.set_ylabel("Kafka lag (purple)", fontsize=8)
        ax[3].set_ylabel("degradation level")
        ax[3].set_ylim(-0.2, 3.3)
        ax[4].set_ylabel("assigned partitions" if with_assigned else "worker RSS MiB")
        if len(workers) > 1:
            ax[3].legend(fontsize=6, loc="upper left")
            ax[4].legend(fontsize=6, loc="upper left")
        ax[-1].set_xlabel("seconds")
        for a in ax:
            for t, _ in marks:
                a.axvline(t - t0, color="grey", lw=0.7, ls="--")
            for s0, s1 in spans:
                a.axvspan(s0 - t0, s1 - t0, color="#fbd38d", alpha=0.25)
        for t, label in marks:
            ax[0].annotate(
                label, (t - t0, ax[0].get_ylim()[1]), fontsize=7, rotation=90, va="top", ha="right"
            )


def default_path_env(s: Settings) -> dict[str, Any]:
    """The settings of the default path that the scenarios state (rates, levels, deadlines)."""
    return {
        "model": s.model,
        "dedup_enabled": s.dedup_enabled,
        "cache_enabled": s.cache_enabled,
        "rate_limit_enabled": s.rate_limit_enabled,
        "degrade_enabled": s.degrade_enabled,
        "partitions": s.partitions,
        "max_batch_size": s.max_batch_size,
        "deadlines_ms": {p: s.deadline_ms(p) for p in PRIORITIES},
        "user_rate_per_s": {t: getattr(s, f"user_rate_per_s_{t}") for t, _ in TIER_MIX},
        "tenant_rate_per_s": s.tenant_rate_per_s,
        "session_timeout_s": s.session_timeout_s,
    }


#: what the scenarios turn back on over BASE_ENV (which switches rate limits and degradation off)
DEFAULT_PATH = {
    "model": "faq",
    "rate_limit_enabled": True,
    "degrade_enabled": True,
    "dedup_enabled": True,
    "cache_enabled": True,
}


@dataclass(frozen=True)
class Offered:
    """What a default-path scenario offers: L (:func:`measure_limit`'s result), the rate it sets from
    L, and the questions and users for that rate."""

    limit: dict[str, Any]
    rate: float
    stream: QuestionStream
    pop: Population

    @property
    def limit_rps(self) -> float:
        return float(self.limit["questions_per_s"])

    @classmethod
    def measure(
        cls,
        tag: str,
        questions: tuple[list[tuple[str, str]], set[str]],
        s: Settings,
        limit_batches: int,
        rate_of: Callable[[float], float],
        what: str,
        seed: int = 9,
        given_qps: float | None = None,
    ) -> Offered:
        """Measure L on the held-out questions (``questions``: :func:`unseen_questions`), or take
        ``given_qps`` (``surge bench --limit-qps``), then build the stream and the users for
        ``rate_of(L)``; prints L and that rate (``what``) under ``tag``."""
        holdout, trained = questions
        if given_qps is None:
            print(f"{tag}: measuring the model alone (L) ...", file=sys.stderr)
            lim = measure_limit([t for t, _ in holdout], limit_batches)
        else:
            lim = {"questions_per_s": float(given_qps), "given": True}
        rate = rate_of(lim["questions_per_s"])
        stream = QuestionStream(holdout, seed=seed, tenants=tenants_for(rate, s), exclude=trained)
        pop = Population.for_rate(rate, s)
        print(
            f"{tag}: L = {lim['questions_per_s']:.1f} questions/s; {what} {rate:.1f} req/s", file=sys.stderr
        )
        return cls(lim, rate, stream, pop)


def run(job: BenchRun, banking77_csv: str | Path | None = None) -> int:
    plan = QUICK if job.quick else FULL
    csv_path = resolve_csv(banking77_csv, job.scenario)
    questions = unseen_questions(csv_path)
    holdout = questions[0]
    with BenchEnv(job.scenario, broker=job.broker) as env:
        d = env.deployment("surge", **DEFAULT_PATH)
        startup_s = env.wait_ready([d])
        s = d.settings()
        top = max(st.multiple for st in plan.steps)
        offered = Offered.measure(
            "surge",
            questions,
            s,
            plan.limit_batches,
            lambda lim: top * lim * plan.rate_scale,
            "peak offered",
            given_qps=job.limit_qps,
        )
        limit, stream, pop = offered.limit_rps, offered.stream, offered.pop
        deadlines = {p: s.deadline_ms(p) for p in PRIORITIES}
        run_ = asyncio.run(_drive(d, plan, limit, stream, pop))
        worker_log_tail = d.workers[0].tail(1500)
    result, tg = analyse(run_, limit, deadlines)
    windows = run_["windows"]
    t0 = windows[0]["start"]
    out = {
        "plan": {
            "steps": [st.__dict__ for st in plan.steps],
            "rate_scale": plan.rate_scale,
            "drain_s": plan.drain_s,
            "drain_idle_s": plan.drain_idle_s,
        },
        "limit": offered.limit,
        "limit_rps": limit,
        "settings": default_path_env(s),
        "workload": {
            "csv": str(csv_path),
            "holdout_rows": len(holdout),
            "distinct_holdout_questions": len(stream.pool),
            "holdout_rows_left_out_as_seen_in_training": stream.excluded,
            "class_mix": dict(CLASS_MIX),
            "tier_mix": dict(TIER_MIX),
            "tenants": len(stream.tenants),
            "users_per_tier": pop.users,
            "unique_share": UNIQUE_SHARE,
            "repeat_share": REPEAT_SHARE,
            "passes_over_holdout": round(stream.pool_taken / len(stream.pool), 2),
        },
        "worker_startup_s": round(startup_s, 1),
        "broker_warm_up": None if env.broker_warm_up is None else env.broker_warm_up.__dict__,
        "drain_waited_s": round(run_["drain_waited_s"], 1),
        "windows": [
            {k: (round(v - t0, 2) if k in ("start", "end") else v) for k, v in w.items()} for w in windows
        ],
        **result,
        "targets": tg,
        "notes": (
            "latency: created_at (the scheduled send time) to the reply read off the reply topic. misses: "
            "deadline_exceeded replies + ok replies after the class deadline + requests without a reply "
            "(offline has no deadline). useful throughput: distinct requests whose first reply (ok, not a "
            "template) arrived during the step, per second of the step; the max over steps is compared with "
            "L. backlog drained: every request sent before the end of the 2L step answered, and the "
            "in-memory queue back under the first step's peak (at least 8) and the pipeline's consumer-group "
            "lag on its input topics back under the first step's peak (at least 20). RSS: the worker "
            "process tree's VmRSS, scraped every 0.5 s."
        ),
        "trace_of_unanswered": run_["trace_of_unanswered"],
        "worker_log_tail": worker_log_tail if result["replies"]["missing"] else None,
    }

    def plot(pp: Path) -> None:
        timeline_plot(
            pp,
            f"{job.title}: L = {limit:.0f} q/s",
            run_["sender"],
            run_["reader"],
            run_["scraper"].samples,
            t0,
            marks=[(w["start"], f"{w['name']} {w['rate_rps']:.0f}/s") for w in windows],
            deadlines=deadlines,
            lag=run_["lag"].totals(),
        )

    return report(job, out, plot)
