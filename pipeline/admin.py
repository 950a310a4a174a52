"""Create surge's topics on the cluster (idempotent)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Iterable

from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.errors import TopicAlreadyExistsError

from pipeline.exceptions import BrokerError
from pipeline.kafka_security import client_options
from pipeline.settings import Settings
from pipeline.topics import TopicNames

log = logging.getLogger("surge.admin")


#: Faust tables of a worker; their changelog topics are created up front (compacted) so that the
#: first table write never races the topic's creation (Faust's PartitionsMismatch)
TABLES = ("ratelimit", "answers", "replybook")


def changelog_topics(settings: Settings) -> list[str]:
    return [f"{settings.app_id}-{table}-changelog" for table in TABLES]


def changelog_config(settings: Settings, topic: str) -> dict[str, str]:
    """Topic configs of a table's changelog: compacted; the reply book's also expires its records
    (twice the reply TTL), so a fresh worker's recovery reads a bounded history."""
    if topic.endswith("-replybook-changelog"):
        return {
            "cleanup.policy": "compact,delete",
            "retention.ms": str(int(2 * settings.reply_record_ttl_s * 1000)),
        }
    return {"cleanup.policy": "compact"}


def topic_config(
    settings: Settings, topic: str, compacted: set[str], *, broker_time: bool = True
) -> dict[str, str]:
    """Topic configs of a topic surge creates: changelogs as :func:`changelog_config`; the request
    topic stamps each record with the broker's time when it appends it (``LogAppendTime``), since
    deadlines count from a request's record timestamp when it names no ``created_at``, and a
    producer's own timestamp (``CreateTime``) is whatever the producer says: stamped a little in the
    past, a request would miss its deadline inside the worker and count against the degradation
    controller's miss rate, degrading service for everyone (docs/architecture.md, "Degradation").
    ``broker_time=False`` keeps the producer's: a replay copies recorded requests with their
    timestamps, which must survive the copy.

    The topics clients write (requests, risk events) are stored uncompressed
    (``compression.type=uncompressed``): the broker then decompresses a producer's compressed batch
    and refuses it when it is larger than ``max.message.bytes`` decompressed. Stored as the producer
    sent it, a 50 KB gzip batch held a 50 MB record (1 MB of gzip holds about 1 GB) that every
    consumer decompressed whole in memory, past every size check of the worker, and read again
    after each restart (docs/architecture.md, "Security")."""
    if topic in compacted:
        return changelog_config(settings, topic)
    names = TopicNames(settings.topic_prefix)
    config: dict[str, str] = {}
    if topic in (names.requests, names.risk_events):
        config["compression.type"] = "uncompressed"
    if broker_time and topic == names.requests:
        config["message.timestamp.type"] = "LogAppendTime"
    return config


async def ensure_topics(
    settings: Settings,
    extra: Iterable[str] = (),
    timeout_s: float = 30.0,
    compacted_extra: Iterable[str] = (),
    *,
    broker_time: bool = True,
) -> list[str]:
    """Create every surge topic, the tables' changelogs, ``extra`` ones and ``compacted_extra`` ones
    (compacted) that do not exist yet, configured by :func:`topic_config` (``broker_time``: the
    request topic's records carry the broker's time)."""
    names = [*TopicNames(settings.topic_prefix).all(), *extra]
    compacted = set(changelog_topics(settings)) | set(compacted_extra)
    names += sorted(compacted)
    async with _admin(settings, timeout_s) as admin:
        existing = set(await admin.list_topics())
        todo = [n for n in dict.fromkeys(names) if n not in existing]
        if todo:
            with contextlib.suppress(TopicAlreadyExistsError):
                await admin.create_topics(
                    [
                        NewTopic(
                            n,
                            settings.partitions,
                            settings.replication_factor,
                            topic_configs=topic_config(settings, n, compacted, broker_time=broker_time),
                        )
                        for n in todo
                    ]
                )
            log.info("created topics %s", todo)
        return todo


async def cluster_id(settings: Settings, timeout_s: float = 30.0) -> str:
    """The id of the Kafka cluster at ``settings.bootstrap_servers`` (:mod:`pipeline.statedir`)."""
    async with _admin(settings, timeout_s) as admin:
        return str((await admin.describe_cluster())["cluster_id"])


@contextlib.asynccontextmanager
async def _admin(settings: Settings, timeout_s: float) -> AsyncIterator[AIOKafkaAdminClient]:
    """A started admin client of the cluster; :class:`BrokerError` when it cannot be reached."""
    admin = AIOKafkaAdminClient(
        bootstrap_servers=settings.bootstrap_servers,
        request_timeout_ms=int(timeout_s * 1000),
        **client_options(settings),
    )
    try:
        await asyncio.wait_for(admin.start(), timeout_s)
    except Exception as exc:
        raise BrokerError(f"cannot reach Kafka at {settings.bootstrap_servers}: {exc!r}") from exc
    try:
        yield admin
    finally:
        await admin.close()
