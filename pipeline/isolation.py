"""Failure isolation for one model call (docs/architecture.md, "The path of a request", inference).

:func:`run_isolated` runs a batch through a model so that one bad request cannot fail its
batch-mates: transient errors are retried with exponential backoff (tenacity); any other failure of a
batch of several items splits it in halves, recursively, until the failing item is alone and gets its
:class:`~pipeline.exceptions.ModelError` in its slot. With one poisoned item in a batch of ``n`` this
costs at most ``1 + 2 * ceil(log2(n))`` model calls (plus retries).

It blocks (sleeps between retries), so the inference agent calls it in a worker thread.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar, cast

from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception_type,
    stop_after_attempt,
    wait_exponential,
    wait_random,
)
from tenacity.wait import wait_base

from pipeline.exceptions import ModelError, PartialBatchError, SettingsError, TransientModelError

T = TypeVar("T")
R = TypeVar("R")

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Retries of transient model errors.

    ``attempts`` counts the first call. The wait before retry ``k`` (1-based) is
    ``min(max_backoff_ms, initial_backoff_ms * multiplier ** (k - 1))`` plus a uniform random
    ``[0, jitter_ms]`` (0 by default, so waits are deterministic).
    """

    attempts: int = 3
    initial_backoff_ms: float = 50.0
    max_backoff_ms: float = 2_000.0
    multiplier: float = 2.0
    jitter_ms: float = 0.0

    def __post_init__(self) -> None:
        if self.attempts < 1:
            raise SettingsError(f"attempts must be at least 1, got {self.attempts}")
        if not (math.isfinite(self.initial_backoff_ms) and self.initial_backoff_ms >= 0):
            raise SettingsError(f"initial_backoff_ms must be >= 0, got {self.initial_backoff_ms!r}")
        if not (math.isfinite(self.max_backoff_ms) and self.max_backoff_ms >= self.initial_backoff_ms):
            raise SettingsError(
                f"max_backoff_ms {self.max_backoff_ms!r} must be at least initial_backoff_ms "
                f"{self.initial_backoff_ms!r}"
            )
        if not (math.isfinite(self.multiplier) and self.multiplier >= 1):
            raise SettingsError(f"multiplier must be >= 1, got {self.multiplier!r}")
        if not (math.isfinite(self.jitter_ms) and self.jitter_ms >= 0):
            raise SettingsError(f"jitter_ms must be >= 0, got {self.jitter_ms!r}")

    def backoff_ms(self, retry: int) -> float:
        """The wait before retry number ``retry`` (1-based), without jitter."""
        return min(self.max_backoff_ms, self.initial_backoff_ms * self.multiplier ** (retry - 1))


def _log_retry(state: RetryCallState) -> None:
    exc = state.outcome.exception() if state.outcome is not None else None
    wait_s = state.next_action.sleep if state.next_action is not None else 0.0
    log.warning(
        "transient model error on attempt %d, retrying in %.0f ms: %s",
        state.attempt_number,
        wait_s * 1e3,
        exc,
    )


def _call_with_retries(
    sub: Sequence[T],
    infer: Callable[[Sequence[T]], list[R]],
    policy: RetryPolicy,
    sleep: Callable[[float], None],
    on_call: Callable[[int], None] | None,
) -> list[R]:
    """One batch, transient errors retried; raises ModelError (transient ones once attempts run out)."""

    def attempt() -> list[R]:
        if on_call is not None:
            on_call(len(sub))
        try:
            out = infer(sub)
        except ModelError:
            raise
        except Exception as exc:  # a model bug or a framework error (e.g. CUDA OOM): permanent
            raise ModelError(f"model raised {type(exc).__name__}: {exc}") from exc
        try:
            n_out = len(out)
        except TypeError:
            raise ModelError(
                f"model returned {type(out).__name__}, expected a list of {len(sub)} outputs"
            ) from None
        if n_out != len(sub):
            raise ModelError(f"model returned {n_out} outputs for a batch of {len(sub)}")
        return list(out)

    wait: wait_base = wait_exponential(
        multiplier=policy.initial_backoff_ms / 1000.0,
        exp_base=policy.multiplier,
        max=policy.max_backoff_ms / 1000.0,
    )
    if policy.jitter_ms > 0:
        wait = wait + wait_random(0, policy.jitter_ms / 1000.0)
    retrying = Retrying(
        stop=stop_after_attempt(policy.attempts),
        wait=wait,
        retry=retry_if_exception_type(TransientModelError),
        sleep=sleep,
        before_sleep=_log_retry,
        reraise=True,
    )
    return retrying(attempt)


def run_isolated(
    batch: Sequence[T],
    infer: Callable[[Sequence[T]], list[R]],
    policy: RetryPolicy,
    sleep: Callable[[float], None] = time.sleep,
    on_call: Callable[[int], None] | None = None,
) -> list[R | ModelError]:
    """Run ``batch`` through ``infer``; one result or :class:`ModelError` per item, in order.

    Called by the inference agent (in a worker thread) for each micro-batch. ``sleep(seconds)`` waits
    between retries (inject a recorder in tests); ``on_call(size)`` is called before every model call,
    retries included, so the caller can count calls.

    - :class:`PartialBatchError` (a backend whose items are separate calls, after their own
      retries): the items it says failed get their errors, the others their outputs; no retry.
    - :class:`TransientModelError`: retried up to ``policy.attempts`` times with exponential backoff;
      when they run out, every item of that (sub-)batch gets a ``ModelError`` that says so (the batch
      is not split: more, smaller calls would not help a model that is timing out).
    - any other ``ModelError`` (``ModelOutOfMemoryError``, a wrong number of outputs) or exception
      from ``infer`` (wrapped as ``ModelError``): a batch of several items is split in halves and each
      half is run the same way; an item that fails alone gets the error in its slot.
    """
    if not batch:
        return []
    try:
        outputs: list[R] = _call_with_retries(batch, infer, policy, sleep, on_call)
        return [*outputs]
    except PartialBatchError as exc:  # the backend knows which items failed: only they fail
        if len(exc.results) != len(batch):
            err = ModelError(f"model gave {len(exc.results)} results for a batch of {len(batch)}")
            err.__cause__ = exc
            return [err] * len(batch)
        return cast("list[R | ModelError]", list(exc.results))
    except TransientModelError as exc:
        err = ModelError(f"model call failed after {policy.attempts} attempts: {exc}")
        err.__cause__ = exc
        return [err] * len(batch)
    except ModelError as exc:
        if len(batch) == 1:
            return [exc]
        mid = len(batch) // 2
        log.info(
            "model error on a batch of %d, splitting into %d + %d: %s", len(batch), mid, len(batch) - mid, exc
        )
        left = run_isolated(batch[:mid], infer, policy, sleep, on_call)
        right = run_isolated(batch[mid:], infer, policy, sleep, on_call)
        return left + right
