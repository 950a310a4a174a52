"""A remote OpenAI-compatible chat endpoint (vLLM, DeepSeek API, ...) behind :class:`ModelBackend`.

``infer(batch)`` is called from a worker thread; it sends the batch's requests concurrently through
the official ``openai`` client (sync, thread-safe) on a thread pool of ``max_concurrency`` threads.
The pool belongs to the backend, so the bound holds across concurrent ``infer`` calls too: at most
``max_concurrency`` requests are in flight to the endpoint from one backend.

Errors and retries:

* timeouts, connection failures, 408, 409, 429 and 5xx are :class:`TransientModelError`
  (:class:`RemoteTransientError`); each REQUEST is retried here, with exponential backoff and
  jitter (tenacity), up to ``max_retries`` times; a 429's ``Retry-After`` is carried in
  ``retry_after_ms``. When the retries are spent, the batch raises that transient error and the
  caller's batch-level backoff takes over.
* other 4xx (bad request, auth, unknown model, context too long) are permanent :class:`ModelError`
  (:class:`RemoteStatusError`, with ``status_code``), never retried here; the caller splits the batch
  to find the item that fails.
* each request of a batch is a call of its own, so only the requests that failed fail: when some
  failed (after their retries) and others were answered, :class:`PartialBatchError` carries each
  item's output or error, and the batch-mates of a request that timed out keep their answers. When
  every request failed, the first error is raised (the caller's batch retries and splitting).
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from collections.abc import Sequence
from typing import Any, cast
from urllib.parse import urlparse

from tenacity import Retrying, retry_if_exception_type, stop_after_attempt, wait_exponential_jitter

from models.base import ModelBackend, ModelInput, ModelOutput
from models.exceptions import ModelError, ModelLoadError, PartialBatchError, TransientModelError


class RemoteStatusError(ModelError):
    """The endpoint refused a request with a 4xx status that retrying will not change."""

    def __init__(self, status_code: int, url: str, detail: str) -> None:
        super().__init__(f"{url} answered HTTP {status_code}: {detail}")
        self.status_code = status_code
        self.url = url


class RemoteTransientError(TransientModelError):
    """A timeout, connection failure, 408/409/429 or 5xx: worth retrying later."""

    def __init__(
        self,
        message: str,
        *,
        url: str,
        status_code: int | None = None,
        timeout_s: float | None = None,
        retry_after_ms: int | None = None,
    ) -> None:
        super().__init__(message, retry_after_ms=retry_after_ms)
        self.url = url
        self.status_code = status_code
        self.timeout_s = timeout_s


def _retry_after_ms(headers: Any) -> int | None:
    """``Retry-After`` (seconds) from a response's headers, in ms; None when absent or unreadable."""
    try:
        value = headers.get("retry-after") if headers is not None else None
        return int(float(value) * 1000) if value is not None else None
    except (TypeError, ValueError):
        return None


