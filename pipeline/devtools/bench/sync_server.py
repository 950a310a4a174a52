"""The gateway benchmark's baseline: the conventional synchronous design, one thread per request.

``python -m pipeline.devtools.bench.sync_server --port N --model faq|echo`` serves ``POST /v1/chat/completions``
with :class:`http.server.ThreadingHTTPServer` (HTTP/1.1 keep-alive, one thread per connection) and
answers each request by calling the same model synchronously, one request per call. The model is
shared and its calls are serialised by a lock (its tokenizer is not safe to call from many threads
at once; the pipeline's model thread serialises calls the same way). Benchmark use only.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from models.base import ChatMessage, ModelBackend, ModelInput


def build(model: str) -> ModelBackend:
    if model == "echo":
        from models.echo import EchoModel

        return EchoModel()
    from models.faq import FAQAnswerer

    return FAQAnswerer()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 1024  # the default listen backlog of 5 would refuse a burst of connections
    model: ModelBackend
    lock: threading.Lock


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: object) -> None:
        return

    def _send(self, status: int, body: dict[str, object]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        self._send(200, {"status": "ready"} if self.path == "/readyz" else {"ok": True})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length)
        if self.path != "/v1/chat/completions":
            self._send(404, {"error": {"message": f"no route {self.path}"}})
            return
        try:
            body = json.loads(raw)
            messages = tuple(ChatMessage(m["role"], m["content"]) for m in body["messages"])
            inp = ModelInput(messages, max_tokens=int(body.get("max_tokens") or 256))
        except (ValueError, KeyError, TypeError) as exc:
            self._send(400, {"error": {"message": f"invalid request: {exc!r}", "type": "invalid_request"}})
            return
        with self.server.lock:
            out = self.server.model.infer([inp])[0]
        reply = {
            "id": f"chatcmpl-{time.time_ns()}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": body.get("model", "default"),
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": out.answer},
                    "finish_reason": out.finish_reason,
                }
            ],
        }
        self._send(200, reply)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--model", choices=["faq", "echo"], default="faq")
    args = p.parse_args(argv)
    server = _Server(("127.0.0.1", args.port), _Handler)
    server.model = build(args.model)
    server.model.load()
    server.lock = threading.Lock()
    print(f"sync server ready on 127.0.0.1:{args.port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
