"""The OpenAI-compatible HTTP gateway: ``POST /v1/chat/completions`` in front of the Kafka pipeline.

Each HTTP request becomes one InferenceRequest on ``surge.requests`` whose ``reply_to`` is this
gateway instance's own reply topic (``{prefix}replies.gateway-<instance id>``, created at start), so
several gateway replicas never read each other's replies. The instance id is ``worker_id`` when set,
else ``<host>-<pid>``: a pod's name in Kubernetes, so a restarted pod reuses its topic. The topic is
not deleted at a stop: a reply still on its way to a deleted topic would make the worker's producer
wait for the topic's metadata, stalling its reply path. One
:class:`SurgeClient` per process produces the requests and reads the replies; each handler awaits
the reply of its request_id, up to ``gateway_timeout_ms`` (then 504).

Streaming (``"stream": true``) is answered as server-sent events in the OpenAI chunk format, but
the pipeline returns whole answers: the gateway waits for the reply, then sends it cut into a few
word-boundary chunks. Tokens are not streamed from the model, and errors are plain HTTP errors
(status and JSON body) even for streaming requests, since nothing is sent before the reply.

Each request's tenant, tier and highest priority come from its API key (``SURGE_API_KEYS``, keys
compared in constant time; :mod:`pipeline.auth`), the ``user`` it names is namespaced under the
tenant (and each record is signed with the caller's key, :func:`pipeline.auth.sign`, so that workers
that want signed records, ``kafka_request_auth``, serve it as that key's), and a level-3 template is
marked as one (``X-Surge-Served-From``, ``finish_reason``): see
:mod:`pipeline.gateway_format` and docs/architecture.md "Security". The in-flight bound is checked
before the body is read, and a request counts against it from then on.

Routes: ``POST /v1/chat/completions``, ``GET /v1/models``, ``GET /healthz`` (process alive),
``GET /readyz`` (200 once the Kafka client is started and the reply topic assigned),
``GET /metrics`` (Prometheus text of the gateway's own registry).

Run it with ``surge gateway --port N`` (:func:`run_gateway`), or in-process with
:func:`start_gateway` (tests, benchmarks).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import socket
import time
import uuid

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest

from pipeline.admin import ensure_topics
from pipeline.auth import ANONYMOUS, ApiKey, KeyRing, parse_api_keys
from pipeline.client import SurgeClient
from pipeline.exceptions import InvalidRequestError, PermissionDeniedError
from pipeline.gateway_format import (
    ChatCall,
    build_request,
    completion,
    error_body,
    error_status,
    models_list,
    retry_after_s,
    stream_chunks,
)
from pipeline.kafka_security import client_options
from pipeline.metrics import Metrics, create_metrics
from pipeline.records import InferenceReply, now_ms
from pipeline.settings import Settings
from pipeline.topics import TopicNames

log = logging.getLogger("surge.gateway")

#: HTTP bodies larger than the record limit by more than this are refused before they are read
BODY_SLACK_BYTES = 64 << 10
#: response header naming where an answer came from: model, cache, merged or template
SERVED_FROM_HEADER = "X-Surge-Served-From"


def default_instance_id(settings: Settings) -> str:
    """``worker_id``, else ``<host>-<pid>``, reduced to the characters Kafka allows in topic names.

    Two gateways with one id share a reply topic; that only costs reads, as each picks its own
    request_ids.
    """
    raw = settings.worker_id or f"{socket.gethostname()}-{os.getpid()}"
    return re.sub(r"[^A-Za-z0-9._-]", "-", raw)[:120]


class HttpError(Exception):
    """An error answered before or instead of a pipeline reply."""

    def __init__(self, code: str, message: str, retry_after_ms: int | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.retry_after_ms = retry_after_ms


def error_response(
    code: str, message: str, retry_after_ms: int | None = None, request_id: str | None = None
) -> web.Response:
    """The HTTP response of an error: status by code, OpenAI error body, ``Retry-After`` when known."""
    headers: dict[str, str] = {}
    retry = retry_after_s(retry_after_ms)
    if retry is not None:
        headers["Retry-After"] = str(retry)
    if request_id is not None:
        headers["x-request-id"] = request_id
    return web.json_response(error_body(code, message), status=error_status(code), headers=headers)


class Gateway:
    """One gateway process: the aiohttp app, one shared SurgeClient, metrics, its reply topic."""

    def __init__(
        self,
        settings: Settings,
        *,
        instance_id: str | None = None,
        registry: CollectorRegistry | None = None,
        max_in_flight: int = 0,
    ) -> None:
        """``max_in_flight``: chat requests awaiting replies beyond which the gateway answers 503 (0: no bound)."""
        self.settings = settings
        self.max_in_flight = max_in_flight
        self._in_flight = 0
        self.instance_id = instance_id or default_instance_id(settings)
        self.topics = TopicNames(settings.topic_prefix)
        self.reply_topic = f"{self.topics.replies}.gateway-{self.instance_id}"
        self.keys = KeyRing(parse_api_keys(settings.api_keys))
        self.metrics: Metrics = create_metrics(registry)
        r = self.metrics.registry
        self.http_responses = Counter(
            "surge_gateway_responses", "HTTP responses of the gateway", ["status"], registry=r
        )
        self.in_flight = Gauge(
            "surge_gateway_in_flight", "Chat requests admitted and not yet answered", registry=r
        )
        self.client = SurgeClient(
            settings.bootstrap_servers,
            requests_topic=self.topics.requests,
            reply_topic=self.reply_topic,
            keep_replies=False,
            security=client_options(settings),
            # a caller's reply must be signed with its key where the workers sign replies
            verify_replies=settings.requests_signed,
        )
        self.ready = False
        self.max_body_bytes = settings.max_record_bytes + BODY_SLACK_BYTES
        self.app = web.Application(client_max_size=self.max_body_bytes)
        self.app.add_routes(
            [
                web.post("/v1/chat/completions", self.chat_completions),
                web.get("/v1/models", self.models),
                web.get("/healthz", self.healthz),
                web.get("/readyz", self.readyz),
                web.get("/metrics", self.metrics_text),
            ]
        )
        self.runner: web.AppRunner | None = None
        self.port: int | None = None

    # ---- life cycle ------------------------------------------------------------------------------
    async def start(self, host: str = "0.0.0.0", port: int | None = None) -> int:
        """Create the topics, start the Kafka client, then listen; returns the bound port."""
        await ensure_topics(self.settings, extra=[self.reply_topic])
        await self.client.start()
        self.runner = web.AppRunner(self.app, access_log=None)
        await self.runner.setup()
        # in-flight requests get up to the gateway timeout (at most 25 s) to finish at a stop
        grace_s = min(self.settings.gateway_timeout_ms / 1000, 25.0)
        site = web.TCPSite(
            self.runner, host, self.settings.gateway_port if port is None else port, shutdown_timeout=grace_s
        )
        await site.start()
        self.port = int(self.runner.addresses[0][1])
        self.ready = True
        if not len(self.keys):
            log.warning(
                "gateway %s has no API keys (SURGE_API_KEYS): every caller is tenant %r, tier %r, "
                "priority up to %r; configure keys outside development",
                self.instance_id,
                ANONYMOUS.tenant,
                ANONYMOUS.tier,
                ANONYMOUS.max_priority,
            )
        log.info("gateway %s on %s:%d, replies on %s", self.instance_id, host, self.port, self.reply_topic)
        return self.port

    async def stop(self) -> None:
        """Stop answering (readyz turns 503), let in-flight requests finish, stop the Kafka client."""
        self.ready = False
        if self.runner is not None:
            await self.runner.cleanup()
        await self.client.stop()

    async def __aenter__(self) -> Gateway:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>`` once started."""
        return f"http://127.0.0.1:{self.port}"

    # ---- handlers --------------------------------------------------------------------------------
    def _authenticate(self, request: web.Request) -> ApiKey:
        """The caller's key; raises 401 when keys are configured and this one is not one of them."""
        if not len(self.keys):
            return ANONYMOUS
        auth = request.headers.get("Authorization", "")
        scheme, _, presented = auth.partition(" ")
        presented = presented.strip()
        if scheme.lower() != "bearer" or not presented:
            raise HttpError(
                "invalid_api_key", "missing API key: send the header 'Authorization: Bearer <key>'"
            )
        key = self.keys.lookup(presented)
        if key is None:
            raise HttpError("invalid_api_key", "invalid API key: this key is not configured (SURGE_API_KEYS)")
        return key

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/chat/completions``: admit, read, validate, produce, await the reply, answer."""
        t0 = time.perf_counter()
        request_id = uuid.uuid4().hex
        call: ChatCall | None = None
        reply: InferenceReply | None = None
        admitted = False
        try:
            key = self._authenticate(request)
            if not self.ready:
                raise HttpError("unavailable", "the gateway is not ready (starting or stopping)", 1000)
            # before the body is read: a flood of slow uploads is shed like a flood of requests
            if self.max_in_flight and self._in_flight >= self.max_in_flight:
                raise HttpError(
                    "overloaded",
                    f"the gateway has {self._in_flight} requests in flight; the limit is {self.max_in_flight}",
                    1000,
                )
            admitted = True
            self._in_flight += 1
            self.in_flight.inc()
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge as exc:
                raise HttpError(
                    "request_too_large",
                    f"request body is larger than {self.max_body_bytes} bytes "
                    f"(max_record_bytes={self.settings.max_record_bytes} plus {BODY_SLACK_BYTES})",
                ) from exc
            try:
                call = build_request(
                    raw,
                    request.headers,
                    settings=self.settings,
                    request_id=request_id,
                    key=key,
                    reply_to=self.reply_topic,
                    created_at_ms=now_ms(),
                )
            except (InvalidRequestError, PermissionDeniedError) as exc:
                raise HttpError(exc.code, exc.message) from exc
            reply = await self._round_trip(call, key)
        except HttpError as exc:
            return self._finish(
                error_response(exc.code, exc.message, exc.retry_after_ms, request_id),
                call,
                reply,
                t0,
                exc.code,
            )
        finally:
            if admitted:
                self._in_flight -= 1
                self.in_flight.dec()
        if reply.status != "ok" or reply.error is not None:
            err = reply.error
            code, message = (err.code, err.message) if err else ("internal", "error reply without details")
            retry = err.retry_after_ms if err else None
            return self._finish(error_response(code, message, retry, request_id), call, reply, t0, code)
        gateway_ms = (time.perf_counter() - t0) * 1000
        headers = {"x-request-id": request_id, SERVED_FROM_HEADER: reply.served_from or "model"}
        if not call.stream:
            resp = web.json_response(completion(call, reply, gateway_ms), headers=headers)
            return self._finish(resp, call, reply, t0, None)
        sse = web.StreamResponse(
            headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", **headers}
        )
        await sse.prepare(request)
        for chunk in stream_chunks(call, reply, gateway_ms):
            await sse.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        await sse.write(b"data: [DONE]\n\n")
        await sse.write_eof()
        return self._finish(sse, call, reply, t0, None)

    async def _round_trip(self, call: ChatCall, key: ApiKey) -> InferenceReply:
        """Produce the request (acked by the broker), signed with the caller's key when it has one,
        and await its reply, at most gateway_timeout_ms."""
        req = call.request
        rid = req["request_id"]
        signer = key if key.key else None
        fut = self.client.expect(rid, signer)
        try:
            try:
                delivery = await self.client.produce(req, signer=signer)
                await delivery
            except Exception as exc:
                raise HttpError(
                    "unavailable", f"could not write the request to Kafka: {exc!r}", 1000
                ) from exc
            timeout_ms = self.settings.gateway_timeout_ms
            try:
                return await asyncio.wait_for(fut, timeout_ms / 1000)
            except TimeoutError as exc:
                raise HttpError(
                    "deadline_exceeded",
                    f"no reply from the pipeline within gateway_timeout_ms={timeout_ms} ms (request {rid})",
                ) from exc
        finally:
            self.client.forget(rid)
            if not fut.done():
                fut.cancel()

    def _finish(
        self,
        resp: web.StreamResponse,
        call: ChatCall | None,
        reply: InferenceReply | None,
        t0: float,
        error_code: str | None,
    ) -> web.StreamResponse:
        priority = (reply.priority if reply and reply.priority else None) or (
            call.request.get("priority", "interactive") if call else "none"
        )
        status = "ok" if error_code is None else "error"
        served = (reply.served_from if reply else None) or "none"
        self.metrics.requests.labels(priority=priority, status=status, served_from=served).inc()
        self.metrics.request_latency.labels(priority=priority).observe(time.perf_counter() - t0)
        self.http_responses.labels(status=str(resp.status)).inc()
        return resp

    async def models(self, request: web.Request) -> web.Response:
        """``GET /v1/models``: the configured model (keys are checked as for chat)."""
        try:
            self._authenticate(request)
        except HttpError as exc:
            return error_response(exc.code, exc.message)
        return web.json_response(models_list(self.settings))

    async def healthz(self, request: web.Request) -> web.Response:
        """Liveness: the process answers."""
        return web.json_response({"status": "alive"})

    async def readyz(self, request: web.Request) -> web.Response:
        """Readiness: 200 once the Kafka client runs and the reply topic is assigned, else 503."""
        if self.ready:
            return web.json_response({"status": "ready", "reply_topic": self.reply_topic})
        return web.json_response({"status": "not ready"}, status=503)

    async def metrics_text(self, request: web.Request) -> web.Response:
        """Prometheus exposition of the gateway's registry."""
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


async def start_gateway(
    settings: Settings,
    *,
    host: str = "0.0.0.0",
    port: int | None = None,
    instance_id: str | None = None,
    max_in_flight: int = 0,
) -> Gateway:
    """Start a gateway in this event loop (tests, benchmarks); ``await gw.stop()`` when done."""
    gw = Gateway(settings, instance_id=instance_id, max_in_flight=max_in_flight)
    try:
        await gw.start(host, port)
    except BaseException:
        with contextlib.suppress(Exception):
            await gw.stop()
        raise
    return gw


def run_gateway(settings: Settings) -> int:
    """``surge gateway``: serve on 0.0.0.0:``gateway_port`` until SIGINT/SIGTERM; returns the exit code."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s %(message)s")

    async def main() -> int:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        gw = await start_gateway(settings, max_in_flight=settings.gateway_max_in_flight)
        print(f"surge gateway ready: http://0.0.0.0:{gw.port}/v1 (replies on {gw.reply_topic})", flush=True)
        await stop.wait()
        log.info("stopping gateway %s", gw.instance_id)
        await gw.stop()
        return 0

    return asyncio.run(main())
