"""A TEST AND BENCHMARK model that echoes the last user message. It never answers anyone for real.

Used by the overhead benchmark (pipeline cost with a model that costs nothing, or a fixed, known
amount) and by tests of batching, retries and failure isolation:

* ``delay_ms`` per call plus ``per_item_ms`` per item simulate a model's batch cost;
* ``poison``: when this substring is in any item of a batch, the whole batch raises
  :class:`ModelError` (after the simulated delay), as a real model does when one input breaks it;
  the caller must split the batch to isolate the poisoned item;
* ``fail_first_n_calls``: the first N ``infer`` calls raise :class:`TransientModelError`
  immediately, to exercise retry with backoff.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence

from models.base import ModelBackend, ModelInput, ModelOutput
from models.exceptions import ModelError, TransientModelError


class EchoModel(ModelBackend):
    """Echo of the last user message, cut to ``max_tokens`` whitespace-separated words.

    Test/benchmark only. ``infer`` is thread-safe; ``calls``, ``items`` and ``batch_sizes`` count
    what it was asked to do (failed calls included), so tests can assert on model calls saved.
    """

    def __init__(
        self,
        *,
        name: str = "echo",
        delay_ms: float = 0.0,
        per_item_ms: float = 0.0,
        poison: str | None = None,
        fail_first_n_calls: int = 0,
        max_batch_size: int = 64,
    ) -> None:
        if delay_ms < 0 or per_item_ms < 0:
            raise ValueError(f"delays must be >= 0 ms, got delay_ms={delay_ms}, per_item_ms={per_item_ms}")
        if fail_first_n_calls < 0:
            raise ValueError(f"fail_first_n_calls must be >= 0, got {fail_first_n_calls}")
        if poison == "":
            raise ValueError("poison must be a non-empty substring or None")
        self.name = name
        self.version = f"{name}-1"
        self.delay_ms = delay_ms
        self.per_item_ms = per_item_ms
        self.poison = poison
        self.fail_first_n_calls = fail_first_n_calls
        self.max_batch_size = max_batch_size
        #: number of ``infer`` calls so far (failed ones included)
        self.calls = 0
        #: number of items passed to ``infer`` so far
        self.items = 0
        #: size of each batch, in call order
        self.batch_sizes: list[int] = []
        self._lock = threading.Lock()

    def infer(self, batch: Sequence[ModelInput]) -> list[ModelOutput]:
        """Echo each item's last user message; blocking (sleeps the configured delay)."""
        with self._lock:
            self.calls += 1
            self.items += len(batch)
            self.batch_sizes.append(len(batch))
            call_no = self.calls
        if call_no <= self.fail_first_n_calls:
            raise TransientModelError(
                f"echo: injected transient failure on call {call_no} of the first {self.fail_first_n_calls}"
            )
        delay_s = (self.delay_ms + self.per_item_ms * len(batch)) / 1000.0
        if delay_s > 0:
            time.sleep(delay_s)
        if self.poison is not None:
            for i, inp in enumerate(batch):
                if any(self.poison in m.content for m in inp.messages):
                    raise ModelError(
                        f"echo: poison substring {self.poison!r} in item {i} of a batch of {len(batch)}"
                    )
        return [self._echo(inp) for inp in batch]

    @staticmethod
    def _echo(inp: ModelInput) -> ModelOutput:
        words = inp.text.split()
        kept = words[: inp.max_tokens]
        finish = "length" if len(words) > inp.max_tokens else "stop"
        return ModelOutput(
            answer=" ".join(kept) if finish == "length" else inp.text,
            finish_reason=finish,
            logprobs=[0.0] * len(kept) if inp.logprobs else None,
        )
