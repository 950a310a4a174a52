"""Replies leave in the order they were published, each only once its reply-book record is durable.

:meth:`agents.runtime.Runtime.publish` records a reply, then hands it here. A reply whose record is
still on its way to the broker waits for that acknowledgement; so does every reply published after it,
so one user's replies keep the order the worker made them in (docs/architecture.md, "Guarantees":
per-user order, and a reply is never visible without its record). The records of one batch are
acknowledged together, so the queue costs one broker round trip per batch, not per reply.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

#: waits until the record of a reply key is on the broker (sending it again when its send failed)
Durable = Callable[[str, Awaitable[Any]], Awaitable[None]]
#: enqueues a reply with the producer; returns the broker's acknowledgement of it
Send = Callable[[], Awaitable[Awaitable[Any]]]


@dataclass(slots=True)
class _Queued:
    key: str
    record_ack: Awaitable[Any] | None
    send: Send
    sent: asyncio.Future[Awaitable[Any]]


class ReplySequencer:
    """A FIFO of replies, drained by one task that exists only while replies wait."""

    def __init__(self, durable: Durable) -> None:
        self._durable = durable
        self._queue: collections.deque[_Queued] = collections.deque()
        self._task: asyncio.Task[None] | None = None

    @property
    def waiting(self) -> int:
        """Replies not handed to the producer yet."""
        return len(self._queue)

    async def submit(self, key: str, record_ack: Awaitable[Any] | None, send: Send) -> Awaitable[Any]:
        """Send a reply after every reply submitted before it and after ``record_ack`` (None: its
        record is already durable). Returns the reply's acknowledgement by the broker. With nothing
        queued and nothing to wait for, the reply is enqueued with the producer right away."""
        if record_ack is None and not self._queue:
            return await send()
        sent: asyncio.Future[Awaitable[Any]] = asyncio.get_running_loop().create_future()
        self._queue.append(_Queued(key, record_ack, send, sent))
        if self._task is None or self._task.done():
            self._task = asyncio.ensure_future(self._drain())
        return _acknowledged(sent)

    async def _drain(self) -> None:
        while self._queue:
            head = self._queue[0]
            try:
                if head.record_ack is not None:
                    await self._durable(head.key, head.record_ack)
                delivery = await head.send()
            except asyncio.CancelledError:
                for q in self._queue:
                    q.sent.cancel()
                self._queue.clear()
                raise
            except Exception as exc:  # the caller's ack_after stops the worker: nothing is acked
                self._queue.popleft()
                head.sent.set_exception(exc)
                continue
            self._queue.popleft()
            head.sent.set_result(delivery)


async def _acknowledged(sent: asyncio.Future[Awaitable[Any]]) -> Any:
    return await (await sent)
