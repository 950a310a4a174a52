"""An embedded, single-node Apache Kafka 4.x broker in KRaft mode, for the demo and the tests.

Lifecycle: :meth:`EmbeddedKafka.resolve` (Maven fetches the broker's jars into a cache folder, once)
→ :meth:`format` (a KRaft data dir, once per data dir) → :meth:`start` (a JVM on a free or given
port; returns when a metadata request answers) → :meth:`stop` (SIGTERM, then SIGKILL after a
timeout). A persistent data dir keeps topic history across restarts. In production surge talks to
any Kafka-compatible cluster given by ``SURGE_BROKER`` instead.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import contextlib
import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pipeline.exceptions import BrokerError

_POM = """<project xmlns="http://maven.apache.org/POM/4.0.0"><modelVersion>4.0.0</modelVersion>
<groupId>surge</groupId><artifactId>embedded-kafka</artifactId><version>1</version><packaging>pom</packaging>
<dependencies>
<dependency><groupId>org.apache.kafka</groupId><artifactId>kafka_2.13</artifactId><version>{version}</version></dependency>
<dependency><groupId>org.apache.logging.log4j</groupId><artifactId>log4j-slf4j2-impl</artifactId><version>2.24.3</version></dependency>
<dependency><groupId>org.slf4j</groupId><artifactId>slf4j-api</artifactId><version>2.0.16</version></dependency>
</dependencies></project>
"""

_LOG4J = """status = error
appender.file.type = File
appender.file.name = FILE
appender.file.fileName = {log}
appender.file.layout.type = PatternLayout
appender.file.layout.pattern = [%d] %p %m (%c)%n
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = FILE
logger.kafka.name = kafka
logger.kafka.level = WARN
logger.apache.name = org.apache.kafka
logger.apache.level = WARN
"""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def port_is_free(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
        return True


def _cluster_id() -> str:
    """A random KRaft cluster id. One starting with ``-`` would be read as an option by the storage
    tool's argument parser (a 1-in-32 failure to format), so those are drawn again."""
    while True:
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).decode().rstrip("=")
        if not cid.startswith("-"):
            return cid


@dataclass
class BrokerState:
    pid: int
    port: int
    controller_port: int

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"


