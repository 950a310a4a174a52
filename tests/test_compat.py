"""pipeline/compat.py against the installed faust-streaming and aiokafka.

When either library is upgraded, this is the file that says whether surge's uses of their private
APIs still hold: the versions are pinned here, each private attribute is looked up, and each helper
is run (against the real broker where it talks to one).
"""

from __future__ import annotations

import asyncio
import inspect
import time
import uuid
from contextvars import ContextVar
from importlib.metadata import version
from pathlib import Path
from typing import Any

import faust
import faust.streams
import mode
import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
from aiokafka.admin import AIOKafkaAdminClient, NewTopic
from aiokafka.client import AIOKafkaClient
from aiokafka.consumer.group_coordinator import GroupCoordinator
from aiokafka.structs import TopicPartition
from faust.tables import TableManager
from faust.tables.recovery import Recovery
from faust.transport.consumer import Consumer, ThreadDelegateConsumer
from faust.transport.drivers import aiokafka as faust_aiokafka

from pipeline import compat
from pipeline.devtools.broker import EmbeddedKafka


def test_written_for_the_installed_versions() -> None:
    installed = {name: version(name) for name in compat.WRITTEN_FOR}
    assert installed == compat.WRITTEN_FOR, (
        "faust-streaming or aiokafka changed: check every helper in pipeline/compat.py against the new "
        "version (this file runs them), then update WRITTEN_FOR"
    )


def test_the_private_attributes_exist() -> None:
    assert isinstance(faust.streams._current_event, ContextVar)
    assert callable(faust_aiokafka.Producer._ensure_producer)
    # flush_changelog_buffers: the table manager's recovery service and its buffer flush
    assert isinstance(inspect.getattr_static(TableManager, "recovery"), property)
    assert callable(Recovery.flush_buffers)
    assert "table.recovery_buffer_size" in inspect.getsource(Recovery)  # the active branch sizes first
    assert callable(AIOKafkaClient.force_metadata_update)
    # commit_offsets, seek_wait: Faust's consumer thread and its aiokafka consumer
    assert "self._thread = self._new_consumer_thread()" in inspect.getsource(ThreadDelegateConsumer)
    assert callable(faust_aiokafka.AIOKafkaConsumerThread._ensure_consumer)
    assert callable(faust_aiokafka.AIOKafkaConsumerThread.call_thread)
    # leave_group_on_close_as_static_member: the coordinator closes, then "maybe" leaves (never as a
    # static member), with the member's identity in these attributes
    assert "self._coordinator = GroupCoordinator(" in inspect.getsource(AIOKafkaConsumer)
    assert "self._group_instance_id = group_instance_id" in inspect.getsource(GroupCoordinator)
    assert "await self._maybe_leave_group()" in inspect.getsource(GroupCoordinator.close)
    assert "self._group_instance_id is None" in inspect.getsource(GroupCoordinator._maybe_leave_group)
    assert inspect.iscoroutinefunction(GroupCoordinator._send_req)
    source = inspect.getsource(GroupCoordinator)
    assert all(f"self.{attr} =" in source for attr in ("generation", "member_id", "group_id"))
    # commit_offsets commits with metadata on the consumer thread (Faust's own commit writes "")
    assert callable(faust_aiokafka.AIOKafkaConsumerThread.assignment)
    # committed_with_metadata: aiokafka's committed() drops the metadata its coordinator fetched
    assert "self._coordinator.fetch_committed_offsets(" in inspect.getsource(AIOKafkaConsumer.committed)
    assert inspect.iscoroutinefunction(GroupCoordinator.fetch_committed_offsets)
    # prompt_table_manager: Faust's on_start is the fixed sleep, then what the override runs
    on_start = inspect.getsource(TableManager.on_start)
    assert "await self.sleep(1.0)" in on_start
    assert on_start.index("await self._update_channels()") < on_start.index("await self.recovery.start()")
    assert inspect.iscoroutinefunction(TableManager._update_channels)
    # changelog_message: the reply book's records made as Table.send_changelog makes them, with the
    # callback that stores each record's offset with the table's data
    from faust.tables.base import Collection

    send_changelog = inspect.getsource(Collection.send_changelog)
    assert (
        "callback=self._on_changelog_sent" in send_changelog and "eager_partitioning=True" in send_changelog
    )
    assert "set_persisted_offset(" in inspect.getsource(Collection._on_changelog_sent)
    # the Acker seeks with seek_wait (run on the consumer's own thread, waits for the position)
    assert "call_thread(self._seek_wait" in inspect.getsource(faust_aiokafka.AIOKafkaConsumerThread.seek_wait)
    # eager_delivery: Faust's consumer hands each record over through wait_first with suspend_flow,
    # mode's original wait_first gives up once the service stops or crashes
    drain = " ".join(inspect.getsource(Consumer._drain_messages).split())
    assert "await self.wait_first( callback(message), self.suspend_flow.wait() )" in drain
    assert "self._stopped" in inspect.getsource(mode.Service.wait_first)
    assert "self._crashed" in inspect.getsource(mode.Service.wait_first)


