"""The embedded Kafka: clear errors, and a persistent data dir that keeps topic history."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from aiokafka import AIOKafkaConsumer, AIOKafkaProducer

from pipeline.devtools.broker import EmbeddedKafka, read_state
from pipeline.exceptions import BrokerError


def test_a_taken_port_is_a_clear_error(kafka: EmbeddedKafka, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(BrokerError, match=f"port {port} is taken"):
            EmbeddedKafka(tmp_path / "k", cache_dir=kafka.cache_dir, port=port).start()


@pytest.mark.parametrize("missing", ["java", "mvn"])
def test_missing_java_or_maven_is_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, missing: str
) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    other = "mvn" if missing == "java" else "java"
    (bin_dir / other).symlink_to(subprocess.check_output(["which", other], text=True).strip())
    monkeypatch.setenv("PATH", str(bin_dir))
    k = EmbeddedKafka(tmp_path / "data", cache_dir=tmp_path / "empty-cache")
    with pytest.raises(BrokerError, match="Java 17" if missing == "java" else "Maven"):
        k.resolve()


def test_two_processes_resolving_the_jars_at_once_run_maven_once(tmp_path: Path) -> None:
    """On a fresh machine two processes (a demo beside the tests) both found no jars and ran Maven
    into one ``libs.tmp``, each clearing the other's. A fake ``mvn`` that takes a second and counts
    its runs stands in for Maven; both processes get the jars, from one run."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "java").symlink_to(subprocess.check_output(["which", "java"], text=True).strip())
    runs = tmp_path / "runs"
    mvn = bin_dir / "mvn"
    mvn.write_text(
        "#!/bin/sh\n"
        f"echo run >> {runs}\n"
        "sleep 1\n"
        'for a in "$@"; do case "$a" in -DoutputDirectory=*) out="${a#-DoutputDirectory=}";; esac; done\n'
        'mkdir -p "$out" && touch "$out/kafka_2.13-$SURGE_TEST_VERSION.jar"\n'
    )
    mvn.chmod(0o755)
    cache = tmp_path / "cache"
    version = EmbeddedKafka(tmp_path / "probe", cache_dir=cache).version
    code = (
        "import sys; from pathlib import Path; from pipeline.devtools.broker import EmbeddedKafka; "
        "print(EmbeddedKafka(Path(sys.argv[1]), cache_dir=Path(sys.argv[2])).resolve())"
    )
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SURGE_TEST_VERSION": version}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, str(tmp_path / f"d{i}"), str(cache)],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in range(2)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    libs = {Path(out.strip()) for out, _ in outs}
    assert len(libs) == 1 and (libs.pop() / f"kafka_2.13-{version}.jar").is_file()
    assert runs.read_text().count("run") == 1, "the second waited for the first and found the jars"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "pipeline.cli", "kafka", *args],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


async def _produce(bootstrap: str, topic: str, values: list[bytes]) -> None:
    p = AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await p.start()
    try:
        for v in values:
            await p.send_and_wait(topic, v)
    finally:
        await p.stop()


async def _consume_all(bootstrap: str, topic: str, n: int) -> list[bytes]:
    c = AIOKafkaConsumer(
        topic, bootstrap_servers=bootstrap, auto_offset_reset="earliest", enable_auto_commit=False
    )
    await c.start()
    out: list[bytes] = []
    try:
        while len(out) < n:
            batch = await asyncio.wait_for(c.getmany(timeout_ms=500), 30)
            out.extend(r.value for records in batch.values() for r in records)
    finally:
        await c.stop()
    return out


@pytest.mark.integration
def test_cli_broker_restart_keeps_topic_history_and_its_address(kafka: EmbeddedKafka, tmp_path: Path) -> None:
    data = tmp_path / "persistent"
    assert _cli("status", "--data-dir", str(data)).returncode == 1
    started = _cli("start", "--data-dir", str(data))
    assert started.returncode == 0, started.stderr
    state = read_state(data)
    assert state is not None and f"bootstrap {state.bootstrap}" in started.stdout
    try:
        asyncio.run(_produce(state.bootstrap, "history", [b"one", b"two", b"three"]))
        assert _cli("stop", "--data-dir", str(data)).returncode == 0
        assert read_state(data) is None
        assert _cli("start", "--data-dir", str(data)).returncode == 0
        again = read_state(data)
        assert again is not None and again.port == state.port, "a restarted broker keeps its address"
        assert sorted(asyncio.run(_consume_all(again.bootstrap, "history", 3))) == [b"one", b"three", b"two"]
        assert json.loads((data / "ports.json").read_text())["port"] == state.port
    finally:
        _cli("stop", "--data-dir", str(data))


def test_warming_a_broker_reads_back_every_record_and_deletes_its_topic(kafka: EmbeddedKafka) -> None:
    from aiokafka.admin import AIOKafkaAdminClient

    from pipeline.devtools.broker_warmup import IN_FLIGHT, warm_broker

    async def topics() -> set[str]:
        admin = AIOKafkaAdminClient(bootstrap_servers=kafka.bootstrap)
        await admin.start()
        try:
            return set(await admin.list_topics())
        finally:
            await admin.close()

    warm = asyncio.run(warm_broker(kafka.bootstrap, 1.0))
    assert warm.sent >= IN_FLIGHT and warm.sent % IN_FLIGHT == 0
    assert warm.read == warm.sent
    assert warm.topic.startswith("surge-broker-warmup-")
    assert f"{warm.sent} records sent and {warm.read} read back" in warm.line()
    for _ in range(50):  # the deletion reaches the broker's metadata shortly after the controller's
        if warm.topic not in asyncio.run(topics()):
            break
        time.sleep(0.2)
    assert warm.topic not in asyncio.run(topics())
