"""A produce request the broker never answers costs a worker its request timeout, not 20 minutes.

A worker's own broker sits behind a proxy that drops one Produce request carrying replies: the broker
never sees it, and nothing answers it. With Faust's default producer timeout (20 minutes) the replies
in it, and every record sent after them, waited that long with their records unacked; surge sets the
timeout (``producer_request_timeout_ms``), after which the records are sent again.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from pipeline.devtools.broker import EmbeddedKafka, free_port
from pipeline.devtools.kafka_proxy import KafkaProxy, names_topic
from tests.conftest import Deployment, request
from tests.test_failover_integration import ECHO, repeats

pytestmark = pytest.mark.integration

TIMEOUT_MS = 3000


def test_a_topic_is_found_in_either_string_encoding_and_nowhere_else() -> None:
    classic = b"\x00\x00\x00\x07" + b"\x00\x0ct1.replies.x" + b"\x00"
    compact = b"\x00\x00\x00\x09" + b"\x0dt1.replies.x" + b"\x00"
    assert names_topic(classic, "t1.replies.x")
    assert names_topic(compact, "t1.replies.x")
    assert not names_topic(classic, "t1.replies")  # a prefix of a longer name is another topic
    assert not names_topic(b"\x00\x0ct2.replies.x", "t1.replies.x")


@pytest.fixture
def proxied_broker(tmp_path: Path, kafka: EmbeddedKafka):
    """A broker of its own, advertised at a proxy's port: every connection after the bootstrap goes
    through the proxy."""
    proxy = KafkaProxy("127.0.0.1", free_port()).start()
    broker = EmbeddedKafka(
        tmp_path / "own-kafka",
        cache_dir=kafka.cache_dir,
        port=proxy.upstream[1],
        partitions=4,
        heap_mb=384,
        advertised_port=proxy.port,
    )
    broker.start()
    try:
        yield broker, proxy
    finally:
        broker.stop()
        proxy.stop()


async def test_replies_in_a_produce_request_the_broker_never_answers_are_sent_again(
    proxied_broker: tuple[EmbeddedKafka, KafkaProxy], tmp_path: Path
) -> None:
    broker, proxy = proxied_broker
    d = Deployment(broker, tmp_path / "dep", **ECHO, producer_request_timeout_ms=str(TIMEOUT_MS))
    try:
        d.worker()
        c = await d.client()
        warm = [await c.submit(request(f"w{i}", f"u{i % 4}", f"warm {i}")) for i in range(8)]
        await c.producer.flush()
        await d.replies(warm, 60)
        assert proxy.connections > 0, "the clients did not go through the proxy"

        proxy.swallow_produce(d.topics.replies)
        t0 = time.monotonic()
        futs = [await c.submit(request(i, f"u{i % 4}", f"question {i}")) for i in range(30)]
        await c.producer.flush()
        # Faust's 20 minutes would keep at least one of them unanswered here
        replies = await d.replies(futs, 10 * TIMEOUT_MS / 1000)
        took_s = time.monotonic() - t0
        print(f"all {len(replies)} answered {took_s:.2f} s after the first was sent")
        assert proxy.swallowed == 1, "no reply was lost on its way: the test did not test anything"
        assert all(r.status == "ok" for r in replies), [r.error for r in replies if r.status != "ok"][:3]
        assert took_s >= TIMEOUT_MS / 1000 * 0.8, f"all answered in {took_s:.1f} s: none waited"
        await asyncio.sleep(1.0)
        extra, differing = repeats(c.replies)
        assert not differing
        assert extra == 0, f"a request the broker never saw came back {extra} times too many"
        status = d.workers[0].status()
        assert status["unacked_records"] == 0, status
        assert status["sends_awaiting_broker"] == {"groups": 0, "oldest_ms": None}, status
    finally:
        await d.close()