class RemoteOpenAIModel(ModelBackend):
    """Chat completions from an OpenAI-compatible endpoint, one HTTP request per batch item.

    Lifecycle: construct (cheap), ``load()`` once (opens the client and the thread pool, and checks
    that the endpoint answers and serves ``model``), ``infer(batch)`` from worker threads,
    ``close()`` at shutdown. ``api_key`` defaults to ``$OPENAI_API_KEY``, else ``"EMPTY"`` (vLLM
    without auth accepts any key).
    """

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        timeout_s: float = 30.0,
        max_concurrency: int = 8,
        max_retries: int = 3,
        max_batch_size: int = 32,
        *,
        name: str | None = None,
        backoff_initial_s: float = 0.25,
        backoff_max_s: float = 8.0,
        verify_model_on_load: bool = True,
    ) -> None:
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries}")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.name = name or model
        self.version = f"{model}@{urlparse(self.base_url).netloc or self.base_url}"
        self.timeout_s = timeout_s
        self.max_concurrency = max_concurrency
        self.max_retries = max_retries
        self.max_batch_size = max_batch_size
        self.backoff_initial_s = backoff_initial_s
        self.backoff_max_s = backoff_max_s
        self.verify_model_on_load = verify_model_on_load
        self._api_key = api_key if api_key is not None else os.environ.get("OPENAI_API_KEY", "EMPTY")
        self._client: Any = None
        self._pool: cf.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ lifecycle

    def load(self) -> None:
        """Open the client and the pool; check the endpoint serves ``model``. Called once at start."""
        import openai

        with self._lock:
            if self._client is None:
                self._client = openai.OpenAI(
                    base_url=self.base_url, api_key=self._api_key, timeout=self.timeout_s, max_retries=0
                )
                self._pool = cf.ThreadPoolExecutor(self.max_concurrency, thread_name_prefix="remote-llm")
        if not self.verify_model_on_load:
            return
        try:
            served = [m.id for m in self._client.models.list()]
        except Exception as exc:  # any failure here: the endpoint is unusable
            raise ModelLoadError(
                f"cannot list models at {self.base_url}: {type(exc).__name__}: {exc}"
            ) from exc
        if served and self.model not in served:
            raise ModelLoadError(f"{self.base_url} does not serve model {self.model!r}; it serves {served}")

    def close(self) -> None:
        """Stop the pool and close connections. Called once at shutdown."""
        with self._lock:
            pool, client = self._pool, self._client
            self._pool, self._client = None, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        if client is not None:
            client.close()

    # ------------------------------------------------------------------ inference

    def infer(self, batch: Sequence[ModelInput]) -> list[ModelOutput]:
        """Answer a batch (blocking): its requests run concurrently, at most ``max_concurrency`` at once."""
        pool = self._pool
        if pool is None or self._client is None:
            raise ModelError(f"remote model {self.name!r} is not loaded: call load() before infer()")
        futures = [pool.submit(self._call_with_retries, inp, i, len(batch)) for i, inp in enumerate(batch)]
        try:
            cf.wait(futures)
        except BaseException:
            for fut in futures:
                fut.cancel()
            raise
        results: list[object] = []
        errors: list[BaseException] = []
        for fut in futures:
            exc = fut.exception()
            if exc is None:
                results.append(fut.result())
                continue
            if not isinstance(exc, Exception):
                raise exc
            errors.append(exc)
            results.append(exc if isinstance(exc, ModelError) else ModelError(f"{type(exc).__name__}: {exc}"))
        if not errors:
            return cast("list[ModelOutput]", results)
        if len(errors) == len(batch):
            raise errors[0]  # the batch-level retries and splitting take over
        # each request is a call of its own: only those that failed fail (docs/architecture.md,
        # "The path of a request"), not a batch-mate whose request went through
        raise PartialBatchError(results)

    def _call_with_retries(self, inp: ModelInput, index: int, n: int) -> ModelOutput:
        retrying = Retrying(
            retry=retry_if_exception_type(TransientModelError),
            stop=stop_after_attempt(self.max_retries + 1),
            wait=wait_exponential_jitter(initial=self.backoff_initial_s, max=self.backoff_max_s),
            reraise=True,
        )
        return retrying(self._call_once, inp, index, n)

    def _call_once(self, inp: ModelInput, index: int, n: int) -> ModelOutput:
        """One chat completion request; maps client errors to typed model errors."""
        import openai

        url = f"{self.base_url}/chat/completions"
        where = f"item {index} of a batch of {n}"
        kwargs: dict[str, Any] = {
            "model": self.model,
            "messages": inp.chat(),
            "max_tokens": inp.max_tokens,
            "temperature": inp.temperature,
        }
        if inp.logprobs:
            kwargs["logprobs"] = True
        try:
            resp = self._client.chat.completions.create(**kwargs)
        except openai.APITimeoutError as exc:
            raise RemoteTransientError(
                f"{where}: {url} did not answer within {self.timeout_s:g} s",
                url=url,
                timeout_s=self.timeout_s,
            ) from exc
        except openai.APIConnectionError as exc:
            raise RemoteTransientError(f"{where}: cannot reach {url}: {exc}", url=url) from exc
        except openai.APIStatusError as exc:
            status = exc.status_code
            detail = f"{where}: {exc.message}"
            if status in (408, 409, 429) or status >= 500:
                raise RemoteTransientError(
                    f"{where}: {url} answered HTTP {status}: {exc.message}",
                    url=url,
                    status_code=status,
                    retry_after_ms=_retry_after_ms(exc.response.headers),
                ) from exc
            raise RemoteStatusError(status, url, detail) from exc
        except openai.OpenAIError as exc:
            raise ModelError(f"{where}: bad answer from {url}: {type(exc).__name__}: {exc}") from exc
        return self._to_output(resp, inp, where, url)

    @staticmethod
    def _to_output(resp: Any, inp: ModelInput, where: str, url: str) -> ModelOutput:
        if not resp.choices:
            raise ModelError(f"{where}: {url} answered with no choices")
        choice = resp.choices[0]
        logprobs: list[float] | None = None
        if inp.logprobs:
            content = getattr(choice.logprobs, "content", None) or []
            logprobs = [float(t.logprob) for t in content]
        usage = resp.usage.model_dump() if getattr(resp, "usage", None) is not None else None
        return ModelOutput(
            answer=choice.message.content or "",
            finish_reason="length" if choice.finish_reason == "length" else "stop",
            logprobs=logprobs,
            extra={"finish_reason_raw": choice.finish_reason, "usage": usage, "id": resp.id},
        )
