"""A TCP proxy in front of a Kafka broker that can lose chosen produce requests (fault injection).

A broker advertised at the proxy's port (``EmbeddedKafka(advertised_port=...)``) has every client
connection after the bootstrap go through the proxy, which forwards bytes unchanged both ways.
:meth:`KafkaProxy.swallow_produce` makes it drop the next Produce requests that write to a topic: the
broker never sees them and never answers, as with a request lost on a half-open connection. The
client's request then waits for its request timeout; what a worker does meanwhile is what the tests
check (docs/architecture.md, "Guarantees").

The proxy runs its own event loop in a thread, so that a test blocked on something else (a worker
starting) does not stall every connection through it.
"""

from __future__ import annotations

import asyncio
import contextlib
import struct
import threading
from concurrent.futures import Future

from pipeline.devtools.broker import free_port

#: Kafka's api key of a Produce request (the first two bytes after a request's size)
PRODUCE = 0


def names_topic(request: bytes, topic: str) -> bool:
    """Whether a request's bytes carry ``topic`` as a string: length-prefixed as in the classic
    protocol versions (int16) or in the flexible ones (unsigned varint of length + 1)."""
    name = topic.encode()
    compact = bytearray()
    n = len(name) + 1
    while True:
        byte, n = n & 0x7F, n >> 7
        compact.append(byte | (0x80 if n else 0))
        if not n:
            break
    return struct.pack(">h", len(name)) + name in request or bytes(compact) + name in request


class KafkaProxy:
    """Forwards ``host:port`` to ``upstream_host:upstream_port``; see the module docstring."""

    def __init__(
        self, upstream_host: str, upstream_port: int, *, host: str = "127.0.0.1", port: int | None = None
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.host = host
        self.port = port or free_port(host)
        self._lock = threading.Lock()
        self._swallow: dict[str, int] = {}  # topic -> produce requests still to drop
        self._swallowed = 0
        self._connections = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._server: asyncio.Server | None = None

    # ---- control (any thread) ---------------------------------------------------------------------
    def swallow_produce(self, topic: str, count: int = 1) -> None:
        """Drop the next ``count`` Produce requests that write to ``topic`` (with whatever else each
        request carries)."""
        with self._lock:
            self._swallow[topic] = self._swallow.get(topic, 0) + count

    @property
    def swallowed(self) -> int:
        """Produce requests dropped so far."""
        with self._lock:
            return self._swallowed

    @property
    def connections(self) -> int:
        """Client connections accepted so far."""
        with self._lock:
            return self._connections

    def start(self) -> KafkaProxy:
        """Listen (returns once the port accepts connections)."""
        ready: Future[None] = Future()

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                self._server = loop.run_until_complete(
                    asyncio.start_server(self._serve, self.host, self.port)
                )
            except BaseException as exc:
                ready.set_exception(exc)
                loop.close()
                return
            ready.set_result(None)
            loop.run_forever()
            loop.close()

        self._thread = threading.Thread(target=run, name=f"kafka-proxy-{self.port}", daemon=True)
        self._thread.start()
        ready.result(timeout=10)
        return self

    def stop(self) -> None:
        """Close the listener and every connection through it."""
        loop, thread = self._loop, self._thread
        if loop is None or thread is None:
            return

        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for task in asyncio.all_tasks():
                if task is not asyncio.current_task():
                    task.cancel()

        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(close(), loop).result(timeout=10)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        self._loop = self._thread = None

    def __enter__(self) -> KafkaProxy:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ---- the proxy's loop -------------------------------------------------------------------------
    def _drop(self, request: bytes) -> bool:
        if len(request) < 2 or struct.unpack_from(">h", request)[0] != PRODUCE:
            return False
        with self._lock:
            for topic, left in self._swallow.items():
                if left > 0 and names_topic(request, topic):
                    self._swallow[topic] = left - 1
                    self._swallowed += 1
                    return True
        return False

    async def _serve(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        with self._lock:
            self._connections += 1
        try:
            broker_r, broker_w = await asyncio.open_connection(*self.upstream)
        except OSError:
            client_w.close()
            return
        pumps = [
            asyncio.ensure_future(self._requests(client_r, broker_w)),
            asyncio.ensure_future(self._bytes(broker_r, client_w)),
        ]
        try:
            await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for pump in pumps:
                pump.cancel()
            for writer in (client_w, broker_w):
                writer.close()

    async def _requests(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Client to broker, one request frame (int32 size, then the request) at a time."""
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                size = await reader.readexactly(4)
                request = await reader.readexactly(struct.unpack(">i", size)[0])
                if self._drop(request):
                    continue
                writer.write(size + request)
                await writer.drain()

    @staticmethod
    async def _bytes(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Broker to client, unchanged."""
        with contextlib.suppress(ConnectionError):
            while chunk := await reader.read(65536):
                writer.write(chunk)
                await writer.drain()
