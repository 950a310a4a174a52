"""A producer-side client of the risk path: send RiskEvents, await their RiskDecisions by event_id,
publish rules. Used by ``surge risk demo``, ``surge bench risk`` and the tests
(docs/architecture.md, "Risk").

It reads the decision topic without a consumer group (all partitions, from the end at start), so
several clients can share it; each keeps the decisions of the events it is waiting for.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

from pipeline.client import ReplyClient, partitions_of
from pipeline.risk.records import RiskDecision
from pipeline.risk.rules import Rule

log = logging.getLogger("surge.risk.client")

#: how long a rules transaction left open (its publisher crashed) holds back the workers' reads
RULES_TRANSACTION_TIMEOUT_MS = 10_000


class RiskClient(ReplyClient[RiskDecision]):
    """Async client of one deployment's risk topics."""

    topic_kind = "decision topic"

    def __init__(
        self,
        bootstrap: str,
        *,
        events_topic: str,
        decisions_topic: str,
        rules_topic: str | None = None,
        on_decision: Callable[[RiskDecision, float], None] | None = None,
        client_options: dict[str, Any] | None = None,
    ) -> None:
        opts = client_options or {}
        self.bootstrap = bootstrap
        self.options = opts
        super().__init__(
            AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=1, **opts),
            AIOKafkaConsumer(
                bootstrap_servers=bootstrap,
                enable_auto_commit=False,
                auto_offset_reset="latest",
                fetch_max_wait_ms=20,
                **opts,
            ),
            decisions_topic,
        )
        self.events_topic = events_topic
        self.decisions_topic = decisions_topic
        self.rules_topic = rules_topic
        self.on_decision = on_decision
        #: every decision read, in arrival order, with the monotonic time it arrived
        self.decisions: list[tuple[RiskDecision, float]] = []

    async def _read(self) -> None:
        while True:
            batch = await self.consumer.getmany(timeout_ms=100)
            now = time.monotonic()
            for records in batch.values():
                for msg in records:
                    try:
                        d = RiskDecision.model_validate_json(msg.value)
                    except Exception:
                        log.warning("undecodable decision at %s[%d]@%d", msg.topic, msg.partition, msg.offset)
                        continue
                    self.decisions.append((d, now))
                    if self.on_decision is not None:
                        self.on_decision(d, now)
                    self._answered(d.event_id, d)

    async def send(self, event: dict[str, Any], *, wait: bool = False) -> asyncio.Future[RiskDecision]:
        """Produce one event (keyed by its account); returns the future of its decision, failed with
        :class:`~pipeline.exceptions.BrokerError` if the broker never takes the event (``wait``:
        the send itself raises then)."""
        eid = str(event.get("event_id"))
        fut = self.expect(eid)
        key = event.get("account")
        value, k = json.dumps(event).encode(), str(key).encode() if key else None
        try:
            if wait:
                await self.producer.send_and_wait(self.events_topic, value=value, key=k)
            else:
                self.fail_unsent(eid, await self.producer.send(self.events_topic, value=value, key=k))
        except BaseException:
            self.forget(eid)
            raise
        return fut

    async def send_raw(self, key: bytes | None, value: bytes) -> None:
        """Produce raw bytes to the event topic (bad-input tests)."""
        await self.producer.send_and_wait(self.events_topic, value=value, key=key)

    async def decide(self, event: dict[str, Any], timeout_s: float = 30.0) -> RiskDecision:
        """Send one event and wait for its decision."""
        fut = await self.send(event)
        await self.producer.flush()
        return await asyncio.wait_for(fut, timeout_s)

    async def publish_rules(self, rules: Iterable[Rule]) -> None:
        """Write rules to the rules topic (keyed by rule id), all in one transaction
        (:func:`publish_rules`)."""
        if self.rules_topic is None:
            raise RuntimeError("no rules topic given")
        await publish_rules(self.bootstrap, self.rules_topic, list(rules), options=self.options)

    async def delete_rule(self, rule_id: str) -> None:
        """A tombstone for ``rule_id`` on the rules topic."""
        if self.rules_topic is None:
            raise RuntimeError("no rules topic given")
        await self.producer.send_and_wait(self.rules_topic, key=rule_id.encode(), value=None)


async def read_rule_records(
    bootstrap: str, topic: str, options: dict[str, Any] | None = None, tries: int = 30
) -> list[tuple[bytes | None, bytes | None]]:
    """Every committed record of the rules topic, in order, tombstones included, as ``(key, value)``
    (records of aborted or open transactions are not read: the workers never apply them); none if
    the topic does not exist."""
    consumer = AIOKafkaConsumer(
        bootstrap_servers=bootstrap,
        enable_auto_commit=False,
        isolation_level="read_committed",
        **(options or {}),
    )
    try:
        await consumer.start()
        tps = [TopicPartition(topic, p) for p in await partitions_of(consumer, topic, tries=tries)]
        if not tps:
            return []
        consumer.assign(tps)
        await consumer.seek_to_beginning(*tps)
        end = await consumer.end_offsets(tps)
        out: list[tuple[bytes | None, bytes | None]] = []
        while True:
            positions = [await consumer.position(tp) for tp in tps]
            if all(pos >= end[tp] for pos, tp in zip(positions, tps, strict=True)):
                return out
            batch = await consumer.getmany(timeout_ms=200)
            out += [(r.key, r.value) for recs in batch.values() for r in recs]
    finally:
        await consumer.stop()


async def publish_rules(
    bootstrap: str,
    topic: str,
    rules: Sequence[Rule],
    *,
    options: dict[str, Any] | None = None,
    only_if_empty: bool = False,
) -> bool:
    """Write ``rules`` to the rules topic in one Kafka transaction: the risk workers read it with
    ``read_committed`` and apply what one read brings as one change, so no decision names a version
    that holds part of the set (docs/architecture.md, "Risk: rules"). Returns whether it was written.

    ``only_if_empty``: write only if the topic holds no committed record, checked once the producer
    is ready (workers starting together on an empty topic: each publishes only if none has yet; two
    that check at the same moment both publish the same whole set, which reads as one version). The
    transactional id is this call's own (``surge-rules-<uuid>``): producers sharing one fence each
    other, which leaves the fenced one's futures failed and unread. A transaction left open by a
    crash holds back readers for at most ``RULES_TRANSACTION_TIMEOUT_MS``."""
    producer = AIOKafkaProducer(
        bootstrap_servers=bootstrap,
        acks="all",
        enable_idempotence=True,
        transactional_id=f"surge-rules-{uuid.uuid4().hex}",
        transaction_timeout_ms=RULES_TRANSACTION_TIMEOUT_MS,
        **(options or {}),
    )
    try:
        await producer.start()
        if only_if_empty and await read_rule_records(bootstrap, topic, options, tries=100):
            return False
        async with producer.transaction():
            sent = [
                await producer.send(topic, key=rule.rule_id.encode(), value=rule.model_dump_json().encode())
                for rule in rules
            ]
            # every delivery awaited, so a failure is raised here (and the transaction aborted)
            failed = [
                r for r in await asyncio.gather(*sent, return_exceptions=True) if isinstance(r, BaseException)
            ]
            if failed:
                raise failed[0]
        return True
    finally:
        await producer.stop()
