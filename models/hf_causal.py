"""A local Hugging Face causal LM folder behind the :class:`ModelBackend` interface.

Any folder that ``AutoModelForCausalLM.from_pretrained`` and ``AutoTokenizer.from_pretrained`` read
works (a real model copied onto the machine, or one written by :func:`models.tiny.build_tiny_causal_lm`).
Nothing is downloaded: loading is local-only.

How a batch runs (``infer``):

* each request is rendered with the tokenizer's chat template when it has one, else as
  ``role: content`` lines ending with ``assistant:``;
* prompts are LEFT-padded (decoder-only models continue from the right edge) and truncated from the
  left when they would not leave room for the answer in the model's context;
* one ``generate`` call serves the whole batch, with ``max_new_tokens`` = the largest ``max_tokens``
  in it; each answer is then cut at its first end-of-sequence token or at its own ``max_tokens``;
* mixed temperatures share that one call: when every item is greedy (temperature 0) the call is
  greedy; otherwise it samples, and a per-row logits processor divides each row's logits by that
  row's temperature, or, for a temperature-0 row, keeps only its argmax, so greedy rows stay greedy
  and deterministic inside a sampled batch. The model's own ``top_k``/``top_p`` (from its
  ``generation_config``) then apply to the sampled rows, as in plain ``generate``;
* ``logprobs`` are the model's log-probabilities of the chosen tokens: log-softmax of the raw logits
  (``output_logits``), before temperature or top-k/top-p, so they are comparable across
  temperatures. They are computed only when an item in the batch asks for them.

Errors: a CUDA out-of-memory error becomes :class:`ModelOutOfMemoryError` (the caller splits the
batch); any other failure inside ``infer`` becomes :class:`ModelError`; a missing or unreadable
folder, or an impossible loading option, becomes :class:`ModelLoadError` at ``load()``.
"""

from __future__ import annotations

import copy
import hashlib
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from models.base import ModelBackend, ModelInput, ModelOutput
from models.exceptions import ModelError, ModelLoadError, ModelOutOfMemoryError

if TYPE_CHECKING:
    import torch

_DTYPES = ("auto", "float32", "bfloat16", "float16")


def _config_sha8(folder: Path) -> str:
    """First 8 hex digits of a sha256 over ``config.json`` and each weights file's name, size and
    first and last MiB: new weights under an unchanged config are a new version (cheap to compute
    without loading; the intake's cache scope depends on it)."""
    digest = hashlib.sha256((folder / "config.json").read_bytes())
    for f in sorted(folder.glob("*")):
        if f.suffix in (".safetensors", ".bin", ".pt", ".gguf") and f.is_file():
            size = f.stat().st_size
            digest.update(f"{f.name}:{size}".encode())
            with open(f, "rb") as fh:
                digest.update(fh.read(1 << 20))
                if size > 2 << 20:
                    fh.seek(-(1 << 20), 2)
                    digest.update(fh.read(1 << 20))
    return digest.hexdigest()[:8]


def _is_oom(exc: BaseException) -> bool:
    """True for CUDA out-of-memory errors and for allocator failures reported as RuntimeError."""
    import torch

    if isinstance(exc, torch.cuda.OutOfMemoryError):
        return True
    text = str(exc).lower()
    return isinstance(exc, RuntimeError) and ("out of memory" in text or "can't allocate memory" in text)


class _PerRowTemperature:
    """Logits processor: row ``i`` divided by ``temperatures[i]``; a 0 row keeps only its argmax."""

    def __init__(self, temperatures: Sequence[float], device: torch.device) -> None:
        import torch

        temps = torch.tensor([float(t) for t in temperatures], dtype=torch.float32, device=device)
        self._greedy = temps <= 0.0
        self._temps = torch.where(self._greedy, torch.ones_like(temps), temps).unsqueeze(1)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        import torch

        scaled = scores / self._temps.to(scores.dtype)
        if bool(self._greedy.any()):
            best = scores.argmax(dim=-1, keepdim=True)
            only_best = torch.full_like(scores, float("-inf")).scatter(1, best, 0.0)
            scaled = torch.where(self._greedy.unsqueeze(1), only_best, scaled)
        return scaled


