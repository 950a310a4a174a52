"""RemoteOpenAIModel against a real OpenAI-compatible HTTP server process on the tiny local model.

``transformers serve`` needs FastAPI and Uvicorn, which are not installed here, so the server is
``tests/openai_stub_server.py`` (aiohttp over HFCausalLM), started as a subprocess on a free port.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from models.base import ModelOutput
from models.exceptions import ModelError, ModelLoadError, PartialBatchError, TransientModelError
from models.hf_causal import HFCausalLM
from models.remote import RemoteOpenAIModel, RemoteStatusError, RemoteTransientError
from tests.model_helpers import ask, one_torch_thread  # noqa: F401 - an autouse fixture

ROOT = Path(__file__).resolve().parents[1]
STUB = ROOT / "tests" / "openai_stub_server.py"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Empty here; the server writes the tiny model into it (build_tiny_causal_lm) before it says READY."""
    return tmp_path_factory.mktemp("tiny-lm")


@pytest.fixture(scope="module")
def server(tiny_dir: Path) -> Iterator[str]:
    """Start the stub server on the tiny model; yield its ``/v1`` base URL; stop it."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.Popen(
        [
            sys.executable,
            str(STUB),
            "--model-dir",
            str(tiny_dir),
            "--model-name",
            "tiny",
            "--port",
            "0",
            "--build-tiny",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        assert proc.stdout is not None
        import transformers.modeling_utils  # noqa: F401 - heavy import, overlapped with the server's start

        line = proc.stdout.readline()  # blocks until READY, or "" if the server died
        if not line.startswith("READY "):
            pytest.fail(f"stub server did not start (exit code {proc.poll()}, said {line!r})")
        yield f"http://127.0.0.1:{int(line.split()[1])}/v1"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def stats(base_url: str, reset: bool = False) -> dict[str, int]:
    root = base_url.removesuffix("/v1")
    req = urllib.request.Request(f"{root}/stats/reset", method="POST") if reset else f"{root}/stats"
    with urllib.request.urlopen(req, timeout=5) as resp:
        return json.loads(resp.read())


def remote(base_url: str, **kw: object) -> RemoteOpenAIModel:
    model = RemoteOpenAIModel(base_url, "tiny", **kw)  # type: ignore[arg-type]
    model.load()
    return model


def test_answers_match_the_same_model_run_locally(server: str, tiny_dir: Path) -> None:
    batch = [
        ask("hello, is my card active", max_tokens=5, logprobs=True),
        ask("I want to send money abroad", max_tokens=2),
        ask("fees?", max_tokens=7, logprobs=True),
    ]
    model = remote(server)
    try:
        outs = model.infer(batch)
    finally:
        model.close()
    local = HFCausalLM(tiny_dir)
    local.load()
    expected = [local.infer([inp])[0] for inp in batch]
    assert [o.answer for o in outs] == [e.answer for e in expected]
    assert [o.finish_reason for o in outs] == [e.finish_reason for e in expected]
    for out, inp in zip(outs, batch, strict=True):
        if inp.logprobs:
            assert out.logprobs is not None and len(out.logprobs) == out.extra["usage"]["completion_tokens"]  # type: ignore[index]
            assert all(lp <= 0.0 for lp in out.logprobs)
        else:
            assert out.logprobs is None
    assert model.version.startswith("tiny@127.0.0.1:")


def test_concurrency_is_bounded(server: str) -> None:
    stats(server, reset=True)
    model = remote(server, max_concurrency=3)
    try:
        started = time.perf_counter()
        outs = model.infer([ask(f"[[sleep_ms=250]] question {i}", max_tokens=1) for i in range(9)])
        elapsed = time.perf_counter() - started
    finally:
        model.close()
    assert len(outs) == 9
    seen = stats(server)
    assert seen["requests"] == 9
    assert seen["max_in_flight"] == 3
    assert elapsed >= 3 * 0.25  # nine requests, three at a time


def test_timeout_is_transient(server: str) -> None:
    model = remote(server, timeout_s=0.3, max_retries=0)
    try:
        started = time.perf_counter()
        with pytest.raises(TransientModelError, match=r"within 0.3 s") as info:
            model.infer([ask("[[sleep_ms=3000]] slow one", max_tokens=1)])
        assert time.perf_counter() - started < 2.0
        assert isinstance(info.value, RemoteTransientError) and info.value.timeout_s == 0.3
    finally:
        model.close()


def test_5xx_is_transient_and_retried(server: str) -> None:
    stats(server, reset=True)
    model = remote(server, max_retries=2, backoff_initial_s=0.01, backoff_max_s=0.05)
    try:
        with pytest.raises(RemoteTransientError) as info:
            model.infer([ask("[[status=503]] busy", max_tokens=1)])
    finally:
        model.close()
    assert info.value.status_code == 503
    assert stats(server)["requests"] == 3  # first try and two retries


def test_a_request_that_fails_alone_leaves_its_batch_mates_their_answers(server: str) -> None:
    """Each request of a batch is a call of its own: the one the endpoint refuses with 503 (after
    its retries) gets the error, the two beside it their answers. The first failure once failed the
    whole batch, so one prompt that timed out failed every other tenant's request beside it."""
    model = remote(server, max_retries=1, backoff_initial_s=0.01, backoff_max_s=0.05)
    try:
        with pytest.raises(PartialBatchError) as info:
            model.infer(
                [
                    ask("hello", max_tokens=2),
                    ask("[[status=503]] busy", max_tokens=1),
                    ask("hi", max_tokens=2),
                ]
            )
        results = info.value.results
        assert info.value.failed == 1 and len(results) == 3
        assert isinstance(results[1], RemoteTransientError) and results[1].status_code == 503
        assert all(isinstance(r, ModelOutput) and r.answer for r in (results[0], results[2]))
        # every request failing: the batch raises the error itself, for the caller's batch retries
        with pytest.raises(RemoteTransientError):
            model.infer([ask("[[status=503]] a", max_tokens=1), ask("[[status=503]] b", max_tokens=1)])
    finally:
        model.close()


