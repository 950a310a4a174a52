"""Workers for the test suite, forked from a process that has already imported their libraries.

A ``surge worker`` spends ~6 s of a 2-core machine importing sentence-transformers, transformers,
torch and scikit-learn before it reads a setting, and the suite starts about a hundred workers. This
:data:`pipeline.devtools.procs.Launcher` starts each one from a multiprocessing fork server that
imported those libraries once: the child leaves for a session of its own (so a SIGKILL to its process
group kills it, as it does a subprocess), sends its output to the log, takes exactly the environment
it was given, and runs ``python -m MODULE ARGS`` through :mod:`runpy`, the same code a user's
``surge worker`` runs. Only the third-party imports are shared; no surge module is loaded before the
fork. ``SURGE_TEST_PLAIN_WORKERS=1`` starts every worker as a new interpreter instead (and
``tests/test_procs.py`` always does).
"""

from __future__ import annotations

import atexit
import multiprocessing
import os
import runpy
import subprocess
import sys
import time
from multiprocessing.context import ForkServerContext
from multiprocessing.process import BaseProcess
from pathlib import Path

from pipeline.devtools.procs import ProcessHandle, launch_subprocess

#: imported once by the fork server; libraries only, never surge's own modules, which read settings
PRELOAD = [
    "sentence_transformers",
    "transformers",
    "torch",
    "sklearn",
    "faust",
    # faust loads these lazily (its ``__getattr__``): 0.7 s of each worker's start when not preloaded
    "faust.app",
    "faust.agents",
    "faust.tables",
    "faust.stores.rocksdb",
    "faust.transport.drivers.aiokafka",
    "faust.web.drivers.aiohttp",
    "aiokafka",
    "aiokafka.admin",
    "rocksdict",
    "prometheus_client",
    "pydantic_settings",
]

_context: ForkServerContext | None = None


def _fork_server() -> ForkServerContext:
    global _context
    if _context is None:
        ctx = multiprocessing.get_context("forkserver")
        assert isinstance(ctx, ForkServerContext)
        ctx.set_forkserver_preload(PRELOAD)
        _context = ctx
    return _context


def _run_module(module: str, args: list[str], env: dict[str, str], log_path: str) -> None:
    """In the forked child: become the process ``python -m module args`` with ``env`` would be."""
    os.setsid()
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    for stream in (sys.stdout, sys.stderr):
        stream.reconfigure(write_through=True)  # type: ignore[union-attr]
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [module, *args]
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        # multiprocessing ends the child with os._exit: run what the module registered to run at exit
        atexit._run_exitfuncs()


class PreloadedProcess:
    """A :class:`~pipeline.devtools.procs.ProcessHandle` over a fork server's child."""

    def __init__(self, process: BaseProcess, argv: list[str]) -> None:
        self._process = process
        self._argv = argv
        assert process.pid is not None
        self._pid = process.pid

    @property
    def pid(self) -> int:
        return self._pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(self._argv, timeout or 0.0)
        return code

    def send_signal(self, sig: int) -> None:
        os.kill(self._pid, sig)


def launch_preloaded(argv: list[str], env: dict[str, str], log_path: Path) -> ProcessHandle:
    """Start ``python -m MODULE ARGS`` from the fork server; any other command as a subprocess."""
    if os.environ.get("SURGE_TEST_PLAIN_WORKERS") == "1" or argv[:2] != [sys.executable, "-m"]:
        return launch_subprocess(argv, env, log_path)
    module, args = argv[2], argv[3:]
    # the log exists once this returns, as it does for a subprocess (whose log the parent opens)
    with open(log_path, "ab"):
        pass
    process = _fork_server().Process(
        target=_run_module, args=(module, args, env, str(log_path)), name=f"surge:{module}", daemon=True
    )
    process.start()
    handle = PreloadedProcess(process, argv)
    # in a session of its own before anyone may signal its process group
    deadline = time.monotonic() + 30.0
    while handle.poll() is None and time.monotonic() < deadline:
        try:
            if os.getpgid(handle.pid) == handle.pid:
                break
        except ProcessLookupError:
            break
        time.sleep(0.005)
    return handle
