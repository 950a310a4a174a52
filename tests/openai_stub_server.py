"""A minimal OpenAI-compatible chat server over a local HF causal LM folder. TEST CODE ONLY.

``transformers serve`` needs FastAPI and Uvicorn, which this environment lacks, so the remote
backend's tests start this aiohttp server as a subprocess instead: a real HTTP server answering
``GET /v1/models`` and ``POST /v1/chat/completions`` (OpenAI response shape, logprobs included)
from :class:`models.hf_causal.HFCausalLM`.

Test hooks, read from the message contents (a real endpoint has none):

* ``[[sleep_ms=N]]``: wait N ms before answering (timeouts, concurrency);
* ``[[status=N]]``: answer HTTP N with an OpenAI-style error body (429 carries ``Retry-After: 2``).

``GET /stats`` returns ``{"requests", "in_flight", "max_in_flight"}``; ``POST /stats/reset`` zeroes them.
``GET /seen`` returns the messages of the last 200 chat requests, oldest first.

``--answer TEXT`` answers every chat with TEXT after ``--answer-delay-ms`` instead of running the model
(the stand-in for an LLM that judges: tests/test_risk_escalation_integration.py); no model is loaded.

Run: ``python tests/openai_stub_server.py --model-dir DIR [--model-name NAME] [--port 0] [--build-tiny]``
(``--build-tiny`` first writes :func:`models.tiny.build_tiny_causal_lm`'s model to DIR); it prints
``READY <port>`` on stdout once it listens.
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from aiohttp import web

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from models.base import ChatMessage, ModelInput
from models.exceptions import ModelError
from models.hf_causal import HFCausalLM
from models.tiny import build_tiny_causal_lm

_SLEEP = re.compile(r"\[\[sleep_ms=(\d+)\]\]")
_STATUS = re.compile(r"\[\[status=(\d{3})\]\]")
MAX_TOKENS_LIMIT = 1024


def _error(status: int, message: str, err_type: str = "invalid_request_error") -> web.Response:
    headers = {"Retry-After": "2"} if status == 429 else None
    body = {"error": {"message": message, "type": err_type, "param": None, "code": None}}
    return web.json_response(body, status=status, headers=headers)


class StubServer:
    """State of one stub server: the model and the request counters."""

    def __init__(
        self, model: HFCausalLM | None, model_name: str, answer: str | None = None, answer_delay_ms: int = 0
    ) -> None:
        self.model = model
        self.model_name = model_name
        self.answer = answer
        self.answer_delay_ms = answer_delay_ms
        #: the messages of the last chat requests
        self.seen: list[list[dict[str, str]]] = []
        self.requests = 0
        self.in_flight = 0
        self.max_in_flight = 0

    async def models(self, _request: web.Request) -> web.Response:
        data = [{"id": self.model_name, "object": "model", "created": 0, "owned_by": "surge-tests"}]
        return web.json_response({"object": "list", "data": data})

    async def stats(self, _request: web.Request) -> web.Response:
        return web.json_response(
            {"requests": self.requests, "in_flight": self.in_flight, "max_in_flight": self.max_in_flight}
        )

    async def seen_messages(self, _request: web.Request) -> web.Response:
        return web.json_response(self.seen)

    async def reset(self, _request: web.Request) -> web.Response:
        self.requests = 0
        self.max_in_flight = self.in_flight
        return web.json_response({"ok": True})

    async def chat(self, request: web.Request) -> web.Response:
        self.requests += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            return await self._chat(request)
        finally:
            self.in_flight -= 1

    async def _chat(self, request: web.Request) -> web.Response:
        try:
            body: Any = await request.json()
        except ValueError:
            return _error(400, "request body is not valid JSON")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object")
        if body.get("model") != self.model_name:
            return _error(
                404, f"model {body.get('model')!r} not found; served: {self.model_name!r}", "not_found"
            )
        raw = body.get("messages")
        if not isinstance(raw, list) or not raw:
            return _error(400, "messages must be a non-empty list")
        try:
            messages = tuple(ChatMessage(str(m["role"]), str(m["content"])) for m in raw)
        except (TypeError, KeyError):
            return _error(400, "each message needs a role and a content")
        max_tokens = body.get("max_tokens", 16)
        if not isinstance(max_tokens, int) or not 1 <= max_tokens <= MAX_TOKENS_LIMIT:
            return _error(400, f"max_tokens must be an integer in 1..{MAX_TOKENS_LIMIT}, got {max_tokens!r}")
        temperature = float(body.get("temperature", 1.0))
        self.seen = [*self.seen[-199:], [{"role": m.role, "content": m.content} for m in messages]]
        if self.answer is not None:
            await asyncio.sleep(self.answer_delay_ms / 1000.0)
            return web.json_response(_completion(self.model_name, self.answer, "stop", None, 0, 0))
        assert self.model is not None
        text = " ".join(m.content for m in messages)
        if (m := _SLEEP.search(text)) is not None:
            await asyncio.sleep(int(m.group(1)) / 1000.0)
        if (m := _STATUS.search(text)) is not None:
            return _error(int(m.group(1)), f"status {m.group(1)} asked for by the test", "test_error")
        inp = ModelInput(
            messages=messages,
            max_tokens=max_tokens,
            temperature=temperature,
            logprobs=bool(body.get("logprobs")),
        )
        try:
            (out,) = await asyncio.to_thread(self.model.infer, [inp])
        except ModelError as exc:
            return _error(500, str(exc), "server_error")
        logprobs: dict[str, Any] | None = None
        if out.logprobs is not None:
            content: list[dict[str, Any]] = [
                {"token": "", "logprob": lp, "bytes": None, "top_logprobs": []} for lp in out.logprobs
            ]
            logprobs = {"content": content}
        prompt_tokens = int(out.extra.get("prompt_tokens", 0))  # type: ignore[call-overload]
        completion_tokens = int(out.extra.get("completion_tokens", 0))  # type: ignore[call-overload]
        return web.json_response(
            _completion(
                self.model_name, out.answer, out.finish_reason, logprobs, prompt_tokens, completion_tokens
            )
        )


def _completion(
    model_name: str,
    answer: str,
    finish_reason: str,
    logprobs: Any,
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    """An OpenAI chat completion response body."""
    return {
        "id": f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model_name,
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": answer},
                "finish_reason": finish_reason,
                "logprobs": logprobs,
            }
        ],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


async def _serve(
    model_dir: str,
    model_name: str,
    host: str,
    port: int,
    build_tiny: bool,
    answer: str | None = None,
    answer_delay_ms: int = 0,
) -> None:
    model = None
    if answer is None:
        if build_tiny:
            build_tiny_causal_lm(model_dir)
        model = HFCausalLM(model_dir, name=model_name)
        model.load()
    stub = StubServer(model, model_name, answer, answer_delay_ms)
    app = web.Application()
    app.router.add_get("/v1/models", stub.models)
    app.router.add_post("/v1/chat/completions", stub.chat)
    app.router.add_get("/stats", stub.stats)
    app.router.add_post("/stats/reset", stub.reset)
    app.router.add_get("/seen", stub.seen_messages)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    bound = runner.addresses[0][1]
    print(f"READY {bound}", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", required=True)
    parser.add_argument("--model-name", default="tiny")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--build-tiny", action="store_true", help="first write a tiny model to --model-dir")
    parser.add_argument("--answer", default=None, help="answer every chat with this text (no model)")
    parser.add_argument("--answer-delay-ms", type=int, default=0, help="wait this long before --answer")
    args = parser.parse_args()
    try:
        asyncio.run(
            _serve(
                args.model_dir,
                args.model_name,
                args.host,
                args.port,
                args.build_tiny,
                args.answer,
                args.answer_delay_ms,
            )
        )
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