class HFCausalLM(ModelBackend):
    """A Hugging Face causal LM folder, answering batches with one batched ``generate`` call each.

    Lifecycle: construct (cheap, nothing loaded), ``load()`` once off the event loop, ``infer(batch)``
    from a worker thread for each micro-batch (calls are serialised by a lock: one ``generate`` at a
    time per model), ``close()`` at shutdown.

    ``device_map`` (``"auto"``, ``"cpu"``, ``"cuda:0"``, ...) is passed to ``from_pretrained`` with
    ``max_memory`` and ``offload_folder``; it needs the ``accelerate`` package. Without it the whole
    model goes to ``cuda`` when CUDA is available, else to the CPU. ``load_in_8bit`` needs CUDA and
    the ``bitsandbytes`` package. Batches longer than ``max_batch_size`` are run in chunks.

    ``num_threads``: when set, ``load()`` calls ``torch.set_num_threads`` (process-wide). On a small,
    shared CPU box 1 is often 10x faster than the default, whose spinning threads fight other work.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        name: str | None = None,
        device_map: str | None = None,
        max_memory: dict[Any, str] | None = None,
        offload_folder: str | None = None,
        dtype: str = "auto",
        load_in_8bit: bool = False,
        max_batch_size: int = 16,
        num_threads: int | None = None,
    ) -> None:
        if dtype not in _DTYPES:
            raise ModelLoadError(f"dtype must be one of {', '.join(_DTYPES)}, got {dtype!r}")
        if max_batch_size < 1:
            raise ModelLoadError(f"max_batch_size must be at least 1, got {max_batch_size}")
        if num_threads is not None and num_threads < 1:
            raise ModelLoadError(f"num_threads must be at least 1 or None, got {num_threads}")
        self.path = Path(path)
        self.name = name or self.path.name or "hf-causal"
        self.version = f"{self.name}@unloaded"
        self.device_map = device_map
        self.max_memory = max_memory
        self.offload_folder = offload_folder
        self.dtype = dtype
        self.load_in_8bit = load_in_8bit
        self.max_batch_size = max_batch_size
        self.num_threads = num_threads
        #: seconds the last ``load()`` took
        self.load_seconds: float | None = None
        self._model: Any = None
        self._tokenizer: Any = None
        self._device: torch.device | None = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ loading

    def _check_folder(self) -> None:
        if not self.path.is_dir():
            raise ModelLoadError(f"model folder {str(self.path)!r} does not exist or is not a directory")
        if not (self.path / "config.json").is_file():
            raise ModelLoadError(
                f"model folder {str(self.path)!r} has no config.json: not a Hugging Face model"
            )

    def _load_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``from_pretrained``; raises ModelLoadError for impossible options."""
        import torch
        from transformers.utils import is_accelerate_available

        kwargs: dict[str, Any] = {"local_files_only": True}
        kwargs["dtype"] = "auto" if self.dtype == "auto" else getattr(torch, self.dtype)
        device_map = self.device_map
        if self.load_in_8bit:
            if not torch.cuda.is_available():
                raise ModelLoadError(
                    f"load_in_8bit=True needs CUDA (bitsandbytes 8-bit kernels), but torch sees no CUDA "
                    f"device; load {str(self.path)!r} with load_in_8bit=False, or run on a GPU"
                )
            try:
                import bitsandbytes  # noqa: F401
            except ImportError as exc:
                raise ModelLoadError(
                    "load_in_8bit=True needs the bitsandbytes package, which is not installed "
                    "(pip install bitsandbytes)"
                ) from exc
            from transformers import BitsAndBytesConfig

            kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
            device_map = device_map or "auto"
        if device_map is not None:
            if not is_accelerate_available():
                raise ModelLoadError(
                    f"device_map={device_map!r} needs the accelerate package, which is not installed "
                    "(pip install accelerate); leave device_map unset to load onto one device"
                )
            kwargs["device_map"] = device_map
            if self.max_memory is not None:
                kwargs["max_memory"] = self.max_memory
            if self.offload_folder is not None:
                kwargs["offload_folder"] = self.offload_folder
        return kwargs

    def load(self) -> None:
        """Load tokenizer and weights. Called once at worker start, off the event loop."""
        self._check_folder()
        started = time.perf_counter()
        kwargs = self._load_kwargs()
        if self.num_threads is not None:
            import torch

            torch.set_num_threads(self.num_threads)
        try:
            import torch
            from transformers import AutoModelForCausalLM, AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(self.path, local_files_only=True)
            model = AutoModelForCausalLM.from_pretrained(self.path, **kwargs)
        except ModelLoadError:
            raise
        except Exception as exc:  # any loader failure is a load error
            raise ModelLoadError(
                f"cannot load causal LM from {str(self.path)!r}: {type(exc).__name__}: {exc}"
            ) from exc
        if "device_map" not in kwargs:
            self._device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            # transformers wraps PreTrainedModel.to with functools.wraps, whose typeshed type does not
            # bind ``self``: mypy takes the device for the model
            model = model.to(self._device)  # type: ignore[arg-type]
        else:
            weight = model.get_input_embeddings().weight
            assert isinstance(weight, torch.Tensor), "an embedding layer's weight is a tensor"
            self._device = weight.device
        model.eval()
        tokenizer.padding_side = "left"
        tokenizer.truncation_side = "left"
        if tokenizer.pad_token is None:
            if tokenizer.eos_token is not None:
                tokenizer.pad_token = tokenizer.eos_token
            elif tokenizer.unk_token is not None:
                tokenizer.pad_token = tokenizer.unk_token
            else:
                tokenizer.add_special_tokens({"pad_token": "<|pad|>"})
                model.resize_token_embeddings(len(tokenizer))
        self._tokenizer = tokenizer
        self._model = model
        self.version = f"{self.name}@{_config_sha8(self.path)}"
        self.load_seconds = time.perf_counter() - started

    @property
    def device(self) -> torch.device | None:
        """Where ``load()`` put the weights (their first layer's device with ``device_map``); None
        before it."""
        return self._device

    @property
    def tokenizer(self) -> Any:
        """The tokenizer ``load()`` read (None before it)."""
        return self._tokenizer

    def peek_version(self) -> str:
        """``name@sha8`` as :meth:`load` will set it, from the files alone; :class:`ModelLoadError`
        when the folder holds no readable ``config.json`` (a traceback from the worker's start
        before, after it had created its topics)."""
        try:
            return f"{self.name}@{_config_sha8(self.path)}"
        except OSError as exc:
            raise ModelLoadError(
                f"{self.path}: not a Hugging Face model folder (SURGE_MODEL_PATH): "
                f"{exc.strerror or exc} reading {Path(exc.filename or self.path).name}"
            ) from exc

    def close(self) -> None:
        """Drop the weights. Called once at worker shutdown."""
        self._model = None
        self._tokenizer = None
        try:
            import torch

            if torch.cuda.is_available():
                torch.cuda.empty_cache()
        except Exception:  # best effort at shutdown
            pass

    # ------------------------------------------------------------------ inference

    def render_prompt(self, inp: ModelInput) -> str:
        """The text the model continues: the chat template when the tokenizer has one."""
        messages = inp.chat()
        if self._tokenizer is not None and getattr(self._tokenizer, "chat_template", None):
            return str(
                self._tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            )
        lines = [f"{m['role']}: {m['content']}" for m in messages]
        return "\n".join([*lines, "assistant:"])

    def _eos_ids(self) -> set[int]:
        eos = self._model.generation_config.eos_token_id
        if eos is None:
            eos = self._tokenizer.eos_token_id
        if eos is None:
            return set()
        return {int(e) for e in eos} if isinstance(eos, list | tuple) else {int(eos)}

    def _context_limit(self) -> int:
        cfg = self._model.config
        for attr in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
            value = getattr(cfg, attr, None)
            if isinstance(value, int) and value > 0:
                return value
        return 4096

    def infer(self, batch: Sequence[ModelInput]) -> list[ModelOutput]:
        """Answer a batch (blocking, from a worker thread); one output per input, in order."""
        if self._model is None:
            raise ModelError(f"model {self.name!r} is not loaded: call load() before infer()")
        outputs: list[ModelOutput] = []
        for start in range(0, len(batch), self.max_batch_size):
            chunk = batch[start : start + self.max_batch_size]
            oom: str | None = None
            try:
                with self._lock:
                    outputs.extend(self._generate(chunk))
            except ModelError:
                raise
            except Exception as exc:  # mapped to typed model errors below
                if not _is_oom(exc):
                    raise ModelError(
                        f"generation failed on a batch of {len(chunk)} with model {self.version}: "
                        f"{type(exc).__name__}: {exc}"
                    ) from exc
                oom = f"{type(exc).__name__}: {exc}"
            if oom is not None:
                # raised here, not inside the except block and not chained: the CUDA error's traceback
                # holds the failed call's frames and their tensors (the KV cache of the whole batch),
                # which would stay allocated while the caller retries the halves and make them fail too
                self._free_cuda()
                raise ModelOutOfMemoryError(len(chunk), oom)
        return outputs

    @staticmethod
    def _free_cuda() -> None:
        """Collect what the failed call left (frames in reference cycles) and return cached blocks."""
        import gc

        import torch

        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _generate(self, batch: Sequence[ModelInput]) -> list[ModelOutput]:
        import torch
        from transformers import LogitsProcessorList

        if not batch:
            return []
        for i, inp in enumerate(batch):
            if inp.max_tokens < 1:
                raise ModelError(f"item {i} asks for max_tokens={inp.max_tokens}; the minimum is 1")
        tok = self._tokenizer
        max_new = max(inp.max_tokens for inp in batch)
        prompt_room = self._context_limit() - max_new
        if prompt_room < 1:
            raise ModelError(
                f"max_tokens={max_new} leaves no room for the prompt in the model's context of "
                f"{self._context_limit()} tokens"
            )
        use_template = bool(getattr(tok, "chat_template", None))
        enc = tok(
            [self.render_prompt(inp) for inp in batch],
            return_tensors="pt",
            padding=True,
            truncation=True,
            max_length=prompt_room,
            add_special_tokens=not use_template,
        ).to(self._device)
        prompt_len = int(enc["input_ids"].shape[1])
        want_logprobs = any(inp.logprobs for inp in batch)
        sampled = any(inp.temperature > 0 for inp in batch)

        gen_cfg = copy.deepcopy(self._model.generation_config)
        gen_cfg.max_new_tokens = max_new
        gen_cfg.min_new_tokens = None
        gen_cfg.max_length = None
        gen_cfg.num_beams = 1
        gen_cfg.num_return_sequences = 1
        gen_cfg.pad_token_id = tok.pad_token_id
        gen_cfg.return_dict_in_generate = True
        gen_cfg.output_logits = want_logprobs
        gen_cfg.output_scores = False
        processors = LogitsProcessorList()
        if sampled:
            assert self._device is not None, "load() sets the device, and infer() checked it ran"
            gen_cfg.do_sample = True
            gen_cfg.temperature = 1.0  # per-row temperatures are applied by the processor below
            processors.append(_PerRowTemperature([inp.temperature for inp in batch], self._device))
        else:
            gen_cfg.do_sample = False
            gen_cfg.temperature = None
            gen_cfg.top_k = None
            gen_cfg.top_p = None
            gen_cfg.min_p = None

        with torch.inference_mode():
            out = self._model.generate(**enc, generation_config=gen_cfg, logits_processor=processors)
            new_tokens = out.sequences[:, prompt_len:]
            token_logprobs: torch.Tensor | None = None
            if want_logprobs and out.logits:
                steps = min(len(out.logits), new_tokens.shape[1])
                token_logprobs = torch.stack(
                    [
                        torch.log_softmax(out.logits[j].float(), dim=-1)
                        .gather(1, new_tokens[:, j : j + 1])
                        .squeeze(1)
                        for j in range(steps)
                    ],
                    dim=1,
                ).cpu()
        prompt_tokens = [int(n) for n in enc["attention_mask"].sum(dim=1).tolist()]
        return self._split_outputs(batch, new_tokens.cpu().tolist(), token_logprobs, prompt_tokens)

    def _split_outputs(
        self,
        batch: Sequence[ModelInput],
        new_tokens: list[list[int]],
        token_logprobs: torch.Tensor | None,
        prompt_tokens: list[int],
    ) -> list[ModelOutput]:
        """Cut each row at its first end-of-sequence token or at its own ``max_tokens``."""
        eos_ids = self._eos_ids()
        results: list[ModelOutput] = []
        for row, inp in enumerate(batch):
            ids = new_tokens[row]
            kept: list[int] = []
            finish = "length"
            for token in ids[: inp.max_tokens]:
                if token in eos_ids:
                    finish = "stop"
                    break
                kept.append(token)
            else:
                if len(ids) < inp.max_tokens:  # generate stopped early without an eos in this row
                    finish = "stop"
            logprobs: list[float] | None = None
            if inp.logprobs and token_logprobs is not None:
                logprobs = [float(x) for x in token_logprobs[row, : len(kept)].tolist()]
            elif inp.logprobs:
                logprobs = []
            answer = self._tokenizer.decode(kept, skip_special_tokens=True)
            results.append(
                ModelOutput(
                    answer=answer,
                    finish_reason=finish,
                    logprobs=logprobs,
                    extra={"prompt_tokens": prompt_tokens[row], "completion_tokens": len(kept)},
                )
            )
        return results
