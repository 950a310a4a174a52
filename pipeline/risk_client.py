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
from collections.abc import Callable, Iterable
from typing import Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from pipeline.client import ReplyClient
from pipeline.risk.records import RiskDecision
from pipeline.risk.rules import Rule

log = logging.getLogger("surge.risk.client")


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
        """Produce one event (keyed by its account); returns the future of its decision."""
        fut = self.expect(str(event.get("event_id")))
        key = event.get("account")
        send = self.producer.send_and_wait if wait else self.producer.send
        await send(
            self.events_topic, value=json.dumps(event).encode(), key=str(key).encode() if key else None
        )
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
        """Write rules to the rules topic (keyed by rule id)."""
        if self.rules_topic is None:
            raise RuntimeError("no rules topic given")
        for rule in rules:
            await self.producer.send_and_wait(
                self.rules_topic, key=rule.rule_id.encode(), value=rule.model_dump_json().encode()
            )

    async def delete_rule(self, rule_id: str) -> None:
        """A tombstone for ``rule_id`` on the rules topic."""
        if self.rules_topic is None:
            raise RuntimeError("no rules topic given")
        await self.producer.send_and_wait(self.rules_topic, key=rule_id.encode(), value=None)
