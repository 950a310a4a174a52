"""A process is ready only when its own start printed the marker, not an earlier run in the same log."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from pipeline.devtools.procs import ManagedProcess
from pipeline.exceptions import SurgeError


def test_a_ready_line_left_by_an_earlier_run_does_not_count(tmp_path: Path) -> None:
    log = tmp_path / "worker.log"
    log.write_text("surge worker ready: role all, 8 partitions assigned\n")  # the previous `make demo`
    slow = ManagedProcess([sys.executable, "-c", "import time; time.sleep(30)"], log, name="slow")
    slow.start()
    try:
        assert not slow.is_ready("surge worker ready")
        with pytest.raises(SurgeError, match="not ready"):
            slow.wait_ready("surge worker ready", timeout_s=1.0)
    finally:
        slow.kill()
    fast = ManagedProcess(
        [sys.executable, "-c", "print('surge worker ready', flush=True); import time; time.sleep(30)"],
        log,
        name="fast",
    )
    fast.start()
    try:
        fast.wait_ready("surge worker ready", timeout_s=20.0)
    finally:
        fast.kill()
