"""Fixtures: one real Kafka broker for the session, and factories for workers and clients.

Each test gets its own topic prefix and app id, so tests share the broker but not their topics,
consumer groups or tables (quixstreams' containerhelper/factory-fixture style).
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from aiokafka.admin import AIOKafkaAdminClient
from aiokafka.errors import KafkaError

from pipeline.devtools.broker import EmbeddedKafka
from pipeline.devtools.deployment import Deployment as SharedDeployment
from pipeline.devtools.deployment import deployment_env, load_settings
from pipeline.devtools.procs import WorkerProcess
from pipeline.settings import Settings
from tests.preloaded import launch_preloaded

log = logging.getLogger("tests")

#: deadlines long enough that a test about something else never sees deadline_exceeded
RELAXED = {"deadline_interactive_ms": "60000", "deadline_batch_ms": "60000"}
SHARED_DATA = Path(__file__).resolve().parents[1].parent / "shared" / "data"


@pytest.fixture(scope="session", autouse=True)
def preloaded_workers() -> Iterator[None]:
    """Workers fork from a process that imported their libraries once (tests/preloaded.py)."""
    WorkerProcess.launcher = launch_preloaded
    yield
    WorkerProcess.launcher = None


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Tests marked ``heavy`` (whole processes killed and restarted, benchmark runs) share one xdist
    group: under ``-n 2 --dist loadgroup`` (the README's test command) they run one after another on
    one process while the other takes the rest, so no two of them fight over the 2 cores their
    timings were made on."""
    for item in items:
        if item.get_closest_marker("heavy") is not None:
            item.add_marker(pytest.mark.xdist_group("heavy"))


@pytest.fixture(scope="session")
def kafka(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedKafka]:
    """A real Apache Kafka 4.x broker (KRaft) for the whole test run."""
    k = EmbeddedKafka(tmp_path_factory.mktemp("kafka"), partitions=4, heap_mb=768)
    k.start()
    yield k
    k.stop()


#: what every test deployment runs unless a test says otherwise
TEST_ENV = {"SURGE_PARTITIONS": "4", "SURGE_MODEL": "echo", "SURGE_COMMIT_INTERVAL_MS": "200"}


class Deployment(SharedDeployment):
    """One isolated surge deployment on the shared broker (:class:`pipeline.devtools.deployment.Deployment`
    with the tests' defaults); ``env`` keys are Settings field names or ``SURGE_*`` names."""

    def __init__(self, kafka: EmbeddedKafka, tmp: Path, **env: Any) -> None:
        tag = uuid.uuid4().hex[:8]
        full = deployment_env(
            kafka.bootstrap,
            prefix=f"t{tag}.",
            app_id=f"surge-{tag}",
            data_dir=tmp / "data",
            defaults=TEST_ENV,
            **env,
        )
        super().__init__("test", full, kafka.bootstrap, tmp)

    def stop_workers(self, timeout_s: float = 30.0) -> None:
        """At teardown, SIGKILL: what a test checks has happened by then, and a graceful stop
        (tested where it matters, with ``terminate``) costs seconds per worker."""
        for w in self.workers:
            w.kill()

    async def close(self, timeout_s: float = 30.0, delete_topics: bool = True) -> None:
        """Stop clients and workers, then delete the deployment's topics (its prefix, its app id's
        changelogs and internal topics): the broker is shared by the whole run, and a run that kept
        every test's topics would end with thousands of partitions slowing every later test.
        ``delete_topics=False`` where a worker outside :attr:`workers` (one in the test's own
        process) still reads them."""
        await super().close(timeout_s)
        if not delete_topics:
            return
        prefix, app = self.env["SURGE_TOPIC_PREFIX"], f"{self.env['SURGE_APP_ID']}-"
        admin = AIOKafkaAdminClient(bootstrap_servers=self.bootstrap)
        try:
            await admin.start()
            mine = [t for t in await admin.list_topics() if t.startswith((prefix, app))]
            if mine:
                await admin.delete_topics(mine, timeout_ms=30_000)
        except KafkaError as e:  # a leftover topic costs the broker a little; not a test failure
            log.warning("topics of %s not deleted: %r", prefix, e)
        finally:
            await admin.close()

    @property
    def settings(self) -> Settings:  # type: ignore[override]
        """A property here, for tests/test_gateway.py; ``settings()`` on the shared class."""
        return load_settings(self.env)


@pytest.fixture
async def deployment(kafka: EmbeddedKafka, tmp_path: Path) -> AsyncIterator[Callable[..., Deployment]]:
    """Factory: ``deployment(model="faq", ...)`` makes an isolated deployment; closed at teardown."""
    made: list[Deployment] = []

    def make(**env: Any) -> Deployment:
        d = Deployment(kafka, tmp_path / f"d{len(made)}", **env)
        made.append(d)
        return d

    yield make
    for d in made:
        await d.close()


def request(i: int | str, user: str = "u1", text: str | None = None, **kw: Any) -> dict[str, Any]:
    """A valid InferenceRequest dict."""
    return {"request_id": f"r-{i}", "user_id": user, "prompt": text or f"question number {i}", **kw}


def decode(record: Any) -> dict[str, Any]:
    return json.loads(record.value)
