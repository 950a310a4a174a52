"""The OpenAI-compatible gateway: the wire format (no broker), then the official ``openai`` client
against a real gateway, a real ``surge worker`` (echo model) and the real broker.

Two deployments share the module (their workers start in parallel): ``main`` answers at once and
limits the free tier to 0.1 request/s; ``slow`` holds one item per class and takes 500 ms per
batch, to be overloaded. Each runs one gateway subprocess (``python -m pipeline.cli gateway``); the
key and timeout tests run further gateways in-process with :func:`start_gateway`.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipeline.auth import ApiKey
from pipeline.devtools.broker import EmbeddedKafka, free_port
from pipeline.exceptions import InvalidRequestError
from pipeline.gateway import start_gateway
from pipeline.gateway_format import (
    ChatCall,
    build_request,
    error_status,
    retry_after_s,
    split_answer,
    stream_chunks,
)
from pipeline.records import InferenceReply, Timings
from pipeline.settings import Settings
from tests.conftest import Deployment

# ---- the wire format, no broker ------------------------------------------------------------------

SETTINGS = Settings(model="echo", max_content_bytes=1000)
#: a key that may ask for anything
TOP_KEY = ApiKey(key="k-top", tenant="acme", tier="premium", max_priority="realtime")


def build(body: Any, headers: dict[str, str] | None = None, **kw: Any) -> ChatCall:
    raw = body if isinstance(body, bytes) else json.dumps(body).encode()
    args: dict[str, Any] = {
        "settings": SETTINGS,
        "request_id": "rid-1",
        "key": TOP_KEY,
        "reply_to": "surge.replies.gateway-x",
        "created_at_ms": 1_000,
    }
    args.update(kw)
    return build_request(raw, headers or {}, **args)


def test_chat_body_becomes_an_inference_request() -> None:
    call = build(
        {
            "model": "echo",
            "user": "alice",
            "max_completion_tokens": 12,
            "temperature": 0.5,
            "logprobs": True,
            "messages": [
                {"role": "developer", "content": "be brief"},
                {
                    "role": "user",
                    "content": [{"type": "text", "text": "how do I"}, {"type": "text", "text": "pay"}],
                },
            ],
            "tier": "free",
            "stream": True,
            "stream_options": {"include_usage": True},
        },
        {"X-Surge-Priority": "realtime", "X-Surge-Deadline-Ms": "150"},
    )
    r = call.request
    assert r["user_id"] == "acme/alice" and r["tenant"] == "acme" and r["request_id"] == "rid-1"
    assert r["priority"] == "realtime" and r["tier"] == "free" and r["deadline_ms"] == 150
    assert r["max_tokens"] == 12 and r["temperature"] == 0.5 and r["logprobs"] is True
    assert r["messages"] == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "how do I\npay"},
    ]
    assert r["reply_to"] == "surge.replies.gateway-x" and r["created_at"] == 1_000
    assert call.stream and call.include_usage and call.prompt_tokens == 6


def test_user_falls_back_to_the_key_then_anonymous_and_headers_override_body() -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "priority": "batch", "tier": "premium"}
    assert build(body).request["user_id"] == f"acme/{TOP_KEY.key_user}"
    assert TOP_KEY.key_user.startswith("key-") and "k-top" not in TOP_KEY.key_user
    anonymous = ApiKey(key="", tenant="default")
    r = build({**body, "tier": "free"}, {"X-Surge-Priority": "offline"}, key=anonymous).request
    assert r["user_id"] == "default/anonymous" and r["priority"] == "offline"
    r = build(body, {"X-Surge-Priority": "offline"}).request
    assert r["priority"] == "offline" and r["tier"] == "premium"
    assert r["model"] == "echo", "the configured model when none is asked"


@pytest.mark.parametrize(
    ("body", "headers", "needle"),
    [
        (b"{not json", {}, "not valid JSON"),
        (b"", {}, "body is empty"),
        ([1, 2], {}, "must be a JSON object"),
        ({"model": "echo"}, {}, "messages is required"),
        ({"messages": []}, {}, "messages is required"),
        ({"messages": [{"role": "robot", "content": "x"}]}, {}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, {}, "only text parts"),
        (
            {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
            {},
            "max_tokens must be 1-4096, got 0",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "max_tokens": 5000}, {}, "got 5000"),
        (
            {"messages": [{"role": "user", "content": "x"}], "temperature": 3},
            {},
            "temperature must be a number 0-2",
        ),
        ({"messages": [{"role": "user", "content": "x"}], "n": 2}, {}, "n must be 1"),
        (
            {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
            {},
            "tools is not",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}]},
            {"X-Surge-Priority": "urgent"},
            "X-Surge-Priority",
        ),
        (
            {"messages": [{"role": "user", "content": "x"}]},
            {"X-Surge-Deadline-Ms": "-5"},
            "X-Surge-Deadline-Ms",
        ),
        ({"messages": [{"role": "user", "content": "x" * 1001}]}, {}, "the limit is 1000 bytes"),
    ],
)
def test_bad_bodies_are_refused_with_a_message_naming_the_field(
    body: Any, headers: dict, needle: str
) -> None:
    with pytest.raises(InvalidRequestError) as info:
        build(body, headers)
    assert needle in info.value.message


@given(st.text(alphabet=st.sampled_from(["a", "b", " ", "\n", "é", "字"]), max_size=300))
def test_streamed_pieces_join_back_to_the_answer(answer: str) -> None:
    pieces = split_answer(answer)
    assert "".join(pieces) == answer
    assert len(pieces) <= 16
    assert all(p for p in pieces)


def test_stream_chunks_are_role_content_finish_usage() -> None:
    call = build(
        {
            "messages": [{"role": "user", "content": "a b c"}],
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    reply = InferenceReply(
        request_id="rid-1",
        user_id="u",
        status="ok",
        answer="one two three",
        finish_reason="template",
        served_from="template",
        degradation_level=3,
        timings=Timings(total_ms=5),
    )
    chunks = list(stream_chunks(call, reply, 1.0))
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks[1:-1])
    assert text == "one two three"
    assert chunks[-2]["choices"][0]["finish_reason"] == "content_filter", "a template is not a model's stop"
    surge = chunks[-2]["surge"]
    assert (
        surge["served_from"] == "template" and surge["template"] is True and surge["degradation_level"] == 3
    )
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert {c["id"] for c in chunks} == {"chatcmpl-rid-1"}


def test_error_codes_map_to_http_statuses() -> None:
    assert [
        error_status(c) for c in ("invalid_request", "rate_limited", "overloaded", "deadline_exceeded")
    ] == [
        400,
        429,
        503,
        504,
    ]
    assert error_status("model_error") == error_status("internal") == error_status("whatever") == 500
    assert (retry_after_s(1), retry_after_s(1000), retry_after_s(9_001), retry_after_s(None)) == (
        1,
        1,
        10,
        None,
    )


# ---- real broker, real worker, real gateway --------------------------------------------------------


class GatewayProcess:
    """``python -m pipeline.cli gateway --port N`` with a deployment's SURGE_* environment."""

    def __init__(self, env: dict[str, str], log_path: Path) -> None:
        self.port = free_port()
        self.log_path = log_path
        with open(log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "pipeline.cli", "gateway", "--port", str(self.port)],
                env={**os.environ, **env, "PYTHONUNBUFFERED": "1"},
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"gateway exited {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}"
                )
            if http_get(self.url + "/readyz")[0] == 200:
                return
            time.sleep(0.2)
        raise RuntimeError(f"gateway not ready:\n{self.log_path.read_text()[-3000:]}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        return self.proc.returncode


def http_get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()
    except OSError:
        return 0, ""


def http_post(
    url: str, body: bytes, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    req = urllib.request.Request(
        url, data=body, headers={"Content-Type": "application/json", **(headers or {})}
    )
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


class Stack:
    def __init__(
        self, main: Deployment, slow: Deployment, gw_main: GatewayProcess, gw_slow: GatewayProcess
    ) -> None:
        self.main, self.slow, self.gw_main, self.gw_slow = main, slow, gw_main, gw_slow

    def client(self, gw: GatewayProcess | None = None, **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(
            base_url=f"{(gw or self.gw_main).url}/v1", api_key="unused", max_retries=0, timeout=30, **kw
        )


@pytest.fixture(scope="module")
def stack(kafka: EmbeddedKafka, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("gateway")
    main = Deployment(
        kafka,
        tmp / "main",
        degrade_enabled="false",
        dedup_enabled="false",
        user_rate_per_s_free="0.1",
        user_burst_free="1",
        deadline_interactive_ms="30000",
        deadline_batch_ms="30000",
    )
    slow = Deployment(
        kafka,
        tmp / "slow",
        degrade_enabled="false",
        cache_enabled="false",
        rate_limit_enabled="false",
        queue_limit_per_class="1",
        echo_delay_ms="500",
        deadline_interactive_ms="30000",
        deadline_batch_ms="30000",
    )
    gws: list[GatewayProcess] = []
    try:
        for d in (main, slow):
            d.worker(wait=False)
        for d in (main, slow):
            d.workers[0].wait_ready()
        for d in (main, slow):  # after the workers: their startup creates the changelog topics
            gws.append(GatewayProcess(d.env, tmp / f"gateway-{len(gws)}.log"))
        for gw in gws:
            gw.wait_ready()
        yield Stack(main, slow, gws[0], gws[1])
        for gw in gws:
            assert gw.stop() == 0, f"gateway did not stop cleanly:\n{gw.log_path.read_text()[-2000:]}"
    finally:
        for gw in gws:
            gw.stop()
        for d in (main, slow):
            d.stop_workers()  # SIGKILL: tests/conftest.py


@pytest.mark.integration
def test_openai_client_gets_the_answer_usage_and_surge_extension(stack: Stack) -> None:
    client = stack.client()
    prompt = "what is the fee for a transfer abroad"
    resp = client.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": prompt}], user="gw-answer"
    )
    assert resp.id.startswith("chatcmpl-") and resp.object == "chat.completion"
    assert resp.choices[0].message.content == prompt and resp.choices[0].message.role == "assistant"
    assert resp.choices[0].finish_reason == "stop"
    assert resp.usage is not None and (resp.usage.prompt_tokens, resp.usage.completion_tokens) == (8, 8)
    surge = resp.model_extra["surge"]  # type: ignore[index]
    assert surge["served_from"] == "model" and surge["model_version"] == "echo-1"
    assert resp.id == f"chatcmpl-{surge['request_id']}"
    assert surge["timings"]["total_ms"] is not None and surge["timings"]["gateway_ms"] > 0

    again = client.chat.completions.create(
        model="echo", messages=[{"role": "user", "content": prompt}], user="gw-answer"
    )
    assert again.choices[0].message.content == prompt and again.id != resp.id, "a fresh id per request"
    assert again.model_extra["surge"]["served_from"] == "cache"  # type: ignore[index]

    cut = client.chat.completions.create(
        model="echo",
        messages=[{"role": "user", "content": "one two three four five"}],
        max_tokens=2,
        user="gw-answer",
        extra_headers={"X-Surge-Priority": "batch"},
    )
    assert cut.choices[0].message.content == "one two" and cut.choices[0].finish_reason == "length"
    assert cut.model_extra["surge"]["priority"] == "batch"  # type: ignore[index]


@pytest.mark.integration
def test_streaming_sends_role_content_finish_and_done(stack: Stack) -> None:
    prompt = "please list every step needed to order a replacement debit card by post"
    stream = stack.client().chat.completions.create(
        model="echo",
        messages=[{"role": "user", "content": prompt}],
        user="gw-stream",
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == prompt
    assert sum(1 for c in chunks if c.choices and c.choices[0].delta.content) > 1, "split into several chunks"
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["stop"]
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(prompt.split())

    body = json.dumps(
        {"model": "echo", "stream": True, "messages": [{"role": "user", "content": "raw sse check"}]}
    )
    status, headers, raw = http_post(stack.gw_main.url + "/v1/chat/completions", body.encode())
    assert status == 200 and headers["Content-Type"].startswith("text/event-stream")
    events = [e for e in raw.decode().split("\n\n") if e]
    assert all(e.startswith("data: ") for e in events) and events[-1] == "data: [DONE]"


@pytest.mark.integration
def test_models_health_ready_and_metrics(stack: Stack) -> None:
    assert [m.id for m in stack.client().models.list()] == ["echo"]
    assert http_get(stack.gw_main.url + "/healthz")[0] == 200
    status, body = http_get(stack.gw_main.url + "/readyz")
    assert status == 200 and f"{stack.main.topics.replies}.gateway-" in json.loads(body)["reply_topic"]
    stack.client().chat.completions.create(model="echo", messages=[{"role": "user", "content": "count me"}])
    status, text = http_get(stack.gw_main.url + "/metrics")
    assert status == 200
    ok = [ln for ln in text.splitlines() if ln.startswith("surge_requests_total{") and 'status="ok"' in ln]
    assert ok and sum(float(ln.rsplit(" ", 1)[1]) for ln in ok) >= 1
    count = [ln for ln in text.splitlines() if ln.startswith("surge_request_latency_seconds_count")]
    assert count and sum(float(ln.rsplit(" ", 1)[1]) for ln in count) >= 1
    assert 'surge_gateway_responses_total{status="200"}' in text


@pytest.mark.integration
def test_400_for_bad_bodies_before_anything_is_produced(stack: Stack) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        stack.client().chat.completions.create(model="echo", messages=[], user="gw-bad")
    assert info.value.status_code == 400 and "messages is required" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        stack.client().chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "x"}], max_tokens=100_000
        )
    assert "max_tokens must be 1-4096" in info.value.message
    status, _, raw = http_post(stack.gw_main.url + "/v1/chat/completions", b"{this is not json")
    err = json.loads(raw)["error"]
    assert status == 400 and err["code"] == "invalid_request" and err["type"] == "invalid_request_error"
    assert "not valid JSON" in err["message"]
    _, text = http_get(stack.gw_main.url + "/metrics")
    assert 'surge_requests_total{priority="none",served_from="none",status="error"}' in text


@pytest.mark.integration
def test_429_with_retry_after_when_the_user_bucket_is_empty(stack: Stack) -> None:
    client = stack.client()
    ask = {"model": "echo", "user": "gw-free-user", "extra_body": {"tier": "free"}}
    first = client.chat.completions.create(
        messages=[{"role": "user", "content": "first free question"}], **ask
    )
    assert first.choices[0].message.content == "first free question"
    with pytest.raises(openai.RateLimitError) as info:
        client.chat.completions.create(messages=[{"role": "user", "content": "second free question"}], **ask)
    assert info.value.status_code == 429 and info.value.code == "rate_limited"
    assert 1 <= int(info.value.response.headers["Retry-After"]) <= 10, "0.1 request/s: about 10 s"
    assert "0.1 requests/s" in info.value.message


@pytest.mark.integration
def test_504_when_the_deadline_passes_before_inference(stack: Stack) -> None:
    with pytest.raises(openai.APIStatusError) as info:
        stack.client().chat.completions.create(
            model="echo",
            messages=[{"role": "user", "content": "an impatient question"}],
            user="gw-late",
            extra_headers={"X-Surge-Deadline-Ms": "1"},
        )
    assert info.value.status_code == 504 and info.value.code == "deadline_exceeded"
    assert "missed its deadline of 1 ms" in info.value.message


@pytest.mark.integration
async def test_a_burst_beyond_the_queue_waits_in_kafka_and_is_answered(stack: Stack) -> None:
    """The slow worker queues one item per class and takes 500 ms a call: a burst of eight through the
    gateway is not shed (admission counts the item being embedded too), it waits in Kafka and every
    request gets its answer. Shedding at the gateway's own bound, and ``overloaded`` as HTTP 503, are
    tested below and in ``test_error_codes_map_to_http_statuses``."""
    client = openai.AsyncOpenAI(base_url=f"{stack.gw_slow.url}/v1", api_key="x", max_retries=0, timeout=30)

    async def ask(i: int) -> str:
        resp = await client.chat.completions.create(
            model="echo",
            messages=[{"role": "user", "content": f"distinct question {i} about cards"}],
            user=f"gw-burst-{i}",
        )
        return resp.choices[0].message.content or ""

    try:
        answers = await asyncio.gather(*(ask(i) for i in range(8)))
    finally:
        await client.close()
    assert [f"distinct question {i} about cards" in a for i, a in enumerate(answers)] == [True] * 8, answers


@pytest.mark.integration
async def test_in_process_gateway_checks_keys_and_times_out(stack: Stack) -> None:
    # keys at the gateway in front of workers that take records as written (they have none): the
    # gateway must not wait for signed replies (``open``), which those workers never give
    settings = stack.main.settings.model_copy(
        update={"api_keys": "k-good:acme,k-other:beta", "kafka_request_auth": "open"}
    )
    gw = await start_gateway(settings, host="127.0.0.1", port=0)
    try:
        url = f"{gw.url}/v1"
        bad = openai.AsyncOpenAI(base_url=url, api_key="k-wrong", max_retries=0, timeout=30)
        with pytest.raises(openai.AuthenticationError) as info:
            await bad.chat.completions.create(
                model="echo", messages=[{"role": "user", "content": "let me in"}]
            )
        assert info.value.status_code == 401 and "invalid API key" in info.value.message
        with pytest.raises(openai.AuthenticationError):
            await bad.models.list()
        async with aiohttp.ClientSession() as http, http.post(url + "/chat/completions", data=b"{}") as r:
            status, err = r.status, (await r.json())["error"]
        assert status == 401 and err["type"] == "authentication_error" and "missing API key" in err["message"]
        good = openai.AsyncOpenAI(base_url=url, api_key="k-good", max_retries=0, timeout=30)
        resp = await good.chat.completions.create(
            model="echo", messages=[{"role": "user", "content": "keyed hello"}]
        )
        assert resp.choices[0].message.content == "keyed hello"
        await bad.close()
        await good.close()
    finally:
        await gw.stop()

    # a gateway that waits 200 ms for a model that takes 500 ms answers 504 itself
    impatient = stack.slow.settings.model_copy(update={"gateway_timeout_ms": 200})
    gw = await start_gateway(impatient, host="127.0.0.1", port=0)
    try:
        client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0, timeout=30)
        with pytest.raises(openai.APIStatusError) as err:
            await client.chat.completions.create(
                model="echo", messages=[{"role": "user", "content": "slow one"}]
            )
        assert err.value.status_code == 504 and "gateway_timeout_ms=200" in err.value.message
        await client.close()
    finally:
        await gw.stop()


@pytest.mark.integration
async def test_in_process_gateway_sheds_beyond_its_in_flight_bound(stack: Stack) -> None:
    gw = await start_gateway(stack.slow.settings, host="127.0.0.1", port=0, max_in_flight=1)
    client = openai.AsyncOpenAI(base_url=f"{gw.url}/v1", api_key="x", max_retries=0, timeout=30)

    async def ask(i: int) -> tuple[int, str]:
        await asyncio.sleep(0.05 * i)  # the first is in flight (500 ms of model time) when the rest arrive
        try:
            await client.chat.completions.create(
                model="echo",
                messages=[{"role": "user", "content": f"bounded question {i}"}],
                user=f"gw-bound-{i}",
            )
            return 200, ""
        except openai.APIStatusError as exc:
            return exc.status_code, exc.message

    try:
        results = await asyncio.gather(*(ask(i) for i in range(3)))
    finally:
        await client.close()
        await gw.stop()
    assert results[0] == (200, "")
    assert [status for status, _ in results[1:]] == [503, 503]
    assert all("1 requests in flight; the limit is 1" in msg for _, msg in results[1:])