class EmbeddedKafka:
    """One Apache Kafka broker+controller process on 127.0.0.1."""

    def __init__(
        self,
        data_dir: str | Path,
        *,
        cache_dir: str | Path | None = None,
        version: str = "4.1.1",
        port: int | None = None,
        heap_mb: int = 512,
        partitions: int = 8,
        host: str = "127.0.0.1",
        advertised_port: int | None = None,
    ) -> None:
        """``advertised_port``: the port clients are told to connect to after the bootstrap, when
        not the broker's own (a :class:`pipeline.devtools.kafka_proxy.KafkaProxy` in front of it)."""
        self.data_dir = Path(data_dir).absolute()
        self.cache_dir = Path(cache_dir or Path.home() / ".cache" / "surge" / "kafka").absolute()
        self.version = version
        self.requested_port = port
        self.heap_mb = heap_mb
        self.partitions = partitions
        self.host = host
        self.advertised_port = advertised_port
        self.process: subprocess.Popen[bytes] | None = None
        self.state: BrokerState | None = None

    # ---- paths ---------------------------------------------------------------------------------
    @property
    def libs_dir(self) -> Path:
        return self.cache_dir / f"kafka-{self.version}" / "libs"

    @property
    def log_path(self) -> Path:
        return self.data_dir / "broker.log"

    @property
    def state_path(self) -> Path:
        return self.data_dir / "surge-broker.json"

    @property
    def ports_path(self) -> Path:
        """Ports of the last start, reused so that a restarted broker keeps its address."""
        return self.data_dir / "ports.json"

    @property
    def bootstrap(self) -> str:
        if self.state is None:
            raise BrokerError("broker is not running")
        return self.state.bootstrap

    # ---- steps ---------------------------------------------------------------------------------
    def resolve(self) -> Path:
        """Fetch the broker's jars with Maven into the cache (first use only); returns the libs dir."""
        marker = self.libs_dir / ".complete"
        if marker.exists():
            return self.libs_dir
        work = self.libs_dir.parent
        work.mkdir(parents=True, exist_ok=True)
        # one resolver at a time: two processes starting brokers on a fresh machine (a demo beside the
        # tests, or test processes side by side) would otherwise clear each other's libs.tmp
        with open(work / ".resolve.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if marker.exists():  # the other resolver finished while this one waited
                return self.libs_dir
            return self._resolve_locked(work, marker)

    def _resolve_locked(self, work: Path, marker: Path) -> Path:
        """:meth:`resolve` under the cache's lock: Maven into ``libs.tmp``, renamed into place."""
        if shutil.which("java") is None:
            raise BrokerError("Java 17+ is needed to run the embedded Kafka broker: no `java` on PATH")
        if shutil.which("mvn") is None:
            raise BrokerError("Maven is needed to fetch the Kafka broker's jars: no `mvn` on PATH")
        (work / "pom.xml").write_text(_POM.format(version=self.version))
        tmp = work / "libs.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        cmd = [
            "mvn",
            "-q",
            "-B",
            "-f",
            str(work / "pom.xml"),
            "dependency:copy-dependencies",
            f"-DoutputDirectory={tmp}",
            "-DincludeScope=runtime",
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        if proc.returncode != 0 or not any(tmp.glob(f"kafka_2.13-{self.version}.jar")):
            raise BrokerError(
                f"Maven could not resolve org.apache.kafka:kafka_2.13:{self.version} "
                f"(exit {proc.returncode}): {(proc.stdout + proc.stderr)[-2000:]}"
            )
        shutil.rmtree(self.libs_dir, ignore_errors=True)
        tmp.rename(self.libs_dir)
        marker.touch()
        return self.libs_dir

    def _java(self, *args: str) -> list[str]:
        return [
            "java",
            f"-Xmx{self.heap_mb}m",
            f"-Xms{min(self.heap_mb, 256)}m",
            "-XX:+UseG1GC",
            "-XX:TieredStopAtLevel=1",
            "-Djava.awt.headless=true",
            f"-Dlog4j2.configurationFile={self.data_dir / 'log4j2.properties'}",
            "-cp",
            f"{self.libs_dir}/*",
            *args,
        ]

    def _write_config(self, port: int, controller_port: int) -> Path:
        logs = self.data_dir / "logs"
        cfg = {
            "process.roles": "broker,controller",
            "node.id": "1",
            "controller.quorum.voters": f"1@{self.host}:{controller_port}",
            "listeners": f"PLAINTEXT://{self.host}:{port},CONTROLLER://{self.host}:{controller_port}",
            "advertised.listeners": f"PLAINTEXT://{self.host}:{self.advertised_port or port}",
            "controller.listener.names": "CONTROLLER",
            "listener.security.protocol.map": "PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT",
            "inter.broker.listener.name": "PLAINTEXT",
            "log.dirs": str(logs),
            "num.partitions": str(self.partitions),
            "auto.create.topics.enable": "true",
            "offsets.topic.replication.factor": "1",
            "offsets.topic.num.partitions": "8",
            "transaction.state.log.replication.factor": "1",
            "transaction.state.log.min.isr": "1",
            "transaction.state.log.num.partitions": "4",
            "share.coordinator.state.topic.replication.factor": "1",
            "share.coordinator.state.topic.min.isr": "1",
            "group.initial.rebalance.delay.ms": "0",
            "log.flush.interval.ms": "1000",
            "num.network.threads": "2",
            "num.io.threads": "4",
            "message.max.bytes": str(8 << 20),
            "replica.fetch.max.bytes": str(8 << 20),
        }
        path = self.data_dir / "server.properties"
        path.write_text("".join(f"{k}={v}\n" for k, v in cfg.items()))
        (self.data_dir / "log4j2.properties").write_text(_LOG4J.format(log=self.log_path))
        return path

    def _ports(self) -> tuple[int, int]:
        saved = None
        if self.ports_path.exists():
            with contextlib.suppress(ValueError, KeyError, OSError):
                saved = json.loads(self.ports_path.read_text())
        if self.requested_port is not None:
            if not port_is_free(self.requested_port, self.host):
                raise BrokerError(f"port {self.requested_port} is taken; choose another with --port")
            port = self.requested_port
        elif saved and port_is_free(saved["port"], self.host):
            port = saved["port"]
        else:
            port = free_port(self.host)
        if saved and saved["controller_port"] != port and port_is_free(saved["controller_port"], self.host):
            cport = saved["controller_port"]
        else:
            cport = free_port(self.host)
            while cport == port:
                cport = free_port(self.host)
        return port, cport

    def format(self, config: Path) -> None:
        """Format the KRaft data dir once; a formatted dir is reused (topic history survives)."""
        if (self.data_dir / "logs" / "meta.properties").exists():
            return
        proc = subprocess.run(
            self._java("kafka.tools.StorageTool", "format", "-t", _cluster_id(), "-c", str(config)),
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        if proc.returncode != 0:
            raise BrokerError(f"formatting {self.data_dir} failed: {(proc.stdout + proc.stderr)[-2000:]}")

    def start(self, timeout_s: float = 90.0) -> BrokerState:
        """Start the broker and wait until it answers a metadata request."""
        self.resolve()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        port, cport = self._ports()
        config = self._write_config(port, cport)
        self.format(config)
        log = open(self.data_dir / "broker.stdout", "ab")
        self.process = subprocess.Popen(
            self._java("kafka.Kafka", str(config)),
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
        log.close()
        self.state = BrokerState(pid=self.process.pid, port=port, controller_port=cport)
        self.state_path.write_text(json.dumps(self.state.__dict__))
        self.ports_path.write_text(json.dumps({"port": port, "controller_port": cport}))
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BrokerError(
                    f"Kafka exited with {self.process.returncode} during start; log {self.log_path}:\n"
                    f"{self._tail()}"
                )
            if _run_sync(metadata_answers(self.state.bootstrap)):
                return self.state
            time.sleep(0.5)
        self.stop()
        raise BrokerError(
            f"Kafka did not answer within {timeout_s:.0f} s; log {self.log_path}:\n{self._tail()}"
        )

    def _tail(self, n: int = 4000) -> str:
        text = ""
        for p in (self.log_path, self.data_dir / "broker.stdout"):
            if p.exists():
                text += p.read_text(errors="replace")[-n:]
        return text

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM, then SIGKILL after ``timeout_s``."""
        pid = self.process.pid if self.process else (self.state.pid if self.state else None)
        if pid is None:
            return
        stop_pid(pid, timeout_s)
        if self.process is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(timeout=5)
        self.process = None
        self.state_path.unlink(missing_ok=True)

    def restart(self, timeout_s: float = 90.0, port_wait_s: float = 30.0) -> BrokerState:
        """Stop the broker and start it again on the same port and data dir (topics, offsets and
        consumer groups survive; clients reconnect to the same address). Used by ``surge bench failover``."""
        if self.state is None:
            raise BrokerError("broker is not running")
        port = self.state.port
        self.stop()
        deadline = time.monotonic() + port_wait_s
        while not port_is_free(port, self.host) and time.monotonic() < deadline:
            time.sleep(0.2)
        requested, self.requested_port = self.requested_port, port
        try:
            return self.start(timeout_s)
        finally:
            self.requested_port = requested

    def __enter__(self) -> EmbeddedKafka:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _run_sync(coro: Coroutine[Any, Any, bool]) -> bool:
    """Run a coroutine to completion, also when called from inside a running event loop."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(coro)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, coro).result()


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_pid(pid: int, timeout_s: float = 30.0) -> None:
    """Terminate a process politely, then forcefully."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, os.WNOHANG)
        if not pid_alive(pid):
            return
        time.sleep(0.2)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def read_state(data_dir: str | Path) -> BrokerState | None:
    """State of a broker started by ``surge kafka start`` in ``data_dir``, if it runs."""
    path = Path(data_dir) / "surge-broker.json"
    if not path.exists():
        return None
    try:
        state = BrokerState(**json.loads(path.read_text()))
    except (ValueError, TypeError):
        return None
    return state if pid_alive(state.pid) else None


async def metadata_answers(bootstrap: str, timeout_s: float = 3.0) -> bool:
    """True when the cluster answers a metadata request with at least one broker."""
    from aiokafka.admin import AIOKafkaAdminClient

    logging.getLogger("aiokafka").setLevel(logging.CRITICAL)
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000))
    try:
        await asyncio.wait_for(admin.start(), timeout_s)
        logging.getLogger("aiokafka").setLevel(logging.WARNING)
        meta = await asyncio.wait_for(admin.describe_cluster(), timeout_s)
        return bool(meta.get("brokers"))
    except Exception:
        return False
    finally:
        with contextlib.suppress(Exception):
            await admin.close()
