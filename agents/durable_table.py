"""A Faust table whose writes can be awaited until their changelog record is on the broker.

A Faust table sends each write's changelog record through the producer's buffer, some time after
the write, and forgets the future of that send. The reply book cannot work that way: a reply sent
before its record is durable can reach the client while the record dies with the worker (SIGKILL),
and the next owner of the request then computes a second, different reply. So the reply book's
writes go through this wrapper, and :meth:`Runtime.publish` sends a reply only once the record's
changelog send is acknowledged (docs/architecture.md, "Guarantees").
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator, MutableMapping
from typing import Any

from faust.types import TableT


class DurableTable(MutableMapping[str, Any]):
    """``table`` as a mapping; :meth:`durable` is the acknowledgement of a key's last write."""

    def __init__(self, table: TableT) -> None:
        self.table = table
        self._pending: dict[str, asyncio.Future[Any]] = {}

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
        fut = self.table.send_changelog(None, key, value)
        self.table.data[key] = value
        self._track(key, fut)

    def __delitem__(self, key: str) -> None:
        del self.table[key]

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
        return self._track(key, self.table.send_changelog(partition, key, self.table.data[key]))

    def _track(self, key: str, fut: asyncio.Future[Any]) -> asyncio.Future[Any]:
        """Keep ``fut`` as ``key``'s acknowledgement until it resolves without an error."""
        self._pending[key] = fut
        fut.add_done_callback(lambda done: self._forget(key, done))
        return fut

    def _forget(self, key: str, done: asyncio.Future[Any]) -> None:
        if self._pending.get(key) is done and not done.cancelled() and done.exception() is None:
            del self._pending[key]
