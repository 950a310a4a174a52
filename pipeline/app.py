"""The Faust app of surge, configured from :class:`Settings`.

Every surge topic carries raw bytes: decoding happens in the agents, so a record that is not
JSON gets an error reply and a dead letter instead of crashing a stream.

The worker's web port serves only what surge registers (``/metrics``, ``/status``, ``/healthz``) and
Faust's plain index: Faust's built-in views are off (:data:`WEB_VIEWS_OFF`), since ``/table/...``
reads table data (cached questions and answers of every tenant), and the statistics, graph and
router views describe the cluster's internals (docs/architecture.md "Security").
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import faust
from faust.auth import SASLCredentials, SSLCredentials
from faust.transport.utils import DefaultSchedulingStrategy
from faust.types import TP
from faust.types.auth import CredentialsT

from pipeline.compat import (
    bound_produce_request_wait,
    eager_delivery,
    leave_group_on_close_as_static_member,
    prompt_table_manager,
    set_fetch_max_wait,
)
from pipeline.delivery_order import rank_groups, topic_ranks
from pipeline.kafka_security import ssl_context
from pipeline.settings import Settings
from pipeline.topics import TopicNames

#: Faust settings that turn its built-in web views off: /table (table data), /router (cluster
#: topology; surge routes nothing between workers), the statistics and /assignment pages, /graph,
#: /performance
WEB_VIEWS_OFF: dict[str, bool] = {
    "web_tables_enabled": False,
    "web_router_enabled": False,
    "web_stats_enabled": False,
    "web_graph_enabled": False,
    "web_metrics_enabled": False,
}


def faust_credentials(settings: Settings) -> CredentialsT | None:
    """Faust's ``broker_credentials`` for ``kafka_security_protocol`` (None for PLAINTEXT)."""
    proto = settings.kafka_security_protocol
    ctx = ssl_context(settings)
    if proto.startswith("SASL_"):
        password = settings.kafka_sasl_password
        return SASLCredentials(
            username=settings.kafka_sasl_username,
            password=password.get_secret_value() if password else None,
            ssl_context=ctx,
            mechanism=settings.kafka_sasl_mechanism,
        )
    if ctx is not None:
        return SSLCredentials(ctx)
    return None


def table_store_options(settings: Settings) -> dict[str, Any]:
    """RocksDB options of every surge table partition (a Faust ``Table(options=...)``).

    Faust's defaults (a 64 MiB write buffer, three of them, and a 2 GiB block cache per partition)
    let a worker's memory follow whatever clients write: with these, each partition store holds at
    most ``2 * table_write_buffer_mb + table_block_cache_mb`` MiB (docs/architecture.md, "Security").
    A fresh dict per call: Faust's store pops keys from the one it is given.
    """
    mb = 1024 * 1024
    return {
        "write_buffer_size": settings.table_write_buffer_mb * mb,
        "max_write_buffer_number": 2,
        "block_cache_size": settings.table_block_cache_mb * mb,
        "block_cache_compressed_size": settings.table_block_cache_mb * mb,
    }


def priority_scheduler(topics: TopicNames) -> type[DefaultSchedulingStrategy]:
    """Faust's scheduling strategy (the order in which a poll's records reach the streams) with the
    request topic first, then the work topics from real-time to offline, then the rest as Faust
    orders them (pipeline/delivery_order.py; docs/architecture.md, "Delivering records")."""
    ranks = topic_ranks(topics)

    class PriorityScheduling(DefaultSchedulingStrategy):
        def iterate(self, records: Mapping[TP, list[Any]]) -> Iterator[tuple[TP, Any]]:
            index = self.map_from_records(records)
            for group in rank_groups(index, ranks):
                yield from self.records_iterator({topic: index[topic] for topic in group})

    return PriorityScheduling