def test_429_is_transient_and_carries_retry_after(server: str) -> None:
    model = remote(server, max_retries=0)
    try:
        with pytest.raises(RemoteTransientError) as info:
            model.infer([ask("[[status=429]] too many", max_tokens=1)])
    finally:
        model.close()
    assert info.value.status_code == 429
    assert info.value.retry_after_ms == 2000


def test_4xx_is_a_permanent_model_error_not_retried(server: str) -> None:
    stats(server, reset=True)
    model = remote(server, max_retries=3)
    try:
        with pytest.raises(PartialBatchError) as info:
            model.infer([ask("fine", max_tokens=1), ask("[[status=400]] broken", max_tokens=1)])
    finally:
        model.close()
    failed = info.value.results[1]
    assert isinstance(info.value.results[0], ModelOutput) and not isinstance(failed, TransientModelError)
    assert isinstance(failed, RemoteStatusError) and failed.status_code == 400
    assert "item 1 of a batch of 2" in str(failed)
    assert stats(server)["requests"] <= 2  # no retry of the 400


def test_unknown_model_is_refused_at_load_and_at_infer(server: str) -> None:
    with pytest.raises(ModelLoadError, match="does not serve model 'other'"):
        RemoteOpenAIModel(server, "other").load()
    model = RemoteOpenAIModel(server, "other", verify_model_on_load=False)
    model.load()
    try:
        with pytest.raises(RemoteStatusError) as info:
            model.infer([ask("hi", max_tokens=1)])
    finally:
        model.close()
    assert info.value.status_code == 404


def test_unreachable_endpoint() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # closed again below: nothing listens there
    url = f"http://127.0.0.1:{port}/v1"
    with pytest.raises(ModelLoadError, match="cannot list models"):
        RemoteOpenAIModel(url, "tiny", timeout_s=2.0).load()
    model = RemoteOpenAIModel(url, "tiny", timeout_s=2.0, max_retries=0, verify_model_on_load=False)
    model.load()
    try:
        with pytest.raises(TransientModelError, match="cannot reach"):
            model.infer([ask("hi", max_tokens=1)])
    finally:
        model.close()


def test_infer_before_load_is_a_model_error(server: str) -> None:
    with pytest.raises(ModelError, match="not loaded"):
        RemoteOpenAIModel(server, "tiny").infer([ask("hi")])
