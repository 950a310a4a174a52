"""A client's record the broker refuses fails its answer's future at once (docs/architecture.md,
"Guarantees"): the request or event was never written, so nothing will answer it, and a caller that
does not await the delivery itself waited for good. Real broker: a topic whose max.message.bytes
the record exceeds, while the client's own size limit lets it through."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from aiokafka.admin import AIOKafkaAdminClient, NewTopic

from pipeline.client import SurgeClient
from pipeline.devtools.broker import EmbeddedKafka
from pipeline.exceptions import BrokerError
from pipeline.risk_client import RiskClient

pytestmark = pytest.mark.integration


async def _small_topics(bootstrap: str, *names: str) -> None:
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics(
            [NewTopic(n, 1, 1, topic_configs={"max.message.bytes": "2000"}) for n in names]
        )
    finally:
        await admin.close()


async def test_a_refused_request_or_event_fails_its_future(kafka: EmbeddedKafka) -> None:
    tag = uuid.uuid4().hex[:8]
    requests, replies, events, decisions = (f"{tag}.{n}" for n in ("req", "rep", "ev", "dec"))
    await _small_topics(kafka.bootstrap, requests, replies, events, decisions)
    async with SurgeClient(kafka.bootstrap, requests_topic=requests, reply_topic=replies) as c:
        ok = await c.submit({"request_id": "r-small", "user_id": "u1", "prompt": "hi"})
        await c.producer.flush()  # its own batch: the broker refuses a batch whole
        refused = await c.submit({"request_id": "r-big", "user_id": "u1", "prompt": "x" * 5000})
        with pytest.raises(BrokerError, match="r-big was not written to Kafka"):
            await asyncio.wait_for(refused, 20)
        assert not ok.done() and set(c.waiting()) == {"r-small"}, "the small one still waits"
    async with RiskClient(kafka.bootstrap, events_topic=events, decisions_topic=decisions) as r:
        pending = await r.send({"event_id": "e-big", "account": "a1", "note": "x" * 5000})
        with pytest.raises(BrokerError, match="e-big was not written to Kafka"):
            await asyncio.wait_for(pending, 20)
        assert r.waiting() == {}
