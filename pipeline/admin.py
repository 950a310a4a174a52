"""Create surge's topics on the cluster (idempotent)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from pipeline.exceptions import BrokerError
from pipeline.settings import Settings
from pipeline.topics import TopicNames

log = logging.getLogger("surge.admin")


async def ensure_topics(settings: Settings, extra: Iterable[str] = (), timeout_s: float = 30.0) -> list[str]:
    """Create every surge topic (and ``extra`` ones) that does not exist yet; returns the created names."""
    names = [*TopicNames(settings.topic_prefix).all(), *extra]
    admin = AIOKafkaAdminClient(
        bootstrap_servers=settings.bootstrap_servers, request_timeout_ms=int(timeout_s * 1000)
    )
    try:
        await asyncio.wait_for(admin.start(), timeout_s)
    except Exception as exc:
        raise BrokerError(f"cannot reach Kafka at {settings.bootstrap_servers}: {exc!r}") from exc
    try:
        existing = set(await admin.list_topics())
        todo = [n for n in dict.fromkeys(names) if n not in existing]
        if todo:
            with contextlib.suppress(TopicAlreadyExistsError):
                await admin.create_topics(
                    [NewTopic(n, settings.partitions, settings.replication_factor) for n in todo]
                )
            log.info("created topics %s", todo)
        return todo
    finally:
        await admin.close()