async def test_the_consumer_keeps_its_client_in_client() -> None:
    consumer = AIOKafkaConsumer(bootstrap_servers="127.0.0.1:1")
    assert isinstance(consumer._client, AIOKafkaClient)


def test_as_current_event_sets_and_restores_faust_current_event() -> None:
    class Event:  # anything weak-referenceable stands in for a faust Event here
        pass

    outer, inner = Event(), Event()
    assert faust.current_event() is None
    with compat.as_current_event(outer):  # type: ignore[arg-type]
        assert faust.current_event() is outer
        with compat.as_current_event(inner):  # type: ignore[arg-type]
            assert faust.current_event() is inner
        assert faust.current_event() is outer
    assert faust.current_event() is None


async def _create_topic(bootstrap: str, partitions: int) -> str:
    topic = f"compat-{uuid.uuid4().hex[:8]}"
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([NewTopic(topic, num_partitions=partitions, replication_factor=1)])
    finally:
        await admin.close()
    return topic


@pytest.mark.integration
async def test_refresh_metadata_shows_a_topic_created_after_start(kafka: EmbeddedKafka) -> None:
    consumer = AIOKafkaConsumer(bootstrap_servers=kafka.bootstrap, metadata_max_age_ms=300_000)
    await consumer.start()
    try:
        topic = await _create_topic(kafka.bootstrap, 3)
        for _ in range(50):
            await compat.refresh_metadata(consumer)
            if consumer.partitions_for_topic(topic):
                break
            await asyncio.sleep(0.1)
        assert consumer.partitions_for_topic(topic) == {0, 1, 2}
    finally:
        await consumer.stop()


@pytest.mark.integration
async def test_producer_partitions_for_loads_the_metadata(kafka: EmbeddedKafka) -> None:
    topic = await _create_topic(kafka.bootstrap, 2)
    app = faust.App(f"compat-{uuid.uuid4().hex[:8]}", broker=f"kafka://{kafka.bootstrap}", autodiscover=False)
    producer = app.producer
    await producer.maybe_start()
    try:
        assert compat.kafka_producer(producer) is compat.kafka_producer(producer)  # one underlying client
        assert await compat.producer_partitions_for(producer, topic) == {0, 1}
    finally:
        await producer.stop()


@pytest.mark.integration
async def test_topic_exists_asks_without_creating_the_topic(kafka: EmbeddedKafka) -> None:
    # the session broker creates topics on request (auto.create.topics.enable), as a producer's
    # metadata request for a missing topic shows; this question must not
    topic = await _create_topic(kafka.bootstrap, 1)
    missing = f"compat-missing-{uuid.uuid4().hex[:8]}"
    app = faust.App(f"compat-{uuid.uuid4().hex[:8]}", broker=f"kafka://{kafka.bootstrap}", autodiscover=False)
    producer = app.producer
    await producer.maybe_start()
    admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap)
    await admin.start()
    try:
        assert await compat.topic_exists(producer, topic)
        assert not await compat.topic_exists(producer, missing)
        assert not await compat.topic_exists(producer, missing)
        assert missing not in await admin.list_topics()
    finally:
        await admin.close()
        await producer.stop()


def test_faust_reads_and_writes_read_offsets_through_the_mapping() -> None:
    from faust.transport.consumer import Consumer

    drain = inspect.getsource(Consumer._drain_messages)
    assert "get_read_offset = self._read_offset.__getitem__" in drain
    assert "set_read_offset = self._read_offset.__setitem__" in drain
    assert "await self._add_gap(tp, r_offset + 1, offset)" in drain  # only when r_offset is set
    assert "read_offset.update(" in inspect.getsource(Consumer.perform_seek)


