"""Every use of a private faust-streaming or aiokafka API, each behind one small function.

surge needs a few things that neither library offers publicly. Reaching into them from here only
means that an upgrade of either library has one file to check: tests/test_compat.py asserts that
each private attribute still exists in the installed versions and that each helper still works
against a real broker, and tests/test_private_api.py fails when a private attribute of those
libraries is used anywhere else.

Written against faust-streaming 0.15.3 and aiokafka 0.14.0 (:data:`WRITTEN_FOR`); pyproject.toml
keeps both below their next minor release.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import weakref
from collections.abc import Iterable, Iterator, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.protocol.metadata import MetadataRequest

if TYPE_CHECKING:  # faust is imported where it is used: the gateway and clients never load it
    from faust.types import EventT, ProducerT

#: the library versions these helpers were written and tested against
WRITTEN_FOR: dict[str, str] = {"faust-streaming": "0.15.3", "aiokafka": "0.14.0"}

log = logging.getLogger("surge.compat")

#: how every consumer of surge's inputs reads: a record of a transaction its producer aborted is never
#: delivered (see :func:`set_fetch_max_wait`; docs/architecture.md, "Transactional producers")
READ_COMMITTED = "read_committed"


def kafka_producer(producer: ProducerT) -> AIOKafkaProducer:
    """The aiokafka producer under Faust's producer (created on first use; Faust must have started
    its producer, e.g. ``await app.producer.maybe_start()``).

    Private: ``faust.transport.drivers.aiokafka.Producer._ensure_producer()``.
    """
    ensure: Any = producer._ensure_producer  # type: ignore[attr-defined]
    return ensure()


async def producer_partitions_for(producer: ProducerT, topic: str) -> set[int]:
    """The partitions of ``topic`` as Faust's producer sees them, fetching its metadata if missing.

    Why: a table whose changelog partition is chosen by the producer's partitioner
    (``use_partitioner=True``, the answer cache) needs the changelog topic's metadata before its first
    write, and Faust's producer has no public call that loads it.
    """
    return set(await kafka_producer(producer).partitions_for(topic))


def producer_knows_topic(producer: ProducerT, topic: str) -> bool:
    """Whether Faust's producer holds metadata of ``topic`` (its partitions), so that a send there
    does not first wait for the broker to describe it.

    Why: a send to a topic the producer has no metadata of waits for that metadata (up to its
    request timeout when the topic is gone), holding every reply queued behind it; the reply path
    asks the broker first instead (``agents.runtime.Runtime.reply_topic_present``). Private:
    ``AIOKafkaProducer.client.cluster``.
    """
    return kafka_producer(producer).client.cluster.partitions_for_topic(topic) is not None


async def topic_exists(producer: ProducerT, topic: str) -> bool:
    """Whether ``topic`` exists, asked of the broker with a metadata request that does not create it.

    Why: a producer's own metadata request for a topic it is about to send to asks the broker to
    create a missing one (``allow_auto_topic_creation``, true in aiokafka's requests, as in the admin
    client's ``describe_topics``); only listing every topic avoids that publicly, which costs the
    whole cluster's metadata per question. Private: ``AIOKafkaClient.send`` with a
    ``MetadataRequest`` built here, on the client of Faust's producer.
    """
    client = kafka_producer(producer).client
    node = client.get_random_node()
    if node is None:
        raise ConnectionError("no broker is known to ask whether a topic exists")
    response = await client.send(node, MetadataRequest([topic], allow_auto_topic_creation=False))
    for entry in response.to_object()["topics"]:
        if entry["topic"] == topic:
            return int(entry["error_code"]) == 0
    return False


def forget_topic_metadata(producer: ProducerT, topic: str) -> None:
    """Drop ``topic`` from the metadata of Faust's producer, as a refresh answered by a slow broker
    without the topic leaves it (the producer fetches it again when it next sends there).

    Why: tests of the reply book's resend path (``agents.durable_table``) need that state on demand.
    Private: ``aiokafka.cluster.ClusterMetadata._partitions``.
    """
    kafka_producer(producer).client.cluster._partitions.pop(topic, None)


@contextlib.contextmanager
def as_current_event(event: EventT) -> Iterator[None]:
    """Make ``event`` Faust's current event inside the block (what ``faust.current_event()`` returns).

    Why: Faust's RocksDB store picks the partition database of a table write from the current event,
    and the inference loop writes the answer cache after a model call, outside any stream iteration.
    Private: ``faust.streams._current_event``, a ContextVar holding a weak reference to the event.
    """
    from faust.streams import _current_event

    token = _current_event.set(weakref.ref(event))
    try:
        yield
    finally:
        _current_event.reset(token)


async def refresh_metadata(consumer: AIOKafkaConsumer) -> None:
    """Fetch the cluster metadata now, so ``partitions_for_topic`` sees a topic created moments ago.

    Why: a consumer without a group (it assigns partitions itself) learns of new topics only on its
    periodic metadata refresh; aiokafka has no public call to refresh it at once.
    Private: ``AIOKafkaConsumer._client.force_metadata_update()``.
    """
    client: Any = consumer._client
    await client.force_metadata_update()


class SourceBlindReadOffsets(MutableMapping[Any, Any]):
    """Faust's per-partition read offsets, kept for every topic except the agents' source topics.

    For a source topic, reads return None and writes are ignored, so Faust's fetcher neither drops a
    record as "already read" nor records a "gap" that its commit would later step over. Both are
    safe only if Faust's read offsets are always right, and they are not around a rebalance: the
    fetcher, suspended mid-delivery, marks a record read after Faust cleared the revoked partitions'
    offsets (and may do so after the next assignment), and the next generation then drops every
    record up to it while committing what follows, so those requests are lost. surge orders its own
    commits (:mod:`pipeline.offsets`) and drops repeats itself, so it needs neither mechanism for
    the topics it reads with acks. Changelog topics keep Faust's behaviour (table recovery relies
    on it). Private: ``Consumer._read_offset``, read by ``Consumer._drain_messages``.
    """

    def __init__(self, topics: Iterable[str], inner: MutableMapping[Any, Any] | None = None) -> None:
        self.topics = frozenset(topics)
        self._inner: dict[Any, Any] = dict(inner or {})
        for tp in [tp for tp in self._inner if tp.topic in self.topics]:
            del self._inner[tp]

    def __getitem__(self, tp: Any) -> Any:
        return None if tp.topic in self.topics else self._inner.get(tp)  # defaultdict(None) semantics

    def __setitem__(self, tp: Any, offset: Any) -> None:
        if tp.topic not in self.topics:
            self._inner[tp] = offset

    def __delitem__(self, tp: Any) -> None:
        self._inner.pop(tp, None)

    def __contains__(self, tp: object) -> bool:
        return tp in self._inner

    def __iter__(self) -> Iterator[Any]:
        return iter(self._inner)

    def __len__(self) -> int:
        return len(self._inner)


def blind_read_offsets(consumer: Any, topics: Iterable[str]) -> SourceBlindReadOffsets:
    """Replace Faust's read offsets by :class:`SourceBlindReadOffsets` for ``topics``; called once,
    before the consumer starts (its fetch loop binds the mapping's methods when it starts)."""
    blind = SourceBlindReadOffsets(topics, consumer._read_offset)
    consumer._read_offset = blind
    return blind


async def commit_offsets(consumer: Any, offsets: Mapping[Any, tuple[int, str]]) -> bool:
    """Commit exactly ``offsets`` (partition -> (next offset to read, metadata)) for the group, on
    the consumer's own thread; False when the group has already rebalanced (or the commit failed:
    the next one tries again). Partitions no longer assigned are left out. Used on a timer and at
    every drain, from inside Faust's revocation callback too.

    Why: Faust's public ``commit()`` commits what its own ack bookkeeping holds, and it clears that
    for the revoked partitions before the app hears of the rebalance; and Faust always writes empty
    metadata, where surge lists the offsets already finished past the committed one
    (:func:`pipeline.offsets.encode_done`). Private: ``faust.transport.consumer.
    ThreadDelegateConsumer._thread`` (its ``call_thread``, ``assignment`` and ``_ensure_consumer``).
    """
    from aiokafka.errors import CommitFailedError
    from aiokafka.structs import OffsetAndMetadata, TopicPartition

    thread: Any = consumer._thread

    async def commit() -> bool:
        assigned = thread.assignment()
        todo = {
            TopicPartition(tp.topic, tp.partition): OffsetAndMetadata(offset, metadata)
            for tp, (offset, metadata) in offsets.items()
            if tp in assigned
        }
        if not todo:
            return True
        try:
            await thread._ensure_consumer().commit(todo)
        except CommitFailedError as exc:
            if "already rebalanced" not in str(exc):
                log.warning("commit of %d partitions failed (%r)", len(todo), exc)
            return False
        except Exception as exc:  # the next commit tries again
            log.warning("commit of %d partitions failed (%r)", len(todo), exc)
            return False
        return True

    return bool(await thread.call_thread(commit))


async def committed_with_metadata(consumer: Any, tp: Any) -> tuple[int | None, str]:
    """The group's committed offset of ``tp`` and the metadata committed with it ((None, "") when
    nothing was committed). aiokafka's ``committed()`` drops the metadata. Private:
    ``aiokafka.AIOKafkaConsumer._coordinator.fetch_committed_offsets``."""
    return (await committed_with_metadata_many(consumer, [tp]))[tp]


async def committed_with_metadata_many(
    consumer: Any, tps: Iterable[Any]
) -> dict[Any, tuple[int | None, str]]:
    """:func:`committed_with_metadata` of every partition in ``tps``, in one OffsetFetch request."""
    wanted = list(tps)
    found: Mapping[Any, Any] = await consumer._coordinator.fetch_committed_offsets(wanted)
    out: dict[Any, tuple[int | None, str]] = {}
    for tp in wanted:
        entry = found.get(tp)
        if entry is None or entry.offset is None or entry.offset < 0:
            out[tp] = (None, "")
        else:
            out[tp] = (int(entry.offset), str(entry.metadata or ""))
    return out


def scan_partition(table: Any, partition: int, after: bytes | None, limit: int) -> list[tuple[bytes, bytes]]:
    """Up to ``limit`` raw (key, value) pairs of ``table``'s local RocksDB store for ``partition``,
    in key order, starting after the key ``after`` (None: from the first). Empty when this worker
    holds no store for the partition. Faust offers no per-partition iteration; private:
    ``faust.stores.rocksdb.Store._dbs`` (rocksdict ``Rdict.items(from_key=...)``).
    """
    dbs: Mapping[int, Any] = getattr(table.data, "_dbs", {})
    db = dbs.get(partition)
    if db is None:
        return []
    out: list[tuple[bytes, bytes]] = []
    for key, value in db.items(from_key=after) if after is not None else db.items():
        if after is not None and key == after:
            continue
        out.append((key, value))
        if len(out) >= limit:
            break
    return out


def delete_in_partition(table: Any, partition: int, raw_keys: Iterable[bytes]) -> None:
    """Delete raw keys from ``table``'s local RocksDB store for ``partition`` (the store only: the
    caller sends the changelog's tombstones). Faust deletes through the current event's
    partition only; private: ``faust.stores.rocksdb.Store._dbs`` (rocksdict ``Rdict.delete``)."""
    dbs: Mapping[int, Any] = getattr(table.data, "_dbs", {})
    db = dbs.get(partition)
    if db is None:
        return
    for key in raw_keys:
        db.delete(key)


def set_fetch_max_wait(max_wait_ms: int, prefetch_backoff_ms: int | None = None) -> None:
    """Make Faust's worker consumer wait at most ``max_wait_ms`` for data in one fetch.

    Faust creates its aiokafka consumer with ``fetch_max_wait_ms=1500``, hard-coded. aiokafka keeps
    one fetch request in flight per broker; a record for a partition that was not fetchable when that
    request was sent (paused by flow control, or its last batch still being handed over) waits for
    the request to come back, up to the full wait. In a worker whose readers pause and resume their
    partitions all the time, that put requests in steps of about 1.6 s. Called once, before the
    worker starts; the consumer reads the value when it starts its fetcher.

    ``prefetch_backoff_ms``: aiokafka's fetcher sends no fetch at all to a broker while records it
    fetched for any partition of that broker wait unread, for up to its ``prefetch_backoff`` (0.1 s,
    not a consumer option). Faust leaves some fetched records unread for a while (partitions it took
    out of its active set), so every partition, the request topic's too, was fetched in steps of about
    100 ms: a worker's first requests reached the intake in bursts 100 ms apart (docs/architecture.md,
    "Intake first"). Set on the fetcher once the consumer has started it.

    The consumer also reads ``read_committed`` (Faust asks for it only under exactly-once): a
    record of a transaction its producer aborted never happened for that producer (an exactly-once
    sink of Kafka Streams or Flink writes this way, and writes its records again in a later
    transaction), yet read uncommitted it got a reply or a risk decision and counted in an account's
    features (docs/architecture.md, "Transactional producers"). Records of no transaction, which is
    everything surge writes, read the same either way.

    Private: ``faust.transport.drivers.aiokafka.AIOKafkaConsumerThread._create_worker_consumer``,
    ``aiokafka.AIOKafkaConsumer._fetch_max_wait_ms``, ``_isolation_level`` and ``_fetcher``,
    ``aiokafka.consumer.fetcher.Fetcher._prefetch_backoff``.
    """
    from faust.transport.drivers import aiokafka as driver

    thread_cls: Any = driver.AIOKafkaConsumerThread
    original = getattr(thread_cls, "_surge_original_create_worker_consumer", None)
    if original is None:
        original = thread_cls._create_worker_consumer
        thread_cls._surge_original_create_worker_consumer = original

    def create(self: Any, transport: Any) -> AIOKafkaConsumer:
        consumer = original(self, transport)
        consumer._fetch_max_wait_ms = max_wait_ms
        consumer._isolation_level = READ_COMMITTED  # read by start(), which builds the fetcher
        if prefetch_backoff_ms is not None:
            set_prefetch_backoff(consumer, prefetch_backoff_ms)
        return consumer

    thread_cls._create_worker_consumer = create


def set_prefetch_backoff(consumer: AIOKafkaConsumer, backoff_ms: int) -> None:
    """Make ``consumer``'s fetcher hold fetches back for at most ``backoff_ms`` while records it
    fetched wait unread (see :func:`set_fetch_max_wait`): set now when the fetcher exists, else as
    soon as ``start`` has made it. Private: ``AIOKafkaConsumer._fetcher``,
    ``Fetcher._prefetch_backoff``."""
    if consumer._fetcher is not None:
        consumer._fetcher._prefetch_backoff = backoff_ms / 1000
        return
    start = consumer.start

    async def start_then_set() -> None:
        await start()
        consumer._fetcher._prefetch_backoff = backoff_ms / 1000

    consumer.start = start_then_set


def track_sent_topics(producer: AIOKafkaProducer) -> None:
    """Make ``producer`` keep the metadata of every topic it has sent to, for as long as it runs.

    Why: an aiokafka client refreshes the metadata of the topics it tracks, or of every topic while
    it tracks none, and a refresh replaces what it knew. ``send`` tracks a topic only when its
    metadata is missing, so a topic learnt from a refresh of every topic (Faust asks for one after
    creating its topics) is used untracked: the first send to a topic created later makes the
    producer track that one alone, and the next refresh drops every other topic's leaders. A batch
    lingering for one of them then waits, unsent and with no error, until something else is sent to
    its topic (a reply, its work partition's commits behind it, held for good in a quiet moment;
    seen in CI and reproduced in tests/test_compat.py). Tracking each topic on its first send keeps
    them all. Idempotent. Private: ``AIOKafkaClient._wait_on_metadata`` (every send and
    ``partitions_for`` awaits it) and ``AIOKafkaClient._topics``.
    """
    client: Any = producer.client
    if getattr(client, "_surge_tracks_sent_topics", False):
        return
    original = client._wait_on_metadata

    async def wait_on_metadata(topic: str) -> Any:
        if topic not in client._topics:
            client.add_topic(topic)  # tracked from now on; the refresh it asks for runs in the background
        return await original(topic)

    client._wait_on_metadata = wait_on_metadata
    client._surge_tracks_sent_topics = True


def bound_produce_request_wait(timeout_ms: int) -> None:
    """Make the worker's producer give up on a produce request the broker has not answered within
    ``timeout_ms``: it closes the connection and sends the request's batches again on a new one.

    Why: aiokafka takes one number, ``request_timeout_ms``, for three things: how long a request
    waits for its answer, how old a batch may get before it fails, and how long ``send`` waits for
    room in a full batch. Faust sets it to ``producer_request_timeout``, 20 minutes, so one
    request the broker never answered (lost with a half-open connection) held the worker's replies,
    and every record after them (one produce request per broker is in flight at a time), for 20
    minutes, their records unacked. Lowering Faust's setting instead expires the batches and fails
    full-batch sends after that time, and Faust's producer buffer (the tables' changelog writes)
    crashes the worker on such a failure. Here only the wait for an answer is bounded; a batch sent
    again is the same batch, not a second copy. The same hook makes each of Faust's producers
    :func:`track_sent_topics`. Called once, before the worker starts. Private:
    ``faust.transport.drivers.aiokafka.Producer._new_producer`` and
    ``aiokafka.AIOKafkaClient._request_timeout_ms`` (read when a connection is made).
    """
    from faust.transport.drivers import aiokafka as driver

    producer_cls: Any = driver.Producer
    original = getattr(producer_cls, "_surge_original_new_producer", None)
    if original is None:
        original = producer_cls._new_producer
        producer_cls._surge_original_new_producer = original

    def new_producer(self: Any, transactional_id: str | None = None) -> AIOKafkaProducer:
        producer = original(self, transactional_id=transactional_id)
        producer.client._request_timeout_ms = timeout_ms
        # and it keeps the metadata of every topic it writes (see track_sent_topics)
        track_sent_topics(producer)
        return producer

    producer_cls._new_producer = new_producer


def producer_buffer_size(app: Any) -> int:
    """Table writes waiting in Faust's producer buffer (``app.producer.buffer.size``), 0 when there is
    none yet.

    Why: past ``ProducerBuffer.max_messages`` (100) Faust's conductor stops delivering records to every
    stream until the buffer has been sent, and the buffer is sent one record per event-loop turn;
    the inference agent holds batch and offline reading back before that (docs/architecture.md,
    "Intake first"). Not in ``ProducerBufferT``: ``faust.transport.producer.ProducerBuffer.size``.
    """
    buffer = getattr(getattr(app, "producer", None), "buffer", None)
    size = getattr(buffer, "size", 0)
    return size if isinstance(size, int) else 0


def changelog_message(
    table: Any, partition: int | None, key: Any, value: Any, value_serializer: str | None = None
) -> Any:
    """The changelog record of a write to ``table``, made as ``table.send_changelog`` makes it (the
    table's serializers, eager partitioning, and the callback that stores the record's offset with
    the table's data) but not put in Faust's producer buffer: the caller publishes it with
    ``message.channel.publish_message(message, wait=False)``, as that buffer's sender does. A delete
    is ``value=None`` with ``value_serializer="raw"``, as Faust's own ``on_key_del`` sends it.

    Why: every record in that buffer counts towards the 100 past which Faust's conductor stops
    delivering records to every stream (:func:`producer_buffer_size`); the reply book writes one
    record per reply and awaits each one's acknowledgement anyway (agents/durable_table.py).
    Private: ``Table._on_changelog_sent``.
    """
    return table.changelog_topic.as_future_message(
        key=key,
        value=value,
        partition=partition,
        key_serializer=table.key_serializer,
        value_serializer=value_serializer or table.value_serializer,
        callback=table._on_changelog_sent,
        eager_partitioning=True,
    )


def producer_backlog(producer: AIOKafkaProducer) -> dict[str, Any]:
    """What an aiokafka producer still holds, for a log line when a send waits too long: per
    partition the batches not yet sent (their age in seconds, how often tried, the partition's
    leader as the producer knows it, whether its metadata refreshes cover the topic), the batches
    sent and awaiting an answer, the brokers with a request in flight and the partitions muted
    behind one.

    Why: aiokafka says nothing about a record it has accepted and not delivered. Private:
    ``MessageAccumulator._batches``/``_pending_batches``, ``MessageBatch._ctime``,
    ``AIOKafkaProducer._message_accumulator``/``_sender``, ``Sender._in_flight``/``_muted_partitions``,
    ``AIOKafkaClient._topics``.
    """
    import time

    acc: Any = producer._message_accumulator
    sender: Any = producer._sender
    client: Any = producer.client
    now = time.monotonic()
    queued = {
        f"{tp.topic}[{tp.partition}]": {
            "ages_s": [round(now - b._ctime, 1) for b in batches],
            "tries": [b.retry_count for b in batches],
            "leader": client.cluster.leader_for_partition(tp),
            "tracked": tp.topic in client._topics,
        }
        for tp, batches in list(acc._batches.items())
        if batches
    }
    return {
        "queued": queued,
        "sent_unanswered": sorted(f"{b.tp.topic}[{b.tp.partition}]" for b in acc._pending_batches),
        "nodes_in_flight": sorted(sender._in_flight),
        "muted": sorted(f"{tp.topic}[{tp.partition}]" for tp in sender._muted_partitions),
        "sender_running": sender.sender_task is not None and not sender.sender_task.done(),
    }


def wake_producer(producer: AIOKafkaProducer) -> bool:
    """Wake an aiokafka producer's sender, as a new batch does, and have its metadata refreshes
    cover every topic it holds a batch for without a known leader; False if there was nothing to do.

    Why: the sender sleeps until a batch is created, a linger ends or a request returns; a record
    added to a batch that already exists wakes nothing. A batch whose partition has no known leader
    waits for a metadata refresh, and one that does not ask for its topic never brings it (see
    :func:`track_sent_topics`). When a send has waited past the request timeout with no error, this
    makes the sender look at its batches again (harmless if it had nothing to do). Private:
    ``MessageAccumulator._waiter_future``/``_batches``, ``AIOKafkaClient._topics``.
    """
    acc: Any = producer._message_accumulator
    client: Any = producer.client
    acted = False
    for tp, batches in list(acc._batches.items()):
        if (
            batches
            and tp.topic not in client._topics
            and client.cluster.leader_for_partition(tp) in (None, -1)
        ):
            client.add_topic(tp.topic)
            acted = True
    waiter = acc._waiter_future
    if not waiter.done():
        waiter.set_result(None)
        acted = True
    return acted


def flush_changelog_buffers(app: Any) -> None:
    """Write what Faust's table recovery has read from changelogs and still buffers into the tables'
    stores now.

    Why: a global table with ``use_partitioner`` (surge's answer cache and reply book) has every
    changelog partition assigned as active as well as standby, and Faust's changelog reader sizes a
    partition's buffer by the active branch first: ``recovery_buffer_size``, 1,000 records, not the
    ``standby_buffer_size=1`` Faust gives global tables. So after recovery another worker's writes
    stayed in memory until 1,000 had come or the next rebalance ended a recovery: a split intake
    worker's exact cache missed every answer the inference worker stored. Called on the commit timer,
    it bounds that delay by the commit interval and keeps recovery's batched writes. Untyped:
    ``TableManager.recovery`` (not in ``TableManagerT``) and ``Recovery.flush_buffers``, which
    Faust itself calls when a recovery ends and when it stops.
    """
    app.tables.recovery.flush_buffers()


def before_flow_resume(app: Any, callback: Any) -> None:
    """Call ``callback()`` each time Faust resumes its flow control, just before it empties the
    stream buffers.

    Why: ``FlowControlEvent.resume`` (mode) clears every stream's buffer. Faust resumes the flow
    after a rebalance, at the end of table recovery, once the partitions were already resumed and
    sought; a record delivered in that window and not yet taken by its reader (one blocked waiting
    for admission holds the rest of its buffer) is thrown away while the fetch position stays past
    it, so it would never be read. The callback sees the Acker's ledgers as they are before the clear.
    Not private, but a behaviour surge depends on; tests/test_compat.py pins it.
    """
    flow = app.flow_control
    original = flow.resume

    def resume() -> None:
        callback()
        original()

    flow.resume = resume


def prompt_table_manager() -> type:
    """Faust's ``TableManager`` without the fixed second it sleeps when it starts.

    Why: ``TableManager.on_start`` sleeps 1.0 s before it registers the tables and starts their
    recovery, so that tables declared after the app started still make it in. Every surge table is
    declared before its worker starts (a table added later still raises "Too late to add tables"),
    so the sleep only made every worker start, and every restart after a crash, a second later
    (docs/architecture.md, "Readiness and failover"). Passed to ``faust.App(TableManager=...)``, the
    setting Faust offers for its own subclasses. Private: ``TableManager._update_channels``, what
    ``on_start`` runs after the sleep.
    """
    from faust.tables import TableManager

    class PromptTableManager(TableManager):
        async def on_start(self) -> None:
            if not self.should_stop:
                await self._update_channels()
                await self.recovery.start()

    return PromptTableManager


def leave_group_on_close_as_static_member() -> None:
    """Make a static member of a consumer group leave it when its consumer closes, as a dynamic
    member does.

    Why: aiokafka never sends LeaveGroup for a member with a ``group_instance_id`` (the point of static
    membership: a member restarted within its session timeout gets its assignment back without a
    rebalance), so a worker stopped on purpose held its partitions unserved until its session timed
    out. Kafka 4.1 gave the Java consumer the same choice (KIP-1092, ``CloseOptions``): static
    membership for crashes and quick restarts, an explicit leave on a deliberate stop. aiokafka's
    LeaveGroup request stops at v1 (no instance id); v3 names the member by ``group_instance_id``.
    Only :meth:`GroupCoordinator.close` leaves (the heartbeat is already stopped there, so the
    member cannot rejoin after it); the leave on a poll timeout stays as aiokafka has it. Installed
    once per process, for every static member (dynamic members are unchanged).
    Private: ``GroupCoordinator.close``, ``_maybe_leave_group``, ``_group_instance_id``, ``_send_req``.
    """
    from aiokafka.consumer.group_coordinator import GroupCoordinator

    gc_cls: Any = GroupCoordinator
    if getattr(gc_cls, "_surge_static_leave_installed", False):
        return
    original_close = gc_cls.close
    original_leave = gc_cls._maybe_leave_group

    async def close(self: Any) -> None:
        self._surge_closing = True
        await original_close(self)

    async def _maybe_leave_group(self: Any) -> None:
        if getattr(self, "_surge_closing", False) and self.generation > 0 and self._group_instance_id:
            await _leave_as_static_member(self)
        await original_leave(self)

    gc_cls.close = close
    gc_cls._maybe_leave_group = _maybe_leave_group
    gc_cls._surge_static_leave_installed = True


async def _leave_as_static_member(coordinator: Any) -> None:
    from aiokafka import errors

    from pipeline.static_leave import StaticLeaveGroupRequest

    request = StaticLeaveGroupRequest(
        coordinator.group_id, coordinator.member_id, coordinator._group_instance_id
    )
    try:
        resp = await coordinator._send_req(request)
    except (errors.KafkaError, NotImplementedError) as exc:
        log.error("LeaveGroup as static member %s failed: %r", coordinator._group_instance_id, exc)
        return
    codes = [resp.error_code, *(m[2] for m in resp.members)]
    if any(codes):
        log.error(
            "LeaveGroup as static member %s refused: error codes %s", coordinator._group_instance_id, codes
        )
    else:
        log.info("left the group as static member %s", coordinator._group_instance_id)


def eager_delivery(yield_every: int = 1) -> None:
    """Make Faust's consumer hand each fetched record to its streams without four tasks per record.

    Why: ``Consumer._drain_messages`` delivers every record as ``await self.wait_first(callback(msg),
    self.suspend_flow.wait())`` so that a delivery blocked by flow control can be abandoned on a
    rebalance; that is four tasks, an ``asyncio.wait`` and at least one loop turn per record, for
    every record of every topic the worker reads, although the callback puts the record into the
    stream's buffer without waiting in all but rare cases. Now the callback's first step runs inline
    (:func:`pipeline.eager.step`); only a callback that has to wait goes through the original
    ``wait_first``, as before. Anything else (other arguments, the flow suspended, the service
    stopping) takes the original path. ``yield_every``: records handed over inline between two
    turns of the event loop (Faust's path takes at least one turn per record). Installed once per process (docs/architecture.md,
    "Delivering records"). Private: ``faust.transport.consumer.Consumer._drain_messages``'s call
    of ``wait_first`` with ``suspend_flow``; ``mode.Service._stopped``, ``_crashed``.
    """
    from faust.transport.consumer import Consumer
    from mode.services import WaitResults

    from pipeline.eager import Finished, step

    consumer_cls: Any = Consumer
    if getattr(consumer_cls, "_surge_eager_delivery", False):
        return
    if sys.version_info >= (3, 12):
        # there asyncio.wait_for enters asyncio.timeout, which cancels the task current when it was
        # entered: a first step run inline would put the drain's own task in that place
        log.warning("eager delivery is written for Python 3.11; Faust's own delivery is kept")
        return
    original = consumer_cls.wait_first

    async def wait_first(self: Any, *coros: Any, timeout: Any = None) -> Any:  # noqa: ASYNC109 (mode's signature)
        if (
            timeout is None
            and len(coros) == 2
            and _waits_on(coros[1], self.suspend_flow)
            and hasattr(coros[0], "send")
            and not self.suspend_flow.is_set()
            and not self._stopped.is_set()
            and not self._crashed.is_set()
        ):
            callback, suspended = coros
            try:
                first = step(callback)
            except BaseException:
                suspended.close()
                raise
            if isinstance(first, Finished):
                suspended.close()
                self._surge_delivered = getattr(self, "_surge_delivered", 0) + 1
                if self._surge_delivered >= yield_every:
                    # one loop turn every ``yield_every`` records, as Faust's path takes at least one
                    # per record: the readers and everything else on the loop get their turn between
                    # the records of a poll
                    self._surge_delivered = 0
                    await asyncio.sleep(0)
                return WaitResults([callback], [first.value], False)
            return await original(self, first, suspended)
        return await original(self, *coros, timeout=timeout)

    consumer_cls.wait_first = wait_first
    consumer_cls._surge_eager_delivery = True


def _waits_on(coro: Any, event: Any) -> bool:
    """Whether ``coro`` is ``event.wait()``, not yet started."""
    code = getattr(coro, "cr_code", None)
    frame = getattr(coro, "cr_frame", None)
    return (
        code is not None
        and code is type(event).wait.__code__
        and frame is not None
        and frame.f_locals.get("self") is event
    )
