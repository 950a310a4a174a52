"""What the broker says about a partition's offsets, for the Acker's ledgers (agents/acks.py).

Two questions, each asked rarely: where a partition's reading starts for this worker (the group's
committed offset, else the log start: what the consumer resets to; with the offsets after it that
the committing worker had finished, from the commit's metadata), asked once per partition per
rebalance; and, when a ledger's run waits for an offset that never arrived though later ones did,
the first offset the log really holds from there (a transaction marker or a compacted record is
not in it). A consumer without a group answers the second; one carrying the group id answers the
first without ever joining the group. See docs/architecture.md, "Guarantees".
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterable
from typing import Any

from aiokafka import AIOKafkaConsumer, TopicPartition

from pipeline.compat import READ_COMMITTED, committed_with_metadata_many, refresh_metadata
from pipeline.exceptions import BrokerError
from pipeline.kafka_security import client_options
from pipeline.offsets import decode_done
from pipeline.settings import Settings

log = logging.getLogger("surge.offsets")


#: how long the probe's fetch waits at the log's end for data (aiokafka's default: 500 ms)
PROBE_FETCH_WAIT_MS = 20


class OffsetOracle:
    """Lazily started read-only consumers; :meth:`close` stops them."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self._group: AIOKafkaConsumer | None = None
        self._probe: AIOKafkaConsumer | None = None
        self._lock = asyncio.Lock()
        #: set by :meth:`close`: a question asked during the worker's stop must not start new
        #: consumers that nothing would close again
        self._closed = False

    def _consumer(self, group_id: str | None) -> AIOKafkaConsumer:
        s = self.settings
        return AIOKafkaConsumer(
            bootstrap_servers=s.bootstrap_servers,
            group_id=group_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            # as the worker's consumer reads: a probe that saw an aborted record where the reader
            # met a gap would send the reader back for it again and again (agents/risk.py, _in_order)
            isolation_level=READ_COMMITTED,
            # the probe is paused between questions, so a short wait costs nothing while idle; with
            # aiokafka's 500 ms, a question waited for the last one's fetch, left waiting at the
            # log's end for data, before its own could be sent (see held_from)
            fetch_max_wait_ms=PROBE_FETCH_WAIT_MS,
            **client_options(s),
        )

    async def _started(self) -> tuple[AIOKafkaConsumer, AIOKafkaConsumer]:
        if self._closed:
            raise BrokerError("the offset consumers are closed: the worker is stopping")
        if self._group is None or self._probe is None:
            group, probe = self._consumer(self.settings.group_id), self._consumer(None)
            try:
                await group.start()
                await probe.start()
                # a consumer starts knowing no topic: its first ListOffsets would fail as stale, back
                # off and retry (0.5 s at each worker start); the metadata fetched now answers it
                await refresh_metadata(group)
                await refresh_metadata(probe)
            except BaseException:
                # a start that failed (the broker away) or was cancelled (a rebalance) leaves a
                # consumer holding its connections: stopped here, since the next question makes
                # new ones
                for c in (group, probe):
                    with contextlib.suppress(Exception):
                        await c.stop()
                raise
            self._group, self._probe = group, probe
        return self._group, self._probe

    async def start_of(self, topic: str, partition: int) -> int:
        """The offset this group resumes ``topic[partition]`` from: committed, else the log start."""
        return (await self.start_and_done(topic, partition))[0]

    async def start_and_done(self, topic: str, partition: int) -> tuple[int, set[int]]:
        """Where this group resumes ``topic[partition]`` (committed, else the log start), and the
        offsets after it that the committing worker had finished already (the commit's metadata,
        :func:`pipeline.offsets.decode_done`)."""
        return (await self.starts_and_done([(topic, partition)]))[(topic, partition)]

    async def starts_and_done(
        self, partitions: Iterable[tuple[str, int]]
    ) -> dict[tuple[str, int], tuple[int, set[int]]]:
        """:meth:`start_and_done` of many partitions in two requests (one for the committed offsets,
        one for the log starts of those without one), not two per partition: asked at every
        assignment for every source partition, before the worker reads again."""
        async with self._lock:
            group, _ = await self._started()
            tps = [TopicPartition(topic, partition) for topic, partition in partitions]
            if not tps:
                return {}
            committed = await committed_with_metadata_many(group, tps)
            out: dict[tuple[str, int], tuple[int, set[int]]] = {}
            missing = []
            for tp in tps:
                offset, metadata = committed[tp]
                if offset is None:
                    missing.append(tp)
                else:
                    out[(tp.topic, tp.partition)] = (offset, decode_done(metadata, offset))
            if missing:
                starts = await group.beginning_offsets(missing)
                for tp in missing:
                    out[(tp.topic, tp.partition)] = (int(starts[tp]), set())
            return out

    async def held_from(
        self, topic: str, partition: int, offset: int, max_records: int = 500, *, known_later: bool = False
    ) -> list[int]:
        """The offsets of the first ``max_records`` committed records the log holds from ``offset``
        on, ascending (empty: none up to its end); nothing between them is a record.

        ``known_later``: the caller was handed a committed record after ``offset``, so the fetch
        returns at once and the log's ends need not be asked first: one round trip instead of three
        (a risk stage's reader asks at every transaction a transactional producer commits, and waits
        for the answer; an offset before the log's start is reset to it by the consumer)."""
        async with self._lock:
            _, probe = await self._started()
            tp = TopicPartition(topic, partition)
            if not known_later:
                end = (await probe.end_offsets([tp]))[tp]
                start = (await probe.beginning_offsets([tp]))[tp]
                if offset >= end:
                    return []
                offset = max(offset, start)
            if probe.assignment() != {tp}:
                probe.assign([tp])
            probe.seek(tp, offset)
            probe.resume(tp)
            try:
                batch: dict[Any, list[Any]] = await probe.getmany(
                    tp, timeout_ms=5000, max_records=max_records
                )
            finally:
                # no fetch between questions: one left waiting at the log's end would hold back
                # the next question's (aiokafka keeps one fetch in flight per broker)
                probe.pause(tp)
            return [int(r.offset) for r in batch.get(tp) or []]

    async def close(self) -> None:
        self._closed = True
        for c in (self._group, self._probe):
            if c is not None:
                try:
                    await c.stop()
                except Exception:  # closing on the way out: nothing to do about it
                    log.debug("closing an offset consumer failed", exc_info=True)
        self._group = self._probe = None
