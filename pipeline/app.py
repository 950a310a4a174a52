"""The Faust app of surge, configured from :class:`Settings`.

Every surge topic carries raw bytes: decoding happens in the agents, so a record that is not
JSON gets an error reply and a dead letter instead of crashing a stream.
"""

from __future__ import annotations

import faust

from pipeline.settings import Settings


def create_app(settings: Settings) -> faust.App:
    """A Faust app with RocksDB tables, the configured broker and at-least-once commits after acks."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    return faust.App(
        settings.app_id,
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
        producer_linger_ms=2,
        producer_max_request_size=4 * settings.max_record_bytes,
        table_standby_replicas=0,
        topic_allow_declare=True,
        key_serializer="raw",
        value_serializer="raw",
        stream_buffer_maxsize=settings.stream_buffer_max_records,
        broker_session_timeout=settings.session_timeout_s,
        broker_heartbeat_interval=min(3.0, settings.session_timeout_s / 4),
        consumer_max_fetch_size=4 * 1024 * 1024,
    )
