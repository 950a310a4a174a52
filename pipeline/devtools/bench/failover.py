"""``surge bench failover``: two workers under load through SIGKILLs, a rolling restart and a broker restart.

Two ``surge worker`` processes with one ``SURGE_APP_ID`` (one consumer group), each with its own data
dir and web port, on the default path (FAQ answerer, caches and merging, rate limits, degradation),
take an open-loop load of half the model-alone limit L (measured as in ``surge bench surge``) of
held-out banking77 questions in all four classes (the workload of :mod:`pipeline.devtools.bench.surge`).
While it runs, one event at a time, each after the previous one has recovered:

* three SIGKILL-and-restart cycles (w1, w0, w1): the worker's process group is killed and the worker
  started again at once on its data dir and port;
* one SIGTERM rolling restart: each worker in turn gets SIGTERM, is waited for until it exits, is
  started again and waited for until it reports ready;
* one broker restart: the embedded Kafka stopped and started on the same port and data dir
  (:meth:`pipeline.devtools.broker.EmbeddedKafka.restart`).

``--quick``: one SIGKILL cycle, SIGTERM of one worker, the broker restart, at 0.3 of that load.

Replies are read by a plain consumer on every partition of the reply topic (not the pipeline's own
consumer), every record kept. A partition is served again after an event when a reply produced after
the event (the record's timestamp: a killed worker produces nothing more) lands on it; an event has
recovered when, after the restarted worker (or the broker) is back, every partition with traffic got
such a reply and the workers' ``/status`` ``assigned`` counts add up to what they were before the
first event. Its failover window runs from the event to that moment plus a margin. Measured: lost
requests (acked by the broker, never answered by the end of a drain), repeats (request_ids answered
more than once), repeats that differ (anything but ``timings``), misses per class inside and outside
the windows, the time until every partition is served again, the degradation level after each
event. Targets: see :func:`targets`.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
import time
import uuid
from collections import Counter, defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path
from typing import Any

from pipeline.devtools.bench.banking77 import resolve_csv, unseen_questions
from pipeline.devtools.bench.common import (
    BENCH_DIR,
    BenchDeployment,
    BenchEnv,
    BenchError,
    BenchRun,
    start_warm,
    target,
)
from pipeline.devtools.bench.report import report
from pipeline.devtools.bench.surge import (
    CLASS_MIX,
    DEFAULT_PATH,
    Offered,
    ReplyReader,
    Sample,
    Scraper,
    Seen,
    Sender,
    Sent,
    Watch,
    catch_up,
    class_summary,
    default_path_env,
    latency_ms,
    max_known,
    quiet_kafka_logs,
    reply_code,
    settled_after,
    timeline_plot,
    wait_answered,
)
from pipeline.devtools.broker import EmbeddedKafka, free_port
from pipeline.devtools.broker_warmup import BrokerWarmUp
from pipeline.devtools.procs import WorkerProcess
from pipeline.exceptions import SurgeError
from pipeline.settings import PRIORITIES

LOAD = 0.5  # of L
#: the sender's step name of the warm-up load's requests
PREWARM_STEP = "warm-up"


@dataclass(frozen=True)
class Plan:
    kills: int
    rolling: tuple[int, ...]  # the workers the SIGTERM rolling restart goes through, in order
    #: load before the measured run, answered in full before it starts (reported apart): a cluster
    #: just started, broker and workers alike, answers its first seconds of load slower than later
    prewarm_s: float
    prewarm_pause_s: float  # quiet between the warm-up load and the measured run
    warm_s: float  # steady load before the first event
    settle_s: float  # at least this long between a recovery and the next event
    level0_wait_s: float  # at most this long waiting for level 0 before the next event
    recover_timeout_s: float
    margin_s: float  # added to a window after recovery
    tail_s: float
    drain_s: float  # the longest drain
    drain_idle_s: float  # the drain ends sooner when no reply came for this long
    rate_scale: float
    limit_batches: int
    sigterm_timeout_s: float


FULL = Plan(
    kills=3,
    rolling=(0, 1),
    prewarm_s=10,
    prewarm_pause_s=3,
    warm_s=20,
    settle_s=10,
    level0_wait_s=35,
    recover_timeout_s=120,
    margin_s=5,
    tail_s=20,
    drain_s=180,
    drain_idle_s=20,
    rate_scale=1.0,
    limit_batches=8,
    sigterm_timeout_s=60,
)
QUICK = Plan(
    kills=1,
    rolling=(0,),
    prewarm_s=2,
    prewarm_pause_s=1,
    warm_s=6,
    settle_s=2,
    level0_wait_s=8,
    recover_timeout_s=90,
    margin_s=3,
    tail_s=4,
    drain_s=60,
    drain_idle_s=15,
    rate_scale=0.3,
    limit_batches=3,
    sigterm_timeout_s=45,
)


@dataclass
class Event:
    kind: str  # sigkill | sigterm | broker | crash
    worker: int | None
    t: float  # wall clock of the kill, SIGTERM, broker stop or crash detection
    back: float | None = None  # restarted worker ready / broker answering again
    exit_s: float | None = None  # SIGTERM: until the process exited
    exit_code: int | None = None
    recovered: float | None = None
    window_end: float | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return {
            "sigkill": f"SIGKILL w{self.worker}",
            "sigterm": f"SIGTERM w{self.worker}",
            "broker": "broker restart",
            "crash": f"w{self.worker} exited",
        }[self.kind]


class Pool:
    """The two workers: per worker its environment (data dir, web port, id), its current process."""

    def __init__(self, env: BenchEnv, d: BenchDeployment, n: int = 2) -> None:
        self.d = d
        self.logs = env.run_dir
        self.envs = [
            {
                **d.env,
                "SURGE_DATA_DIR": str(env.run_dir / "data" / f"{d.name}-w{k}"),
                "SURGE_WEB_PORT": str(free_port()),
                "SURGE_WORKER_ID": f"w{k}",
            }
            for k in range(n)
        ]
        self.current: list[WorkerProcess | None] = [None] * n
        self.starts = [0] * n
        self.expected_down: set[int] = set()
        self.crashes: list[Event] = []

    def start(self, k: int) -> WorkerProcess:
        w = WorkerProcess(self.envs[k], self.logs / f"failover-w{k}-{self.starts[k]}.log")
        self.starts[k] += 1
        self.d.workers.append(w.start())  # BenchEnv stops every one of them at the end
        self.current[k] = w
        return w

    async def wait_ready(self, k: int, timeout_s: float = 240.0) -> float:
        w = self.current[k]
        assert w is not None
        await asyncio.to_thread(w.wait_ready, timeout_s=timeout_s)
        return time.time()

    def targets(self) -> list[tuple[str, int, int | None]]:
        return [
            (f"w{k}", w.web_port, w.proc.pid if w.proc else None)
            for k, w in enumerate(self.current)
            if w is not None
        ]

    def watch(self) -> list[Event]:
        """Workers that exited although nobody stopped them: recorded, and started again."""
        out = []
        for k, w in enumerate(self.current):
            if k in self.expected_down or w is None or w.proc is None or w.proc.poll() is None:
                continue
            ev = Event("crash", k, time.time(), exit_code=w.proc.returncode)
            ev.notes.append(w.tail(1500))
            print(
                f"failover: w{k} exited by itself with {w.proc.returncode}; starting it again",
                file=sys.stderr,
            )
            self.start(k)
            self.crashes.append(ev)
            out.append(ev)
        return out


def _assigned_total(scraper: Scraper, pool: Pool, since: float) -> int | None:
    """Sum of the latest ``assigned`` of every current worker, from scrapes after ``since``."""
    total = 0
    for name, _, _ in pool.targets():
        last = next((s for s in reversed(scraper.samples) if s.worker == name and s.t >= since), None)
        if last is None or not last.up or last.assigned is None:
            return None
        total += last.assigned
    return total


def _live_partitions(sender: Sender, now: float, horizon_s: float = 10.0) -> set[int]:
    out: set[int] = set()
    for r in reversed(sender.order):
        if r.created_ms / 1000 < now - horizon_s:
            break
        if r.partition is not None:
            out.add(r.partition)
    return out


def _served_since(reader: ReplyReader, since: float) -> set[int]:
    ms = since * 1000
    return {s.partition for s in reversed(reader.seen[-5000:]) if s.ts_ms > ms}


async def wait_recovered(
    since: float,
    pool: Pool,
    reader: ReplyReader,
    sender: Sender,
    scraper: Scraper,
    baseline: int | None,
    timeout_s: float,
) -> float | None:
    """Wall time when every partition with traffic has a reply produced after ``since`` and the
    assignment is whole again; None at the timeout."""
    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end:
        pool.watch()
        now = time.time()
        need = _live_partitions(sender, now)
        if need and need <= _served_since(reader, since):
            total = _assigned_total(scraper, pool, since)
            if baseline is None or total == baseline:
                return now
        await asyncio.sleep(0.25)
    return None


async def wait_level0(scraper: Scraper, pool: Pool, since: float, timeout_s: float) -> None:
    t_end = time.monotonic() + timeout_s
    while time.monotonic() < t_end:
        pool.watch()
        last: dict[str, Sample] = {}
        for s in reversed(scraper.samples):
            if s.t < since:
                break
            last.setdefault(s.worker, s)
        names = {n for n, _, _ in pool.targets()}
        if names and names <= set(last) and all(last[n].up and (last[n].level or 0) == 0 for n in names):
            return
        await asyncio.sleep(0.5)


async def _events(
    env: BenchEnv,
    pool: Pool,
    plan: Plan,
    sender: Sender,
    reader: ReplyReader,
    scraper: Scraper,
    stop: asyncio.Event,
) -> tuple[list[Event], int | None]:
    events: list[Event] = []

    async def finish(ev: Event, since: float) -> None:
        ev.recovered = await wait_recovered(
            since, pool, reader, sender, scraper, baseline, plan.recover_timeout_s
        )
        if ev.recovered is None:
            ev.notes.append(f"not recovered within {plan.recover_timeout_s:.0f} s")
            ev.window_end = time.time() + plan.margin_s
        else:
            ev.window_end = ev.recovered + plan.margin_s
        print(
            f"failover: {ev.label}: "
            + (f"recovered after {ev.recovered - ev.t:.1f} s" if ev.recovered else "NOT recovered"),
            file=sys.stderr,
            flush=True,
        )
        await asyncio.sleep(max(plan.margin_s, plan.settle_s))
        await wait_level0(scraper, pool, ev.window_end, plan.level0_wait_s)

    try:
        await asyncio.sleep(plan.warm_s)
        baseline = _assigned_total(scraper, pool, time.time() - 2.0)
        print(f"failover: steady state, {baseline} partitions assigned in all", file=sys.stderr)
        for i in range(plan.kills):
            k = 1 if i % 2 == 0 else 0
            w = pool.current[k]
            assert w is not None
            pool.expected_down.add(k)
            ev = Event("sigkill", k, time.time())
            print(f"failover: SIGKILL w{k} and restart", file=sys.stderr, flush=True)
            w.kill()
            pool.start(k)
            pool.expected_down.discard(k)
            events.append(ev)
            try:
                ev.back = await pool.wait_ready(k)
            except SurgeError as exc:
                ev.notes.append(f"restart not ready: {exc}"[:2000])
            await finish(ev, ev.back or ev.t)
        for k in plan.rolling:  # rolling restart
            w = pool.current[k]
            assert w is not None and w.proc is not None
            pool.expected_down.add(k)
            ev = Event("sigterm", k, time.time())
            events.append(ev)
            print(f"failover: SIGTERM w{k}, wait for exit, restart", file=sys.stderr, flush=True)
            os.kill(w.proc.pid, signal.SIGTERM)
            try:
                ev.exit_code = await asyncio.to_thread(w.proc.wait, plan.sigterm_timeout_s)
            except Exception:
                ev.notes.append(f"did not exit within {plan.sigterm_timeout_s:.0f} s of SIGTERM; SIGKILL")
                w.kill()
                ev.exit_code = w.proc.returncode
            ev.exit_s = round(time.time() - ev.t, 2)
            pool.start(k)
            pool.expected_down.discard(k)
            try:
                ev.back = await pool.wait_ready(k)
            except SurgeError as exc:
                ev.notes.append(f"restart not ready: {exc}"[:2000])
            await finish(ev, ev.back or ev.t)
        ev = Event("broker", None, time.time())
        events.append(ev)
        print("failover: restarting the broker", file=sys.stderr, flush=True)
        pool.expected_down.update(range(len(pool.current)))  # a worker may stop while Kafka is away
        try:
            await asyncio.to_thread(env.kafka.restart)
            quiet_kafka_logs()  # the broker's start turned aiokafka's logging back on
        except Exception as exc:  # nothing can be served any more: keep what was measured so far
            ev.notes.append(f"the broker did not come back: {exc}"[:3000])
            print(f"failover: the broker did not come back: {str(exc)[:300]}", file=sys.stderr)
            events.extend(pool.crashes)
            return sorted(events, key=lambda e: e.t), baseline
        finally:
            pool.expected_down.clear()
        ev.back = time.time()
        await finish(ev, ev.back)
        events.extend(pool.crashes)
        await asyncio.sleep(plan.tail_s)
    finally:
        stop.set()
    return sorted(events, key=lambda e: e.t), baseline


async def _prewarm(sender: Sender, reader: ReplyReader, plan: Plan, rate: float) -> None:
    """The warm-up load (``plan.prewarm_s`` at the run's rate), answered before the run starts."""
    if plan.prewarm_s <= 0:
        return
    print(f"failover: warm-up load for {plan.prewarm_s:.0f} s (reported apart)", file=sys.stderr)
    done = asyncio.Event()
    task = asyncio.create_task(sender.run_until(rate, done, PREWARM_STEP))
    await asyncio.sleep(plan.prewarm_s)
    done.set()
    await task
    await sender.flush()
    await wait_answered(sender, reader, 60.0, settle_s=1.0, idle_s=10.0)
    await asyncio.sleep(plan.prewarm_pause_s)


async def _drive(env: BenchEnv, pool: Pool, plan: Plan, offered: Offered) -> dict[str, Any]:
    scraper = Scraper(pool.targets, with_status=True)
    watch = await Watch.start(pool.d, offered.stream, offered.pop, scraper)
    sender, reader = watch.sender, watch.reader
    stop = asyncio.Event()

    def tick() -> None:
        answered = sum(1 for r in sender.order[-2000:] if r.rid in reader.by_rid)
        levels: dict[str, float | str | None] = {}
        for smp in reversed(scraper.samples[-10:]):
            levels.setdefault(smp.worker, smp.level if smp.up else "down")
        last = min(2000, len(sender.order))
        print(
            f"  sent {len(sender.order)}, answered {answered} of the last {last}, levels {levels}",
            file=sys.stderr,
            flush=True,
        )

    try:
        await _prewarm(sender, reader, plan, offered.rate)
        send_task = asyncio.create_task(sender.run_until(offered.rate, stop, "run", tick))
        events, baseline = await _events(env, pool, plan, sender, reader, scraper, stop)
        t0, t1 = await send_task
        broker_failed = next(
            (n for e in events if e.kind == "broker" and e.back is None for n in e.notes), None
        )
        drained = 0.0
        if broker_failed is None:
            await sender.flush()
            print(f"failover: draining (up to {plan.drain_s:.0f} s)", file=sys.stderr)
            drained = await wait_answered(
                sender, reader, plan.drain_s, settle_s=3.0, idle_s=plan.drain_idle_s
            )
    finally:
        stop.set()
        await watch.stop()
    if broker_failed is None:
        await catch_up(reader, "failover")
    traced = (
        await watch.trace_unanswered()
        if broker_failed is None
        else {"error": "not traced: the broker did not come back"}
    )
    return {
        "events": events,
        "baseline_assigned": baseline,
        "sender": sender,
        "reader": reader,
        "scraper": scraper,
        "lag": watch.lag,
        "start": t0,
        "end": t1,
        "drain_waited_s": drained,
        "trace_of_lost": traced,
        "broker_restart_failed": broker_failed,
    }


# ---- analysis ------------------------------------------------------------------------------------
def strip(reply: dict[str, Any]) -> dict[str, Any]:
    """A reply without its timings, the error's fields flattened (``error.code``, ``error.message``), so
    a difference names the field that differs."""
    out = {k: v for k, v in reply.items() if k not in ("timings", "error")}
    for k, v in (reply.get("error") or {}).items():
        out[f"error.{k}"] = v
    return out


def in_failover(r: Sent, deadline_ms: int | None, spans: Sequence[tuple[float, float]]) -> bool:
    """Whether a failover window covers request ``r``: sent before a window ends, with its deadline
    (its class deadline after it was sent; for a class without one, the send itself) at or after the
    window's start. A real-time request sent 50 ms before a SIGKILL, to the worker killed, is that
    kill's miss, not one of the steady state's."""
    sent = r.created_ms / 1000
    due = sent + (deadline_ms or 0) / 1000
    return any(sent < b and due >= a for a, b in spans)


def realtime_misses(
    recs: Sequence[Sent],
    by_rid: dict[str, list[Seen]],
    deadline_ms: int | None,
    spans: Sequence[tuple[float, float]],
    t0: float,
    limit: int = 200,
) -> list[dict[str, Any]]:
    """Where the real-time misses outside the windows happen: each with its distance to the nearest
    window (negative: before one starts, positive: after one ended), its latency as read, when the
    worker produced its reply (the record's timestamp) and how late the sender was."""
    out: list[dict[str, Any]] = []
    for r in recs:
        got = by_rid.get(r.rid)
        first = got[0] if got else None
        late = first is not None and deadline_ms is not None and latency_ms(r, first) > deadline_ms
        if first is not None and first.reply.get("status") == "ok" and not late:
            continue
        t = r.created_ms / 1000
        nearest = min((t - a if t < a else t - b for a, b in spans), key=abs, default=None)
        if first is None:
            code = "lost"
        elif first.reply.get("status") == "ok":
            code = "late_ok"
        else:
            code = reply_code(first.reply)
        out.append(
            {
                "at_s": round(t - t0, 2),
                "from_window_s": None if nearest is None else round(nearest, 2),
                "latency_ms": None if first is None else round(latency_ms(r, first), 1),
                "produced_after_ms": None if first is None else first.ts_ms - r.created_ms,
                "sender_lag_ms": round(r.lag_ms, 1),
                "code": code,
                "partition": r.partition,
            }
        )
    return out[:limit]


def analyse(
    run: dict[str, Any], deadlines: dict[str, int | None], session_timeout_s: float, partitions: int
) -> dict[str, Any]:
    sender: Sender = run["sender"]
    reader: ReplyReader = run["reader"]
    samples: list[Sample] = run["scraper"].samples
    events: list[Event] = run["events"]
    by_rid = reader.by_rid
    t0 = run["start"]
    spans = [(e.t, e.window_end) for e in events if e.window_end is not None]
    acked = [r for r in sender.order if r.acked is not False]
    lost = [r for r in acked if r.rid not in by_rid]
    # replies per partition, by the time their record was produced
    ts_by_part: dict[int, list[float]] = defaultdict(list)
    for s in reader.seen:
        ts_by_part[s.partition].append(s.ts_ms / 1000)
    for times in ts_by_part.values():
        times.sort()
    parts_with_traffic = sorted({r.partition for r in acked if r.partition is not None})

    def first_after(p: int, t: float) -> float | None:
        return next((x for x in ts_by_part.get(p, ()) if x > t), None)

    # repeats
    repeated = {rid: v for rid, v in by_rid.items() if rid in sender.sent and len(v) > 1}
    differ_fields: Counter[str] = Counter()
    differing: list[str] = []
    examples: list[dict[str, Any]] = []
    owner: dict[str, Event | None] = {}
    for rid, seen in repeated.items():
        base = strip(seen[0].reply)
        fields = {
            k
            for x in seen[1:]
            for k in set(base) | set(strip(x.reply))
            if strip(x.reply).get(k) != base.get(k)
        }
        if fields:
            differing.append(rid)
            differ_fields.update(fields)
            if len(examples) < 5:
                replies = [strip(x.reply) for x in seen[:3]]
                examples.append({"request_id": rid, "fields": sorted(fields), "replies": replies})
        # a repeat is a redelivery after a rebalance: it belongs to the last event before its second reply
        before = [e for e in events if e.t <= seen[1].recv]
        owner[rid] = before[-1] if before else None
    per_event: list[dict[str, Any]] = []
    for i, e in enumerate(events):
        nxt = events[i + 1].t if i + 1 < len(events) else float("inf")
        ref = e.back if e.kind == "broker" and e.back else e.t
        last_first = max_known(first_after(p, ref) for p in parts_with_traffic)
        served = None if last_first is None else last_first - ref
        after_back = None
        if e.back:
            last_first_back = max_known(first_after(p, e.back) for p in parts_with_traffic)
            after_back = None if last_first_back is None else last_first_back - e.back
        end = e.window_end or e.t
        gaps = []
        for p in parts_with_traffic:
            xs = [x for x in ts_by_part.get(p, ()) if e.t - 2 <= x <= end]
            gaps.append(max((b - a for a, b in pairwise(xs)), default=end - e.t + 2))
        level_pts = [
            (s.t, (s.level or 0) == 0) for s in samples if s.up and s.level is not None and s.t < nxt
        ]
        lvl = settled_after(level_pts, e.recovered) if e.recovered else None
        exposed = [r for r in acked if e.t - 5 <= r.created_ms / 1000 < min(nxt, run["end"])]
        reps = [rid for rid, ev in owner.items() if ev is e]
        per_event.append(
            {
                "kind": e.kind,
                "worker": e.worker,
                "label": e.label,
                "at_s": round(e.t - t0, 2),
                "back_after_s": round(e.back - e.t, 2) if e.back else None,
                "sigterm_exit_s": e.exit_s,
                "exit_code": e.exit_code,
                "every_partition_served_after_s": None if served is None else round(served, 2),
                "served_from": "broker back" if e.kind == "broker" else "event",
                "every_partition_served_after_back_s": None if after_back is None else round(after_back, 2),
                "recovered_after_s": round(e.recovered - e.t, 2) if e.recovered else None,
                "window_s": round(end - e.t, 2),
                "longest_partition_reply_gap_s": round(max(gaps, default=0), 2),
                "level_0_after_recovery_s": None if lvl is None else round(lvl, 2),
                "requests_exposed": len(exposed),
                "repeats": len(reps),
                "repeats_that_differ": sum(1 for rid in reps if rid in set(differing)),
                "notes": e.notes,
            }
        )
    errs: Counter[str] = Counter()
    limited: list[dict[str, Any]] = []
    for r in acked:
        got = by_rid.get(r.rid)
        if got and got[0].reply.get("status") != "ok":
            error = got[0].reply.get("error") or {}
            code = str(error.get("code"))
            errs[f"{code}/{r.tier}"] += 1
            if code == "rate_limited" and len(limited) < 10:
                limited.append(
                    {
                        "request_id": r.rid,
                        "tier": r.tier,
                        "priority": r.priority,
                        "at_s": round(r.created_ms / 1000 - t0, 2),
                        "in_window": in_failover(r, deadlines[r.priority], spans),
                        "message": error.get("message"),
                    }
                )
    warm_up = [r for r in sender.order if r.step == PREWARM_STEP]
    measured = [r for r in sender.order if r.step != PREWARM_STEP]
    inside = [r for r in measured if in_failover(r, deadlines[r.priority], spans)]
    covered = {r.rid for r in inside}
    outside = [r for r in measured if r.rid not in covered]
    realtime_out = [r for r in outside if r.priority == "realtime" and r.acked is not False]
    classes = {
        where: {
            p: class_summary([r for r in recs if r.priority == p], by_rid, deadlines[p]) for p in PRIORITIES
        }
        for where, recs in (("inside_windows", inside), ("outside_windows", outside), ("warm_up", warm_up))
    }

    def kind_sum(kind: str, key: str) -> int:
        return sum(x[key] for x in per_event if x["kind"] == kind)

    repeats_by_kind = {
        k: {
            "repeats": kind_sum(k, "repeats"),
            "requests_exposed": kind_sum(k, "requests_exposed"),
            "rate": round(kind_sum(k, "repeats") / kind_sum(k, "requests_exposed"), 4)
            if kind_sum(k, "requests_exposed")
            else None,
        }
        for k in ("sigkill", "sigterm", "broker", "crash")
    }
    repeats_by_kind["before_any_event"] = {"repeats": sum(1 for ev in owner.values() if ev is None)}
    return {
        "sent": len(sender.order),
        "acked": len(acked),
        "produce_failed": len(sender.order) - len(acked),
        "answered": sum(1 for r in acked if r.rid in by_rid),
        "replies_read_after_the_run": reader.missed_live,
        "lost": len(lost),
        "lost_examples": [
            {
                "request_id": r.rid,
                "priority": r.priority,
                "partition": r.partition,
                "at_s": round(r.created_ms / 1000 - t0, 2),
            }
            for r in lost[:10]
        ],
        "lost_by_partition": dict(Counter(str(r.partition) for r in lost)),
        "repeats": len(repeated),
        "repeat_rate": round(len(repeated) / len(acked), 4) if acked else None,
        "repeats_that_differ": len(differing),
        "differing_fields": dict(differ_fields),
        "differing_examples": examples,
        "repeats_by_event_kind": repeats_by_kind,
        "unexpected_reply_records": sum(len(v) for k, v in by_rid.items() if k not in sender.sent),
        "events": per_event,
        "classes": classes,
        "realtime_misses_outside": realtime_misses(realtime_out, by_rid, deadlines["realtime"], spans, t0),
        "errors_by_code_and_tier": dict(errs),
        "rate_limited_examples": limited,
        "windows": [[round(a - t0, 2), round(b - t0, 2)] for a, b in spans],
        "partitions_with_traffic": parts_with_traffic,
        "sender_lag_ms_max": round(max((r.lag_ms for r in sender.order), default=0.0), 1),
        "crashes": sum(1 for e in events if e.kind == "crash"),
        "max_kafka_lag_by_topic": run["lag"].peak_by_topic(),
    }


def targets(res: dict[str, Any], session_timeout_s: float) -> list[dict[str, Any]]:
    ev = res["events"]
    kills = [e for e in ev if e["kind"] == "sigkill"]
    served = [e["every_partition_served_after_s"] for e in kills]
    worst = None if not served or None in served else max(served)
    levels = [e["level_0_after_recovery_s"] for e in ev]
    lvl = None if not levels or None in levels else max(levels)
    rk = res["repeats_by_event_kind"]
    rt_out = res["classes"]["outside_windows"]["realtime"]["miss_rate"]
    return [
        target("lost requests", float(res["lost"]), "<=", 0.0),
        target("repeats that differ", float(res["repeats_that_differ"]), "<=", 0.0),
        target("repeats on SIGKILL / requests exposed", rk["sigkill"]["rate"] if kills else None, "<=", 0.01),
        target("repeats on SIGTERM", float(rk["sigterm"]["repeats"]), "<=", 0.0),
        target("every partition served again after a SIGKILL, s (worst)", worst, "<=", session_timeout_s + 3),
        target("realtime miss rate outside failover windows", rt_out, "<=", 0.003),
        target("degradation back to level 0 after recovery, s (worst)", lvl, "<=", 30.0),
    ]


def run(job: BenchRun, banking77_csv: str | Path | None = None) -> int:
    csv_path = resolve_csv(banking77_csv, job.scenario)
    questions = unseen_questions(csv_path)
    if job.broker is not None:
        return _run(job, job.broker, csv_path, questions)
    # a broker of its own, in the run's folder: this scenario restarts it, and a benchmark started
    # meanwhile on the shared .surge-bench/kafka must not find it half stopped (or start a second one on it)
    own = EmbeddedKafka(
        BENCH_DIR.absolute() / "runs" / f"failover-kafka-{uuid.uuid4().hex[:8]}", partitions=4, heap_mb=768
    )
    own.start()
    try:
        warm = start_warm(own)
        return _run(job, own, csv_path, questions, warm)
    finally:
        own.stop()
        shutil.rmtree(own.data_dir / "logs", ignore_errors=True)


def _run(
    job: BenchRun,
    broker: EmbeddedKafka,
    csv_path: Path,
    questions: tuple[list[tuple[str, str]], set[str]],
    warm: BrokerWarmUp | None = None,
) -> int:
    plan = QUICK if job.quick else FULL
    with BenchEnv(job.scenario, broker=broker) as env:
        d = env.deployment("failover", **DEFAULT_PATH)
        s = d.settings()
        pool = Pool(env, d)
        t_start = time.monotonic()
        for k in range(len(pool.current)):
            pool.start(k)
        try:
            for k in range(len(pool.current)):
                asyncio.run(pool.wait_ready(k))
        except SurgeError as exc:
            raise BenchError(f"failover workers did not start: {exc}") from exc
        startup_s = time.monotonic() - t_start
        offered = Offered.measure(
            "failover",
            questions,
            s,
            plan.limit_batches,
            lambda lim: LOAD * lim * plan.rate_scale,
            "offering",
            seed=13,
            given_qps=job.limit_qps,
        )
        limit, rate = offered.limit_rps, offered.rate
        bootstrap_before = env.bootstrap
        run_ = asyncio.run(_drive(env, pool, plan, offered))
        bootstrap_after = env.bootstrap
    deadlines = {p: s.deadline_ms(p) for p in PRIORITIES}
    res = analyse(run_, deadlines, s.session_timeout_s, s.partitions)
    t0 = run_["start"]
    out = {
        "plan": plan.__dict__,
        "limit": offered.limit,
        "limit_rps": limit,
        "offered_rps": round(rate, 2),
        "load_of_limit": LOAD * plan.rate_scale,
        "settings": default_path_env(s),
        "workload": {
            "csv": str(csv_path),
            "class_mix": dict(CLASS_MIX),
            "tenants": len(offered.stream.tenants),
            "users_per_tier": offered.pop.users,
        },
        "workers": 2,
        "worker_startup_s": round(startup_s, 1),
        "broker_warm_up": None if warm is None else warm.__dict__,
        "baseline_assigned": run_["baseline_assigned"],
        "broker_restart_failed": run_["broker_restart_failed"],
        "trace_of_lost": run_["trace_of_lost"],
        "broker_same_address_after_restart": bootstrap_before == bootstrap_after,
        "duration_s": round(run_["end"] - t0, 1),
        "drain_waited_s": round(run_["drain_waited_s"], 1),
        **res,
        "targets": targets(res, s.session_timeout_s),
        "notes": (
            "lost: acked by the broker, no reply by the end of the drain (it ends early once no reply came "
            "for drain_idle_s); trace_of_lost says where they are. repeats: request_ids with more than one "
            "reply record; they differ when any field but timings differs. A repeat belongs to the last "
            "event before its second reply (a redelivery follows a rebalance); the SIGKILL rate divides by "
            "the requests sent from 5 s before each kill until the next event. served again: every "
            "partition with traffic got a reply produced (record timestamp) after the event (after the "
            "broker answered again, for the broker restart). misses: deadline_exceeded + ok after the class "
            "deadline + lost, inside a window when the request was sent (its scheduled send time) before "
            "the window's end and its class deadline fell at or after the window's start (a request in "
            "flight at a kill is the kill's), outside otherwise. warm_up: the requests of the warm-up load "
            "before the run (prewarm_s, answered in full before it starts), in neither; lost and repeats "
            "count them too. level 0: from recovery until every worker reports level 0 for good (before "
            "the next event)."
        ),
    }
    events: list[Event] = run_["events"]

    def plot(pp: Path) -> None:
        timeline_plot(
            pp,
            f"{job.title}: 2 workers at {rate:.0f} req/s",
            run_["sender"],
            run_["reader"],
            run_["scraper"].samples,
            t0,
            marks=[(e.t, e.label) for e in events],
            spans=[(e.t, e.window_end) for e in events if e.window_end],
            deadlines=deadlines,
            with_assigned=True,
            lag=run_["lag"].totals(),
        )

    return report(job, out, plot)