def create_app(settings: Settings) -> faust.App:
    """A Faust app with RocksDB tables, the configured broker and at-least-once commits after acks."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    # Faust's worker consumer would otherwise wait up to 1.5 s per fetch (see set_fetch_max_wait)
    set_fetch_max_wait(settings.fetch_max_wait_ms, settings.fetch_prefetch_backoff_ms)
    if settings.eager_delivery_enabled:
        # Faust's consumer would otherwise spend four tasks on every record it hands to a stream
        # (see eager_delivery; docs/architecture.md, "Delivering records")
        eager_delivery(settings.eager_delivery_yield_every_records)
    # a produce request the broker never answers would hold every later record for Faust's 20 minutes
    # (see bound_produce_request_wait; docs/architecture.md, "Guarantees")
    bound_produce_request_wait(settings.producer_request_timeout_ms)
    # the settings that are there only sometimes, and the web views; a dict[str, Any] because
    # faust.App takes them as ``**options: Any`` (typed dicts would be matched to its typed parameters)
    options: dict[str, Any] = dict(WEB_VIEWS_OFF)
    if settings.static_instance_id:
        # a static member leaves the group when it stops on purpose (SIGTERM), so its partitions move
        # at once; a crashed one is still waited for (docs/architecture.md, "Readiness and failover")
        leave_group_on_close_as_static_member()
        # Faust puts its URL into the group's assignment and checks it when a static member gets its
        # cached assignment back: keep it stable across restarts (surge routes nothing by it)
        options["canonical_url"] = f"http://{settings.static_instance_id}.worker"
    if settings.delivery_order == "priority":
        # the request topic's records first, then the work topics' by class (see priority_scheduler)
        options["ConsumerScheduler"] = priority_scheduler(TopicNames(settings.topic_prefix))
    credentials = faust_credentials(settings)
    if credentials is not None:
        options["broker_credentials"] = credentials
    return faust.App(
        settings.group_id,
        broker=settings.broker,
        store="rocksdb://",
        datadir=str(settings.data_dir.absolute()),
        web_port=settings.web_port,
        web_bind="0.0.0.0",
        web_enabled=True,
        autodiscover=False,
        topic_partitions=settings.partitions,
        topic_replication_factor=settings.replication_factor,
        processing_guarantee=settings.processing_guarantee,
        broker_commit_interval=settings.commit_interval_ms / 1000,
        consumer_auto_offset_reset="earliest",
        producer_acks=-1,
        producer_linger_ms=settings.producer_linger_ms,
        producer_max_request_size=4 * settings.max_record_bytes,
        # a second worker keeps a standby copy of each table partition, so a takeover does not
        # replay a whole changelog
        table_standby_replicas=1 if settings.standby_replicas else 0,
        # static membership: a restarted worker gets its partitions back without a rebalance
        consumer_group_instance_id=settings.static_instance_id,
        # on a rebalance surge drains its own in-flight work (bounded, see agents/worker.py) and
        # never lets Faust wait for every unacked message without a bound
        stream_wait_empty=False,
        topic_allow_declare=True,
        key_serializer="raw",
        value_serializer="raw",
        stream_buffer_maxsize=settings.stream_buffer_max_records,
        # one poll may not overfill a paused partition's buffer (a full buffer blocks delivery to
        # every stream: docs/architecture.md, "The path of a request")
        broker_max_poll_records=settings.max_poll_records,
        broker_session_timeout=settings.session_timeout_s,
        broker_rebalance_timeout=max(settings.session_timeout_s, 2 * settings.drain_timeout_s),
        # a survivor learns that a dead member's session expired at its next heartbeat: a short interval
        # (one small request a second) lets it take the partitions over about 1 s after the expiry
        # rather than up to 2.5 s (docs/architecture.md, "Readiness and failover")
        broker_heartbeat_interval=min(1.0, settings.session_timeout_s / 10),
        consumer_max_fetch_size=4 * 1024 * 1024,
        # Faust's own manager sleeps 1 s before registering the tables (see prompt_table_manager)
        TableManager=prompt_table_manager(),
        **options,
    )
