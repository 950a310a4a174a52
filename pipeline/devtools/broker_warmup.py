"""Warm a freshly started broker's JVM before a benchmark measures through it.

A broker that has just started has not compiled its produce and fetch paths yet: in the first second
of traffic its JIT compiler and its slower interpreted request handling took about a fifth of a core
more than later (on the 2-core machine that is most of the headroom), and a request's hop from the
request topic to the intake took twice as long. Real-time requests sent then missed their 200 ms
deadline although no worker had failed (docs/architecture.md, "Performance: how it is measured"). A
production broker
has run for days; a benchmark that starts its own broker seconds before its load measures the JVM's
start instead of the pipeline. :func:`warm_broker` sends small records one request each (the shape of
the pipeline's own traffic) to a scratch topic while a consumer reads them back, for a few seconds,
then deletes the topic. The workers are not warmed by it: they start after it, cold.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from dataclasses import dataclass
from typing import Any

#: records sent at once (each its own produce request): a few, like several producers at a time
IN_FLIGHT = 8
#: partitions of the scratch topic, so the broker's fetch path serves several at once
PARTITIONS = 4
#: the record: about the size of a request
PAYLOAD = b'{"warm_up": "a small record, about the size of one request to the pipeline"}' * 3


@dataclass(frozen=True)
class BrokerWarmUp:
    """What :func:`warm_broker` did."""

    seconds: float
    sent: int
    read: int
    topic: str

    def line(self) -> str:
        rate = self.sent / self.seconds if self.seconds else 0.0
        return (
            f"broker warm-up: {self.sent} records sent and {self.read} read back in {self.seconds:.1f} s "
            f"({rate:.0f}/s) on {self.topic}, deleted"
        )


async def warm_broker(bootstrap: str, seconds: float, security: dict[str, Any] | None = None) -> BrokerWarmUp:
    """Produce and fetch small records on a scratch topic for ``seconds``, then delete the topic.

    ``security``: :func:`pipeline.kafka_security.client_options` of the deployment."""
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    sec = security or {}
    topic = f"surge-broker-warmup-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, **sec)
    try:
        await admin.start()
        await admin.create_topics([NewTopic(topic, PARTITIONS, 1)])
        producer = AIOKafkaProducer(bootstrap_servers=bootstrap, linger_ms=0, acks="all", **sec)
        consumer = AIOKafkaConsumer(
            topic,
            bootstrap_servers=bootstrap,
            group_id=None,
            auto_offset_reset="earliest",
            enable_auto_commit=False,
            fetch_max_wait_ms=20,
            **sec,
        )
        await producer.start()
        await consumer.start()
        read = 0
        sent = 0
        sending = True
        caught_up = asyncio.Event()

        async def reader() -> None:
            nonlocal read
            async for _ in consumer:
                read += 1
                if not sending and read >= sent:
                    caught_up.set()

        task = asyncio.create_task(reader())
        t0 = time.monotonic()
        try:
            while time.monotonic() - t0 < seconds:
                await asyncio.gather(
                    *(
                        producer.send_and_wait(topic, PAYLOAD, partition=i % PARTITIONS)
                        for i in range(IN_FLIGHT)
                    )
                )
                sent += IN_FLIGHT
            took = time.monotonic() - t0
            sending = False
            if read < sent:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(caught_up.wait(), 5.0)
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            await producer.stop()
            await consumer.stop()
        with contextlib.suppress(Exception):  # a scratch topic left behind harms no measurement
            await admin.delete_topics([topic])
        return BrokerWarmUp(round(took, 2), sent, read, topic)
    finally:
        await admin.close()
