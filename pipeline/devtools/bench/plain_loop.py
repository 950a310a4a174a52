"""The overhead benchmark's baseline: a plain aiokafka consume → echo → produce → commit loop.

Run as its own process (``python -m pipeline.devtools.bench.plain_loop``), like a surge worker, so the two
arms compete for the same CPUs in the same way. It reads the request topic in a consumer group,
answers each record with the echo model, sends one reply per record to its ``reply_to`` topic,
waits for the broker's acks, then commits the offsets: the same at-least-once shape as surge, with
none of its validation, scheduling, batching windows or extra topic hops.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time

from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from models.base import ChatMessage, ModelInput
from models.echo import EchoModel


def _reply(record: bytes, model: EchoModel) -> tuple[str, bytes, bytes] | None:
    try:
        req = json.loads(record)
        text = req.get("prompt") or req["messages"][-1]["content"]
        out = model.infer(
            [ModelInput((ChatMessage("user", text),), max_tokens=int(req.get("max_tokens", 256)))]
        )[0]
        reply = {
            "request_id": req["request_id"],
            "user_id": req["user_id"],
            "status": "ok",
            "answer": out.answer,
            "finish_reason": out.finish_reason,
            "served_from": "model",
            "model_version": model.version,
        }
    except (ValueError, KeyError, TypeError, IndexError):
        return None
    return req.get("reply_to") or "", req["user_id"].encode(), json.dumps(reply).encode()


async def serve(bootstrap: str, topic: str, group: str, default_reply_to: str) -> None:
    """Consume ``topic`` forever; prints ``plain loop ready`` once partitions are assigned."""
    model = EchoModel()
    consumer = AIOKafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=group,
        enable_auto_commit=False,
        auto_offset_reset="earliest",
        fetch_max_wait_ms=50,
    )
    producer = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=2)
    try:
        await producer.start()
        await consumer.start()
        announced = False
        while True:
            batches = await consumer.getmany(timeout_ms=100, max_records=500)
            if not announced and consumer.assignment():
                print("plain loop ready", flush=True)
                announced = True
            futures = []
            for records in batches.values():
                for rec in records:
                    out = _reply(rec.value, model)
                    if out is None:
                        continue
                    reply_to, key, value = out
                    futures.append(await producer.send(reply_to or default_reply_to, value=value, key=key))
            if futures:
                await asyncio.gather(*futures)
            if batches:
                await consumer.commit()
    finally:
        await consumer.stop()
        await producer.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--bootstrap", required=True)
    p.add_argument("--topic", required=True)
    p.add_argument("--group", default=f"plain-loop-{int(time.time())}")
    p.add_argument("--reply-to", default="surge.replies")
    args = p.parse_args(argv)
    try:
        asyncio.run(serve(args.bootstrap, args.topic, args.group, args.reply_to))
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
