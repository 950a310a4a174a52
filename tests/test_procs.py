"""The one process runner and deployment builder of the demo, the benchmarks and the tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipeline.devtools.deployment import Deployment, deployment_env, env_name, load_settings
from pipeline.devtools.procs import ManagedProcess, WorkerProcess
from pipeline.exceptions import SurgeError
from tests.preloaded import launch_preloaded


def _python(code: str, log: Path) -> ManagedProcess:
    return ManagedProcess([sys.executable, "-c", code], log, name="probe")


def test_managed_process_waits_for_its_marker_and_stops(tmp_path: Path) -> None:
    p = _python("import time; print('probe ready', flush=True); time.sleep(60)", tmp_path / "p.log").start()
    try:
        p.wait_ready("probe ready", timeout_s=30)
        assert p.running
    finally:
        p.stop(timeout_s=5)
    assert not p.running
    assert "probe ready" in p.tail()


def test_managed_process_that_exits_early_says_why(tmp_path: Path) -> None:
    p = _python("import sys; print('no config'); sys.exit(3)", tmp_path / "p.log").start()
    with pytest.raises(SurgeError, match=r"probe exited with 3:\n.*no config"):
        p.wait_ready("never", timeout_s=30)


def test_managed_process_kill_ends_it_at_once(tmp_path: Path) -> None:
    p = _python("import time; print('up', flush=True); time.sleep(60)", tmp_path / "p.log").start()
    p.wait_ready("up", timeout_s=30)
    p.kill()
    assert not p.running and p.proc is not None and p.proc.returncode == -9


def test_worker_process_environment(tmp_path: Path) -> None:
    w = WorkerProcess({"SURGE_MODEL": "echo"}, tmp_path / "w.log", role="intake")
    assert w.env["SURGE_ROLE"] == "intake" and w.env["SURGE_MODEL"] == "echo"
    assert w.env["PYTHONUNBUFFERED"] == "1" and w.web_port == int(w.env["SURGE_WEB_PORT"]) > 0
    assert w.ready_marker == "surge worker ready"


def test_deployment_env_layers_defaults_identity_and_overrides(tmp_path: Path) -> None:
    env = deployment_env(
        "127.0.0.1:9092",
        prefix="t1.",
        app_id="app-1",
        data_dir=tmp_path / "data",
        defaults={"SURGE_MODEL": "echo", "partitions": 4, "SURGE_APP_ID": "never"},
        max_wait_ms=2.5,
        dedup_enabled=False,
        OMP_NUM_THREADS=1,
    )
    assert env == {
        "SURGE_MODEL": "echo",
        "SURGE_PARTITIONS": "4",
        "SURGE_BROKER": "kafka://127.0.0.1:9092",
        "SURGE_TOPIC_PREFIX": "t1.",
        "SURGE_APP_ID": "app-1",
        "SURGE_DATA_DIR": str(tmp_path / "data"),
        "SURGE_MAX_WAIT_MS": "2.5",
        "SURGE_DEDUP_ENABLED": "false",
        "OMP_NUM_THREADS": "1",
    }
    assert env_name("max_batch_size") == "SURGE_MAX_BATCH_SIZE" and env_name("SURGE_X") == "SURGE_X"
    s = load_settings(env)
    assert (s.topic_prefix, s.app_id, s.max_wait_ms, s.dedup_enabled) == ("t1.", "app-1", 2.5, False)
    d = Deployment("arm", env, "127.0.0.1:9092", tmp_path)
    assert d.topics.requests == "t1.requests" and d.settings() == s


def test_managed_processes_start_as_new_interpreters_by_default() -> None:
    assert ManagedProcess.launcher is None, "the demo and the benchmarks start real subprocesses"


@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGTERM"])
def test_a_preloaded_child_behaves_like_a_subprocess(tmp_path: Path, signal_name: str) -> None:
    """The fork server's child: its own session, its own environment, its output in the log, and the
    exit code a subprocess would report (SIGTERM handled by the module, SIGKILL to the group)."""
    module = tmp_path / "probe_mod.py"
    module.write_text(
        "import os, signal, sys, time\n"
        "signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))\n"
        "print('probe', sys.argv[1:], os.environ.get('PROBE'), os.environ.get('HOME'), os.getsid(0) == os.getpid())\n"
        "time.sleep(60)\n"
    )
    sys.path.insert(0, str(tmp_path))
    try:
        handle = launch_preloaded(
            [sys.executable, "-m", "probe_mod", "a", "b"],
            {"PROBE": "yes", "PYTHONPATH": str(tmp_path)},
            tmp_path / "p.log",
        )
        deadline = time.monotonic() + 60
        while "probe" not in (tmp_path / "p.log").read_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (tmp_path / "p.log").read_text().strip() == "probe ['a', 'b'] yes None True"
        assert handle.poll() is None and os.getpgid(handle.pid) == handle.pid
        with pytest.raises(subprocess.TimeoutExpired):
            handle.wait(0.1)
        if signal_name == "SIGKILL":
            os.killpg(handle.pid, signal.SIGKILL)
            assert handle.wait(10) == -9
        else:
            handle.send_signal(signal.SIGTERM)
            assert handle.wait(10) == 7 and handle.returncode == 7
    finally:
        sys.path.remove(str(tmp_path))
