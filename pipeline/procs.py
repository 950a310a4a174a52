"""Start and stop ``surge worker`` processes (demo, benchmarks, tests)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pipeline.broker import free_port, stop_pid
from pipeline.exceptions import SurgeError


class WorkerProcess:
    """One ``surge worker`` subprocess with its own environment."""

    def __init__(self, env: dict[str, str], log_path: str | Path, role: str = "all") -> None:
        self.env = {**os.environ, **env, "SURGE_ROLE": role, "PYTHONUNBUFFERED": "1"}
        self.env.setdefault("SURGE_WEB_PORT", str(free_port()))
        self.web_port = int(self.env["SURGE_WEB_PORT"])
        self.log_path = Path(log_path)
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> WorkerProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pipeline.cli", "worker"], env=self.env, stdout=log,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        log.close()
        return self

    def wait_ready(self, timeout_s: float = 120.0, marker: str = "surge worker ready") -> None:
        """Block until the worker has logged ``marker`` (models loaded, partitions assigned)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise SurgeError(f"worker exited with {self.proc.returncode}:\n{self.tail()}")
            if self.log_path.exists() and marker in self.log_path.read_text(errors="replace"):
                return
            time.sleep(0.3)
        raise SurgeError(f"worker not ready after {timeout_s:.0f} s:\n{self.tail()}")

    def metrics(self) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.web_port}/metrics", timeout=10) as r:
            return r.read().decode()

    def tail(self, n: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-n:] if self.log_path.exists() else ""

    def kill(self) -> None:
        """SIGKILL: the crash a worker must survive without losing a request."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self, timeout_s: float = 30.0) -> None:
        if self.proc is not None and self.proc.poll() is None:
            stop_pid(self.proc.pid, timeout_s)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