async def test_blind_read_offsets_ignore_source_topics_only() -> None:
    from faust.types import TP

    app = faust.App(f"blind-{uuid.uuid4().hex[:6]}", broker="kafka://127.0.0.1:1")
    consumer = app.consumer
    src, other = TP("surge.requests", 0), TP("app-answers-changelog", 0)
    consumer._read_offset[src] = 40  # held from before: forgotten when the mapping goes blind
    blind = compat.blind_read_offsets(consumer, ["surge.requests"])
    assert consumer._read_offset is blind and blind[src] is None
    # what the fetcher does after a rebalance (marks a record read nobody saw), and a seek
    blind[src] = 57
    blind.update({src: 60, other: 7})
    assert blind[src] is None, "a source record is never dropped as already read, nor a gap made"
    assert blind[other] == 7 and blind[TP("app-answers-changelog", 1)] is None
    blind.pop(src, None)
    blind.pop(other, None)
    assert blind[other] is None and len(blind) == 0


async def test_the_worker_consumer_waits_at_most_the_fetch_wait_asked() -> None:
    """Faust hard-codes fetch_max_wait_ms=1500 for its worker consumer; surge lowers it (a record on a
    partition resumed while a fetch was in flight waited for that fetch, up to 1.5 s)."""
    app = faust.App(f"fetch-{uuid.uuid4().hex[:6]}", broker="kafka://127.0.0.1:1")
    thread = app.consumer._thread
    cls = faust_aiokafka.AIOKafkaConsumerThread
    # Faust's own method, also when an app built earlier in this process already wrapped it
    faust_own = getattr(cls, "_surge_original_create_worker_consumer", cls._create_worker_consumer)
    assert "fetch_max_wait_ms=1500" in inspect.getsource(faust_own)
    try:
        compat.set_fetch_max_wait(40)
        consumer = thread._create_worker_consumer(app.transport)
        assert consumer._fetch_max_wait_ms == 40
        # and reads committed records only; Faust asks for that only under exactly-once
        assert 'isolation_level: str = "read_uncommitted"' in inspect.getsource(faust_own)
        assert consumer._isolation_level == "read_committed"
        assert "isolation_level=self._isolation_level" in inspect.getsource(AIOKafkaConsumer.start)
        compat.set_fetch_max_wait(70)  # called again: the wrapper wraps Faust's own, not itself
        assert thread._create_worker_consumer(app.transport)._fetch_max_wait_ms == 70
    finally:
        original = faust_aiokafka.AIOKafkaConsumerThread._surge_original_create_worker_consumer
        faust_aiokafka.AIOKafkaConsumerThread._create_worker_consumer = original


async def _delivery_ms(bootstrap: str, topic: str, backoff_ms: int | None) -> float:
    """How long a record on partition 1 takes to be handed over while partition 0's fetched records
    wait unread for a while (as Faust leaves those of partitions it took out of its active set, and
    reads later); median of 5."""
    from aiokafka import AIOKafkaProducer, TopicPartition

    producer = AIOKafkaProducer(bootstrap_servers=bootstrap)
    consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, fetch_max_wait_ms=10, enable_auto_commit=False)
    if backoff_ms is not None:
        compat.set_prefetch_backoff(consumer, backoff_ms)
    await producer.start()
    await consumer.start()
    try:
        p0, p1 = TopicPartition(topic, 0), TopicPartition(topic, 1)
        consumer.assign([p0, p1])
        await consumer.seek_to_end(p0, p1)
        times = []
        for n in range(5):
            await producer.send_and_wait(topic, b"waits unread", partition=0)
            await asyncio.sleep(0.03)  # fetched (10 ms fetch wait), and left in the fetcher
            await asyncio.sleep(0)
            t0 = asyncio.get_running_loop().time()
            await producer.send_and_wait(topic, f"wanted {n}".encode(), partition=1)
            got = await consumer.getmany(p1, timeout_ms=2_000)
            assert got.get(p1), "the record on partition 1 came"
            times.append((asyncio.get_running_loop().time() - t0) * 1000)
            assert (await consumer.getmany(p0, timeout_ms=2_000)).get(p0), "read at last"
        return sorted(times)[2]
    finally:
        await consumer.stop()
        await producer.stop()


