"""The risk worker's escalation agent: borderline decisions put to the model path
(docs/architecture.md, "Risk: escalation"; the decision logic is :mod:`pipeline.risk.escalation`).

The stage that decides an event writes a borderline decision, with its event, to the internal topic
``<app id>-risk-escalate`` (keyed by account) instead of ``surge.risk.decisions``. This agent reads
that topic through the worker's Acker like the stages read theirs, sends each case to
``surge.requests`` as a real-time request whose ``reply_to`` is the escalation reply topic, waits for
the reply (every risk worker reads every partition of that topic, without a consumer group, and
takes the replies it waits for), publishes the final decision and only then finishes the record. A
worker killed while it waits leaves the record uncommitted, and whoever reads it next decides it again:
asking again under the same request id while the event's budget lasts (the request path answers what it
recorded the first time), else locally.

Each request is signed (:func:`pipeline.auth.escalation_signer`, a secret derived from the escalation
key), whether or not the request workers ask for signatures: where they do, they accept it as tenant
``risk_escalation_tenant``, tier premium, up to real time (docs/architecture.md, "Tenant isolation").
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import faust
from faust.types import EventT

from agents.acks import Ticket
from agents.runtime import Runtime, unacked
from pipeline.auth import escalation_signer_of, reply_signed_by, sign
from pipeline.client import partitions_of
from pipeline.kafka_security import client_options
from pipeline.metrics import RiskMetrics
from pipeline.records import now_ms
from pipeline.risk import jsonio
from pipeline.risk.escalation import (
    EscalationPolicy,
    final_decision,
    no_time_decision,
    request_id,
    request_record,
)
from pipeline.settings import Settings

log = logging.getLogger("surge.risk.escalation")


def escalate_topic(settings: Settings) -> str:
    """The internal topic of decisions waiting for the model path (keyed by account)."""
    return f"{settings.app_id}-risk-escalate"


def policy_of(s: Settings) -> EscalationPolicy:
    return EscalationPolicy(
        min_score=s.risk_escalation_min_score,
        budget_ms=s.risk_escalation_budget_ms,
        wait_max_ms=s.risk_escalation_wait_max_ms,
        may_lower=s.risk_escalation_may_lower,
    )


def case_record(local: dict[str, Any], event: dict[str, Any]) -> bytes:
    """What the deciding stage writes to the escalate topic: the local decision and its event."""
    return jsonio.dumps({"d": local, "e": event})


class Escalations:
    """Escalations in flight in one risk worker, and the reader of their replies."""

    def __init__(self, rt: Runtime, metrics: RiskMetrics) -> None:
        self.rt = rt
        s = self.s = rt.settings
        self.metrics = metrics
        self.policy = policy_of(s)
        self.enabled = s.risk_escalation_enabled
        self.key = s.risk_escalation_key.get_secret_value().encode() if s.risk_escalation_key else None
        #: signs the requests (None without a key, when the agent sends none)
        self.signer = escalation_signer_of(s)
        #: the key a reply must be signed with where the request workers verify (and so sign) them
        self.reply_signer = self.signer if s.requests_signed else None
        self.reply_topic = s.risk_escalation_replies
        #: replies awaited, by request id
        self.waiting: dict[str, asyncio.Future[dict[str, Any]]] = {}
        #: set once the reply reader is positioned at the end of every partition
        self.listening = asyncio.Event()
        self._slots = asyncio.Semaphore(s.risk_escalation_max_pending)
        self._tasks: set[asyncio.Task[None]] = set()
        self.escalated = 0
        self.unknown_replies = 0

    def wanted(self, decision: str, score: float | None) -> bool:
        """Called by the deciding stage for each event it decided: escalate it?"""
        return self.enabled and self.policy.wanted(decision, score)

    # ---- replies -----------------------------------------------------------------------------------
    async def read_replies(self) -> None:
        """Read every partition of the escalation reply topic from its end (no consumer group: a
        reply lands on the partition of its user, whichever worker asked) and hand each reply to the
        escalation waiting for it; others, and replies not signed with the escalation signer where
        requests are signed, are counted (``unknown_reply``) and dropped. Runs whenever
        there is a key (agents/risk.py, ``reads_escalations``): cases written while escalation was on
        are still asked after it was turned off."""
        from aiokafka import AIOKafkaConsumer, TopicPartition

        consumer = AIOKafkaConsumer(
            bootstrap_servers=self.s.bootstrap_servers,
            enable_auto_commit=False,
            # the broker answers a fetch as soon as a reply arrives; the wait only bounds idle polling
            fetch_max_wait_ms=250,
            **client_options(self.s),
        )
        try:
            await consumer.start()
            parts = await partitions_of(consumer, self.reply_topic, tries=100)
            tps = [TopicPartition(self.reply_topic, p) for p in parts]
            consumer.assign(tps)
            await consumer.seek_to_end(*tps)
            for tp in tps:  # resolve the positions now: a reply sent after this is read
                await consumer.position(tp)
            self.listening.set()
            while True:
                batch = await consumer.getmany(timeout_ms=500)
                for records in batch.values():
                    for rec in records:
                        self._deliver(rec.value, rec.headers)
        finally:
            self.listening.clear()
            await consumer.stop()

    def _deliver(self, raw: bytes | None, headers: Any = None) -> None:
        if self.reply_signer is not None and not reply_signed_by(self.reply_signer, headers, raw):
            # another tenant's request can name this topic and an escalation's request id: its reply
            # is signed with its own key, never the escalation signer's (docs/architecture.md,
            # "Tenant isolation")
            log.warning("escalation reply not signed by the escalation signer: dropped")
            self.unknown_replies += 1
            self.metrics.escalations.labels(outcome="unknown_reply").inc()
            return
        try:
            reply = jsonio.loads(raw or b"")
            rid = reply.get("request_id") if isinstance(reply, dict) else None
        except ValueError:
            rid = None
        fut = self.waiting.get(rid) if isinstance(rid, str) else None
        if fut is None or fut.done():
            self.unknown_replies += 1
            self.metrics.escalations.labels(outcome="unknown_reply").inc()
            return
        fut.set_result(reply)

    # ---- cases -------------------------------------------------------------------------------------
    async def run(self, stream: faust.StreamT) -> None:
        """Reader of the escalate topic: takes each record on in the Acker's ledger and escalates it
        in a task of its own (at most ``risk_escalation_max_pending`` at once; the rest wait in Kafka)."""
        acker, life = self.rt.acker, self.rt.lifecycle
        async for event in unacked(stream).events():
            generation = acker.generation
            await life.hold_if_stopping()
            ticket = await acker.track(event, generation)
            if ticket is None:  # stale, or a repeat delivery of an offset taken on already
                continue
            await self._slots.acquire()
            task = asyncio.ensure_future(self._guarded(event, ticket, generation))
            self._tasks.add(task)
            task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        self._slots.release()

    async def _guarded(self, event: EventT, ticket: Ticket, generation: int) -> None:
        try:
            await self._one(event, ticket, generation)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a send that failed: stop rather than finish what was not done
            log.critical("escalation failed (%r); stopping the worker so nothing is lost", exc)
            await self.rt.app.crash(exc)

    async def _one(self, event: EventT, ticket: Ticket, generation: int) -> None:
        """Escalate one case and publish its decision; the record is finished once the broker has
        the request and the decision. A rebalance meanwhile: nothing is published or finished (the
        partition's owner reads the case again and asks again under the same id)."""
        rt, acker = self.rt, self.rt.acker
        try:
            doc = jsonio.loads(event.message.value or b"")
            local, ev = doc["d"], doc["e"]
            account = local["account"]
            if not (isinstance(account, str) and isinstance(local["event_id"], str) and isinstance(ev, dict)):
                raise TypeError("account, event_id and event must be strings and an object")
        except (ValueError, KeyError, TypeError) as exc:
            dead = await rt.deadletter(event, "internal", f"not an escalation case: {exc!r}")
            acker.ack_after([ticket], [dead])
            return
        assert self.key is not None  # the agent runs only with a key (agents/risk.py, reads_escalations)
        await self.listening.wait()
        asked_ms = now_ms()
        produced = (local.get("timings") or {}).get("produced_ms", asked_ms)
        left = self.policy.left_ms(produced, asked_ms)
        if left <= 0:  # behind a backlog, or read again after a crash: no time to ask
            rid = request_id(self.key, account, local["event_id"])
            final = no_time_decision(local, self.policy, rid=rid, left_ms=left, decided_ms=asked_ms)
            if acker.generation == generation:
                out = await rt.send(rt.topics.risk_decisions, account, jsonio.dumps(final))
                acker.ack_after([ticket], [out])
                self._count(final, "no_time")
            return
        req = request_record(
            local,
            ev,
            self.policy,
            key=self.key,
            tenant=self.s.risk_escalation_tenant,
            reply_to=self.reply_topic,
            now_ms=asked_ms,
            model=self.s.risk_escalation_model,
        )
        rid = req["request_id"]
        fut = self.waiting.get(rid)
        if fut is None or fut.done():  # a copy of the same case already waiting shares its reply
            fut = self.waiting[rid] = asyncio.get_running_loop().create_future()
        self.escalated += 1
        value = jsonio.dumps(req)
        assert self.signer is not None  # set with the key
        sent = await rt.send(rt.topics.requests, account, value, headers=sign(self.signer, value))
        try:
            reply: dict[str, Any] | None = await asyncio.wait_for(
                asyncio.shield(fut), self.policy.wait_s(produced, asked_ms)
            )
        except TimeoutError:
            reply = None
        finally:
            if self.waiting.get(rid) is fut:
                del self.waiting[rid]
        final, outcome = final_decision(local, reply, self.policy, rid=rid, decided_ms=now_ms())
        if acker.generation != generation:
            return
        out = await rt.send(rt.topics.risk_decisions, account, jsonio.dumps(final))
        acker.ack_after([ticket], [sent, out])
        self._count(final, outcome)

    def _count(self, final: dict[str, Any], outcome: str) -> None:
        m = self.metrics
        m.escalations.labels(outcome=outcome).inc()
        m.decisions.labels(decision=final["decision"]).inc()
        timings = final.get("timings") or {}
        if "produce_to_decision_ms" in timings:
            m.decision_latency.observe(timings["produce_to_decision_ms"] / 1000)

    def status(self) -> dict[str, Any]:
        return {
            "enabled": self.enabled,
            "reply_topic": self.reply_topic,
            "listening": self.listening.is_set(),
            "escalated": self.escalated,
            "waiting": len(self.waiting),
            "unknown_replies": self.unknown_replies,
        }
