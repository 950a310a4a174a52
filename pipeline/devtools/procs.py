"""Processes that surge's own tools start and stop: workers, gateways, baseline servers.

:class:`ManagedProcess` is the one process runner of the demo, the benchmarks and the tests: a
subprocess in its own session, logging to a file, ready once a marker line shows in its log,
stopped with SIGTERM and then SIGKILL. :class:`WorkerProcess` is a ``surge worker``.

How a process is started is a :data:`Launcher`: by default a new interpreter
(:func:`launch_subprocess`); the test suite swaps in one that forks workers from a process that has
already imported torch and transformers (``tests/preloaded.py``), the same code minus ~6 s of imports.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import ClassVar, Protocol

from pipeline.devtools.broker import free_port, stop_pid
from pipeline.exceptions import SurgeError


class ProcessHandle(Protocol):
    """What :class:`ManagedProcess` needs of a started process (``subprocess.Popen`` has it)."""

    @property
    def pid(self) -> int: ...

    @property
    def returncode(self) -> int | None: ...

    def poll(self) -> int | None:
        """The exit code (negative: the signal that ended it), ``None`` while it runs."""
        ...

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the exit; ``subprocess.TimeoutExpired`` when it still runs after ``timeout``."""
        ...

    def send_signal(self, sig: int) -> None: ...


#: starts ``argv`` with exactly ``env`` as its environment, stdin closed, stdout and stderr appended
#: to the log at the path given, in a session (and process group) of its own
Launcher = Callable[[list[str], dict[str, str], Path], ProcessHandle]


def launch_subprocess(argv: list[str], env: dict[str, str], log_path: Path) -> ProcessHandle:
    """The default :data:`Launcher`: a new process running ``argv``."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(
            argv,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )


class ManagedProcess:
    """One subprocess: ``argv`` with ``env`` on top of this process's environment, output to ``log_path``."""

    #: what the process logs once it can serve; :meth:`wait_ready` waits for it
    ready_marker: str = ""
    #: how this class's processes are started (``None``: :func:`launch_subprocess`)
    launcher: ClassVar[Launcher | None] = None

    def __init__(
        self,
        argv: Sequence[str],
        log_path: str | Path,
        env: Mapping[str, str] | None = None,
        *,
        name: str | None = None,
    ) -> None:
        self.argv = list(argv)
        self.log_path = Path(log_path)
        self.env = {**os.environ, **(env or {}), "PYTHONUNBUFFERED": "1"}
        self.name = name or " ".join(self.argv[1:4])
        self.proc: ProcessHandle | None = None
        #: where this start's output begins in the (appended) log: an earlier run's "ready" line in
        #: the same file must never count for this one
        self.log_offset = 0

    def start(self) -> ManagedProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        launch = type(self).launcher or launch_subprocess
        self.proc = launch(self.argv, self.env, self.log_path)
        return self

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def is_ready(self, marker: str) -> bool:
        """Whether the process can serve: ``marker`` shows in its log (override for another probe,
        e.g. an HTTP readiness endpoint)."""
        if not self.log_path.exists():
            return False
        with open(self.log_path, "rb") as f:
            f.seek(self.log_offset)
            return marker.encode() in f.read()

    def wait_ready(self, marker: str | None = None, timeout_s: float = 120.0) -> None:
        """Block until :meth:`is_ready` (by default: ``marker``, else :attr:`ready_marker`, shows in the
        log); :class:`SurgeError` with the log's tail when the process exits first or time runs out."""
        marker = marker or self.ready_marker
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise SurgeError(f"{self.name} exited with {self.proc.returncode}:\n{self.tail()}")
            if self.is_ready(marker):
                return
            time.sleep(0.2)
        raise SurgeError(f"{self.name} not ready after {timeout_s:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 4000) -> str:
        """The last ``n`` characters of the log."""
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL to the whole process group: the crash a worker must survive without losing a request."""
        if self.running:
            assert self.proc is not None
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def terminate(self) -> None:
        """SIGTERM to the process only (a graceful stop: a worker drains, commits and leaves)."""
        if self.running:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGTERM)

    def wait_exit(self, timeout_s: float = 60.0) -> int:
        """Wait for the process to exit; its return code. Raises ``SurgeError`` on timeout."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired as exc:
            raise SurgeError(
                f"{self.name} still running {timeout_s:.0f} s after SIGTERM:\n{self.tail()}"
            ) from exc

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM, then SIGKILL when it has not exited after ``timeout_s``."""
        if self.running:
            assert self.proc is not None
            stop_pid(self.proc.pid, timeout_s)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)


class WorkerProcess(ManagedProcess):
    """One ``surge worker`` subprocess; ``env`` holds its ``SURGE_*`` settings."""

    ready_marker = "surge worker ready"

    def __init__(self, env: Mapping[str, str], log_path: str | Path, role: str = "all") -> None:
        super().__init__(
            [sys.executable, "-m", "pipeline.cli", "worker"],
            log_path,
            {**env, "SURGE_ROLE": role},
            name=f"worker ({role})",
        )
        self.env.setdefault("SURGE_WEB_PORT", str(free_port()))
        self.web_port = int(self.env["SURGE_WEB_PORT"])

    def start(self) -> WorkerProcess:
        super().start()
        return self

    def status(self) -> dict[str, object]:
        """The worker's ``/status`` (queue depths, in flight, unacked records, assignment)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.web_port}/status", timeout=10) as r:
            return dict(json.loads(r.read()))

    def metrics(self) -> str:
        """The worker's ``/metrics`` text."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.web_port}/metrics", timeout=10) as r:
            return r.read().decode()