async def test_unread_records_of_one_partition_hold_other_fetches_back_for_the_prefetch_backoff_only(
    kafka: EmbeddedKafka,
) -> None:
    """aiokafka sends no fetch to a broker while records fetched for any of its partitions wait
    unread, for up to ``prefetch_backoff`` (0.1 s, not a consumer option): every other partition of
    that broker is fetched in steps of about 100 ms. surge's worker consumer sets it to
    ``fetch_prefetch_backoff_ms`` (a worker's first requests reached the intake in such steps)."""
    from aiokafka.consumer.fetcher import Fetcher

    assert inspect.signature(Fetcher.__init__).parameters["prefetch_backoff"].default == 0.1
    assert "if node_id in backoff_by_nodes:" in inspect.getsource(Fetcher._get_actions_per_node)
    topic = await _create_topic(kafka.bootstrap, 2)
    held = await _delivery_ms(kafka.bootstrap, topic, None)
    quick = await _delivery_ms(kafka.bootstrap, topic, 5)
    assert held >= 40, f"aiokafka's own backoff: {held:.0f} ms"
    assert quick < 50 and quick < held / 2, f"{quick:.0f} ms with 5 ms against {held:.0f} ms"


def test_flow_control_resume_empties_the_stream_buffers_after_the_callback_saw_them() -> None:
    # Faust resumes its flow at the end of every rebalance's recovery, and mode's resume() clears
    # every managed buffer: the records in them are thrown away (agents/worker.py seeks back)
    from mode.utils.queues import FlowControlEvent, FlowControlQueue

    class App:
        flow_control = FlowControlEvent()

    app = App()
    queue: FlowControlQueue[int] = FlowControlQueue(flow_control=app.flow_control, clear_on_resume=True)
    queue.put_nowait(1)
    queue.put_nowait(2)
    seen: list[int] = []
    compat.before_flow_resume(app, lambda: seen.append(queue.qsize()))
    app.flow_control.resume()
    assert seen == [2], "the callback runs before the buffers are emptied"
    assert queue.qsize() == 0, "mode no longer empties the buffers on resume: revisit before_flow_resume"


async def _group_consumer(bootstrap: str, group: str, instance: str, topic: str) -> AIOKafkaConsumer:
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=group,
        group_instance_id=instance,
        session_timeout_ms=30_000,
        heartbeat_interval_ms=500,
    )
    await consumer.start()
    return consumer


async def _until_assigned(consumer: AIOKafkaConsumer, n: int, timeout_s: float) -> float:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    while loop.time() - t0 < timeout_s:
        await consumer.getmany(timeout_ms=100)  # drives the group protocol
        if len(consumer.assignment()) == n:
            return loop.time() - t0
    raise AssertionError(
        f"{len(consumer.assignment())} partitions assigned, {n} expected, after {timeout_s} s"
    )


async def test_a_static_member_leaves_the_group_when_it_closes(kafka: EmbeddedKafka) -> None:
    """Without the helper the survivor waits for the closed member's 30 s session; with it, a second."""
    compat.leave_group_on_close_as_static_member()
    compat.leave_group_on_close_as_static_member()  # installed once however often it is called
    topic = await _create_topic(kafka.bootstrap, 4)
    group = f"static-{uuid.uuid4().hex[:8]}"
    a = await _group_consumer(kafka.bootstrap, group, "member-a", topic)
    await _until_assigned(a, 4, 30)
    b = await _group_consumer(kafka.bootstrap, group, "member-b", topic)
    try:
        await asyncio.gather(_until_assigned(a, 2, 30), _until_assigned(b, 2, 30))
        await a.stop()
        took = await _until_assigned(b, 4, 25)
        assert took < 10, f"the survivor got the partitions {took:.1f} s after the static member closed"
    finally:
        await b.stop()


def test_surge_apps_register_their_tables_without_faust_s_one_second_sleep(tmp_path: Path) -> None:
    from pipeline.app import create_app
    from pipeline.settings import Settings

    app = create_app(Settings(data_dir=tmp_path))
    manager = app.tables
    assert isinstance(manager, TableManager), "still Faust's manager, recovery included"
    assert type(manager).on_start is not TableManager.on_start
    assert "sleep" not in inspect.getsource(type(manager).on_start)


async def test_surge_producers_wait_for_an_answer_only_as_long_as_asked(tmp_path: Path) -> None:
    from pipeline.app import create_app
    from pipeline.settings import Settings

    app = create_app(Settings(data_dir=tmp_path, producer_request_timeout_ms=4321))
    producer = app.producer._new_producer()
    try:
        # what a connection waits for an answer: read when the client makes one
        assert producer.client._request_timeout_ms == 4321
        assert "request_timeout_ms=self._request_timeout_ms" in inspect.getsource(AIOKafkaClient._get_conn)
        # a batch keeps Faust's expiry: one sent again after a timeout is not failed for its age
        assert producer._request_timeout_ms == int(app.conf.producer_request_timeout * 1000) > 4321
    finally:
        create_app(Settings(data_dir=tmp_path))  # the next app in this process gets the default


