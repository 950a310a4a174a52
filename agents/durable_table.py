"""A Faust table whose writes can be awaited until their changelog record is on the broker.

A Faust table sends each write's changelog record through the producer's buffer, some time after
the write, and forgets the future of that send. The reply book cannot work that way: a reply sent
before its record is durable can reach the client while the record dies with the worker (SIGKILL),
and the next owner of the request then computes a second, different reply. So the reply book's
writes go through this wrapper, and :meth:`Runtime.publish` sends a reply only once the record's
changelog send is acknowledged (docs/architecture.md, "Guarantees").

The records skip Faust's producer buffer: past 100 records there Faust stops delivering records to
every stream, the intake's included, and one record per reply filled it whenever replies came fast
(docs/architecture.md, "Intake first"). They wait in an outbox of their own, sent in order by one
task, as Faust's buffer sends its records.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Iterator, MutableMapping
from typing import Any

from faust.types import TableT

from pipeline.compat import changelog_message


class DurableTable(MutableMapping[str, Any]):
    """``table`` as a mapping; :meth:`durable` is the acknowledgement of a key's last write."""

    def __init__(self, table: TableT) -> None:
        self.table = table
        self._pending: dict[str, asyncio.Future[Any]] = {}
        self._outbox: deque[Any] = deque()
        self._sender: asyncio.Task[None] | None = None

    def __getitem__(self, key: str) -> Any:
        value = self.table.get(key)
        if value is None:
            raise KeyError(key)
        return value

    def get(self, key: str, default: Any = None) -> Any:
        value = self.table.get(key)
        return default if value is None else value

    def __setitem__(self, key: str, value: Any) -> None:
        """Send the changelog record and write the local store, keeping the send's future (the
        same two steps as the table's own ``__setitem__``, which drops it). Nothing is written
        when the send cannot be queued (no metadata for the changelog yet): the caller tries again."""
        fut = self._enqueue_record(None, key, value)
        self.table.data[key] = value
        self._track(key, fut)

    def __delitem__(self, key: str) -> None:
        """Send the tombstone and delete locally. The tombstone goes through the same outbox as the
        writes, to the key's partition: behind a write of the same key sent before it, never ahead
        of one sent after it (Faust's own delete would take its buffer, and overtake the outbox)."""
        if self.table.data.get(key) is None:
            raise KeyError(key)
        self._track(key, self._enqueue_record(None, key, None, value_serializer="raw"))
        del self.table.data[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.table)

    def __len__(self) -> int:
        return len(self.table)

    def durable(self, key: str) -> asyncio.Future[Any] | None:
        """The broker's acknowledgement of ``key``'s last write while it is still unsent or in
        flight (it resolves to the record's metadata or raises the send's error); None once it
        has been acknowledged, or when this process wrote nothing for ``key``."""
        return self._pending.get(key)

    def resend(self, key: str) -> asyncio.Future[Any]:
        """Send ``key``'s changelog record again (its last send failed); its new acknowledgement.
        The local store already holds the value (and this may run outside any event, where the
        store cannot be written).

        The record goes to the partition its first send chose. Choosing it again would need the
        producer's metadata of the changelog, which a worker can lack for a while when the broker
        is slow to answer (a refresh that came back without the topic); the send itself waits for
        the metadata instead of failing."""
        last = self._pending.get(key)
        message = getattr(last, "message", None)
        partition = getattr(message, "partition", None)
        return self._track(key, self._enqueue_record(partition, key, self.table.data[key]))

    def waiting(self) -> int:
        """Records made and not yet handed to the Kafka producer."""
        return len(self._outbox)

    def _enqueue_record(
        self, partition: int | None, key: str, value: Any, value_serializer: str | None = None
    ) -> asyncio.Future[Any]:
        """Queue the changelog record (raises, queueing nothing, without the changelog's metadata)."""
        message = changelog_message(self.table, partition, key, value, value_serializer)
        self._outbox.append(message)
        if self._sender is None or self._sender.done():
            self._sender = asyncio.ensure_future(self._drain_outbox())
        return message

    async def _drain_outbox(self) -> None:
        """Hand each queued record to the producer, in order; a record that cannot be handed over
        fails its future, which the reply path then sends again (:meth:`resend`)."""
        while self._outbox:
            message = self._outbox.popleft()
            try:
                await message.message.channel.publish_message(message, wait=False)
            except asyncio.CancelledError:
                self._fail_record(message, ConnectionError("the worker stopped before the record was sent"))
                while self._outbox:
                    self._fail_record(self._outbox.popleft(), ConnectionError("the worker stopped"))
                raise
            except Exception as exc:
                self._fail_record(message, exc)

    @staticmethod
    def _fail_record(message: asyncio.Future[Any], exc: BaseException) -> None:
        if not message.done():
            with contextlib.suppress(asyncio.InvalidStateError):
                message.set_exception(exc)

    def _track(self, key: str, fut: asyncio.Future[Any]) -> asyncio.Future[Any]:
        """Keep ``fut`` as ``key``'s acknowledgement until it resolves without an error."""
        self._pending[key] = fut
        fut.add_done_callback(lambda done: self._forget(key, done))
        return fut

    def _forget(self, key: str, done: asyncio.Future[Any]) -> None:
        if self._pending.get(key) is done and not done.cancelled() and done.exception() is None:
            del self._pending[key]
