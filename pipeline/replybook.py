"""The reply book: each request's reply, recorded once, so that a repeat is the same reply.

A worker may die after sending a reply and before committing the request's offset; the next owner
then reads the request again. Before computing anything for a request, intake and inference look
it up here and re-send what was recorded; before sending a new reply they record it, and if another
worker recorded one first they send that one instead. So a request never gets an error first and an
answer later, nor two different answers (docs/architecture.md, "Guarantees").

The store is any ``MutableMapping[str, dict]``: in a worker a Faust GlobalTable on RocksDB with a
changelog (every worker sees every record; it survives restarts), in tests a dict. Entries older
than ``ttl_ms`` are ignored and removed when met. Keys come from :func:`pipeline.keys.reply_key`.
Pure: no Kafka or Faust imports.
"""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from typing import Any


class ReplyBook:
    """Recorded replies (their encoded JSON) by request key, with a time to live."""

    def __init__(
        self, store: MutableMapping[str, Any], *, ttl_ms: float, clock_ms: Callable[[], float]
    ) -> None:
        self.store = store
        self.ttl_ms = ttl_ms
        self.clock_ms = clock_ms

    def get(self, key: str) -> bytes | None:
        """The recorded reply of a request, or None (never recorded, or expired)."""
        raw = self.store.get(key)
        if raw is None:
            return None
        if self.clock_ms() - float(raw.get("at_ms", 0)) >= self.ttl_ms:
            try:
                del self.store[key]
            except KeyError:
                pass
            return None
        return str(raw["reply"]).encode("utf-8")

    def record(self, key: str, reply: bytes) -> bytes:
        """Record ``reply`` unless a reply is already recorded; returns the reply to send.

        Called just before a reply is sent: the first reply recorded for a request wins, and every
        later attempt (a redelivery, a second worker) sends that one.
        """
        known = self.get(key)
        if known is not None:
            return known
        self.store[key] = {"reply": reply.decode("utf-8"), "at_ms": self.clock_ms()}
        return reply


def expired_entry(value: Any, now_ms: float, ttl_ms: float) -> bool:
    """Whether a stored reply-book entry (its decoded value) is past ``ttl_ms``: what the sweep of
    a worker's local store deletes (docs/architecture.md, "Guarantees"). An entry that is not a
    recorded reply (no ``at_ms``) is left alone."""
    if not isinstance(value, dict):
        return False
    at = value.get("at_ms")
    return isinstance(at, int | float) and now_ms - float(at) >= ttl_ms