async def _send_then_send_to_a_new_topic(
    bootstrap: str, producer: AIOKafkaProducer
) -> tuple[str, Any, float]:
    """A producer that learnt every topic from one refresh (as Faust's does after creating its
    topics), a record to an existing topic left lingering in its batch, then a record to a topic
    created after that refresh. Returns the first topic, the lingering send's future, and how long
    the second send took."""
    old = await _create_topic(bootstrap, 2)
    await producer.client.force_metadata_update()  # tracking none: the metadata of every topic
    await producer.send_and_wait(old, b"first", partition=0)
    new = await _create_topic(bootstrap, 1)
    lingering = await producer.send(old, b"lingering", partition=0)
    started = time.monotonic()
    await (await producer.send(new, b"elsewhere", partition=0))
    return old, lingering, time.monotonic() - started


@pytest.mark.integration
async def test_aiokafka_drops_the_leaders_of_topics_it_sent_to_untracked(kafka: EmbeddedKafka) -> None:
    """Why :func:`compat.track_sent_topics` exists: without it, the refresh a send to a new topic asks
    for replaces the metadata of every topic sent to so far, and a batch lingering for one of them is
    stuck. When this fails, aiokafka keeps them itself and the helper can go."""
    producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap, linger_ms=1500)
    await producer.start()
    try:
        old, lingering, took_s = await _send_then_send_to_a_new_topic(kafka.bootstrap, producer)
        # the refresh the new topic asked for came at once, long before the first batch's linger ended
        assert producer.client.cluster.leader_for_partition(TopicPartition(old, 0)) is None
        assert took_s >= 1.4, "the second send waited out its own linger"
        await asyncio.sleep(1.0)
        assert not lingering.done(), "sent without its leader's metadata"
        assert compat.producer_backlog(producer)["queued"][f"{old}[0]"]["tracked"] is False
        # what a stuck send's report does: the refresh it asks for covers the topic again
        assert compat.wake_producer(producer) is True
        assert (await asyncio.wait_for(lingering, 10)).offset == 1
    finally:
        await producer.stop()


@pytest.mark.integration
async def test_track_sent_topics_keeps_every_topic_a_producer_sent_to(kafka: EmbeddedKafka) -> None:
    producer = AIOKafkaProducer(bootstrap_servers=kafka.bootstrap, linger_ms=1500)
    compat.track_sent_topics(producer)
    compat.track_sent_topics(producer)  # idempotent
    await producer.start()
    try:
        old, lingering, _ = await _send_then_send_to_a_new_topic(kafka.bootstrap, producer)
        assert (await asyncio.wait_for(lingering, 10)).offset == 1
        assert producer.client.cluster.leader_for_partition(TopicPartition(old, 0)) is not None
    finally:
        await producer.stop()


@pytest.mark.integration
async def test_fausts_producer_tracks_the_topics_it_sends_to(kafka: EmbeddedKafka, tmp_path: Path) -> None:
    from pipeline.app import create_app
    from pipeline.settings import Settings

    app = create_app(
        Settings(
            data_dir=tmp_path, broker=f"kafka://{kafka.bootstrap}", app_id=f"compat-{uuid.uuid4().hex[:8]}"
        )
    )
    await app.producer.maybe_start()
    try:
        producer = compat.kafka_producer(app.producer)
        old = await _create_topic(kafka.bootstrap, 1)
        await producer.client.force_metadata_update()
        await producer.send_and_wait(old, b"x")
        assert old in producer.client._topics
    finally:
        await app.producer.stop()


