"""What runs beside a benchmark's load: scrapers, reply readers, probes, each one asyncio task.

:class:`Background` is how every one of them starts and stops: the stop cancels the task and waits
for it, so nothing is left running on the scenario's event loop when it closes. The ones that read
Kafka read with a :func:`plain_consumer`.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from aiokafka import AIOKafkaConsumer


def plain_consumer(
    bootstrap: str, security: dict[str, Any] | None = None, **options: Any
) -> AIOKafkaConsumer:
    """An aiokafka consumer in no group that commits nothing: it reads beside the pipeline without
    touching its consumer groups (``security``: :func:`pipeline.kafka_security.client_options`;
    ``options``: more consumer settings). Not started."""
    from aiokafka import AIOKafkaConsumer

    return AIOKafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, **(security or {}), **options
    )


class Background:
    """One asyncio task running :meth:`_loop` from :meth:`start` until :meth:`stop`."""

    def __init__(self) -> None:
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> None:
        """Cancel the task and wait until it has ended (idempotent)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        raise NotImplementedError
