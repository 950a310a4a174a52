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
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

log = logging.getLogger("surge.replies")

#: how often one reply's wait or send is tried again after a future it awaited was cancelled by
#: something other than this task; then it fails like a send that failed (its records are not acked)
CANCELLED_ATTEMPTS = 3

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
        return _Acknowledged(key, sent)

    async def _drain(self) -> None:
        cancelled = 0  # times the head's wait or send was cancelled from outside this task
        while self._queue:
            head = self._queue[0]
            try:
                if head.record_ack is not None:
                    await self._durable(head.key, head.record_ack)
                delivery = await head.send()
            except asyncio.CancelledError:
                if task_is_cancelling():  # this task is being stopped: so is every reply still queued
                    for q in self._queue:
                        q.sent.cancel()
                    self._queue.clear()
                    raise
                # A future the head awaited was cancelled by someone else. Taken for this task's
                # own cancellation, it used to empty the queue silently: those replies were never
                # sent and their records never acked (docs/architecture.md, "Guarantees").
                cancelled += 1
                log.warning(
                    "the reply to %s: a wait was cancelled from outside (attempt %d of %d, %d "
                    "replies queued)",
                    head.key,
                    cancelled,
                    CANCELLED_ATTEMPTS,
                    len(self._queue),
                    exc_info=True,
                )
                if cancelled < CANCELLED_ATTEMPTS:
                    await asyncio.sleep(0.05 * cancelled)
                    continue
                self._fail_head(head, RuntimeError(f"the reply to {head.key}: cancelled {cancelled} times"))
                cancelled = 0
                continue
            except Exception as exc:  # the caller's ack_after stops the worker: nothing is acked
                self._fail_head(head, exc)
                cancelled = 0
                continue
            self._queue.popleft()
            head.sent.set_result(delivery)
            cancelled = 0

    def _fail_head(self, head: _Queued, exc: BaseException) -> None:
        self._queue.popleft()
        head.sent.set_exception(exc)


def task_is_cancelling() -> bool:
    """Whether the running task has been asked to stop (as opposed to a future it awaited having
    been cancelled by someone else, which raises the same CancelledError in it)."""
    task = asyncio.current_task()
    return task is not None and task.cancelling() > 0


class _Acknowledged:
    """A queued reply's acknowledgement: awaits its hand-over to the producer, then the broker's
    ack (awaitable, no task); its repr names the reply, for a report of sends that wait too long."""

    __slots__ = ("key", "sent")

    def __init__(self, key: str, sent: asyncio.Future[Awaitable[Any]]) -> None:
        self.key, self.sent = key, sent

    def __await__(self) -> Any:
        return self._wait().__await__()

    async def _wait(self) -> Any:
        return await (await self.sent)

    def __repr__(self) -> str:
        if not self.sent.done() or self.sent.cancelled() or self.sent.exception() is not None:
            return f"reply {self.key} (queued)"
        return f"reply {self.key}: {self.sent.result()!r}"