async def test_producer_backlog_and_wake_on_aiokafkas_own_producer() -> None:
    """What a stuck send's report reads from the producer, and the wake-up, on a real (never started)
    aiokafka producer: a batch queued for a partition with no known leader, and a sender asleep."""
    from aiokafka import AIOKafkaProducer
    from aiokafka.structs import TopicPartition

    producer = AIOKafkaProducer(bootstrap_servers="127.0.0.1:1")
    acc = producer._message_accumulator
    await acc.add_message(TopicPartition("replies", 1), b"u1", b"{}", timeout=1.0)
    acc.drain_by_nodes(ignore_nodes=set())  # as the sender does before it sleeps: a fresh waiter
    backlog = compat.producer_backlog(producer)
    assert backlog["queued"]["replies[1]"]["leader"] is None
    assert backlog["queued"]["replies[1]"]["tries"] == [0]
    assert backlog["sent_unanswered"] == [] and backlog["nodes_in_flight"] == []
    assert backlog["sender_running"] is False
    assert not acc.waiter().done()
    assert compat.wake_producer(producer) is True
    assert acc.waiter().done()
    assert compat.wake_producer(producer) is False


def test_producer_buffer_size_counts_what_faust_s_conductor_waits_on() -> None:
    """The inference agent paces batch reading by this number: it must be the one the conductor
    compares with ``max_messages`` before delivering each record (``wait_until_ebb``)."""
    from faust.transport.producer import ProducerBuffer

    assert "self.size > self.max_messages" in inspect.getsource(ProducerBuffer.wait_until_ebb)
    assert ProducerBuffer.max_messages == 100
    conductor = inspect.getsource(faust.transport.conductor)
    assert "await wait_until_producer_ebb()" in conductor
    app = faust.App(f"buffer-{uuid.uuid4().hex[:6]}", broker="kafka://127.0.0.1:1")
    assert compat.producer_buffer_size(app) == 0
    for n in range(3):
        app.producer.buffer.pending.put_nowait(object())  # what put() does without a threaded producer
        assert compat.producer_buffer_size(app) == n + 1
    assert compat.producer_buffer_size(object()) == 0


class _Delivering(mode.Service):
    """What the patched ``Consumer.wait_first`` reads of a consumer: its flow event and mode's own."""

    def __init__(self) -> None:
        super().__init__()
        self.suspend_flow = asyncio.Event()


async def test_eager_delivery_runs_a_delivery_that_does_not_wait_inline() -> None:
    """A record put into a stream's buffer without waiting is handed over in the drain's own task: no
    four tasks per record (docs/architecture.md, "Delivering records")."""
    compat.eager_delivery()
    svc = _Delivering()
    ran_in: list[object] = []

    async def deliver() -> str:
        ran_in.append(asyncio.current_task())
        return "delivered"

    result = await Consumer.wait_first(svc, deliver(), svc.suspend_flow.wait())
    assert ran_in == [asyncio.current_task()]
    assert result.results == ["delivered"] and not result.stopped


async def test_eager_delivery_still_abandons_a_blocked_delivery_when_the_flow_is_suspended() -> None:
    """A delivery that has to wait (flow control during a rebalance) goes through mode's wait_first
    as before: a suspended flow ends the wait and cancels the delivery; one that can go on finishes."""
    compat.eager_delivery()
    svc = _Delivering()
    room = asyncio.Event()
    trail: list[str] = []

    async def deliver() -> None:
        trail.append("first step")
        try:
            await room.wait()
            trail.append("delivered")
        except asyncio.CancelledError:
            trail.append("abandoned")
            raise

    waiting = asyncio.ensure_future(Consumer.wait_first(svc, deliver(), svc.suspend_flow.wait()))
    await asyncio.sleep(0.01)
    assert trail == ["first step"] and not waiting.done()
    svc.suspend_flow.set()
    await asyncio.wait_for(waiting, 1)
    await asyncio.sleep(0)
    assert trail == ["first step", "abandoned"]

    svc.suspend_flow.clear()
    trail.clear()
    waiting = asyncio.ensure_future(Consumer.wait_first(svc, deliver(), svc.suspend_flow.wait()))
    await asyncio.sleep(0.01)
    room.set()
    await asyncio.wait_for(waiting, 1)
    assert trail == ["first step", "delivered"]


async def test_eager_delivery_leaves_a_suspended_flow_and_other_calls_to_mode() -> None:
    compat.eager_delivery()
    svc = _Delivering()
    svc.suspend_flow.set()
    ran_in: list[object] = []

    async def deliver() -> None:
        ran_in.append(asyncio.current_task())

    await Consumer.wait_first(svc, deliver(), svc.suspend_flow.wait())
    other = asyncio.Event()
    other.set()
    await Consumer.wait_first(svc, deliver(), other.wait())  # not the flow's event: mode's path
    assert len(ran_in) == 2 and asyncio.current_task() not in ran_in
