"""``python -m pipeline.devtools.gpu_check``: the CUDA paths that no CPU test reaches, measured on one GPU.

The test suite runs on CPUs; a worker on a GPU machine takes other paths: sentence-transformers'
``encode`` on the device instead of the traced CPU encoder, the FAQ answerer's vectors from it, a
Hugging Face causal LM moved to ``cuda``, batches split after a real CUDA out-of-memory error, 8-bit
weights through bitsandbytes, and GPU utilisation read through NVML. Each section below runs one of
them through surge's own classes and records what it measured; a section that fails records its
error and the others still run (docs/architecture.md, "Models on a GPU").

Sections: ``env``, ``nvml``, ``embedder``, ``faq``, ``causal``, ``batching``, ``oom_split``, ``int8``.
Writes a JSON report (``--json``) and a plot of throughput against batch size (``--plot``).
``--smoke`` uses tiny sizes on whatever device there is: the test suite runs it on the CPU so the
script cannot rot between GPU runs.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from models.base import ChatMessage, ModelInput, ModelOutput
from models.embedder import Embedder, default_embedder_path
from models.exceptions import ModelError
from models.faq import FAQAnswerer
from models.hf_causal import HFCausalLM
from models.tiny import build_tiny_causal_lm
from pipeline.devtools.samples import QUESTIONS
from pipeline.isolation import RetryPolicy, run_isolated
from pipeline.metrics import GpuSampler, create_metrics


@dataclass(frozen=True)
class Plan:
    """Sizes of one run."""

    texts: int  # distinct questions embedded and classified
    embed_calls: tuple[int, ...]  # call sizes for the embedder's throughput
    cpu_texts: int  # questions for the CPU comparison (slower)
    cpu_calls: tuple[int, ...]
    mid_params: int  # parameters of the random-weight LM used for generation throughput
    gen_batches: tuple[int, ...]  # batch sizes for generation throughput
    gen_tokens: int  # new tokens per request in the throughput runs
    oom_batch: int  # requests in the batch that must not fit
    oom_budget_mib: int  # memory granted above the weights for the out-of-memory run


FULL = Plan(
    texts=4096,
    embed_calls=(1, 8, 32, 64, 128, 256, 512),
    cpu_texts=512,
    cpu_calls=(1, 8, 64),
    mid_params=400_000_000,
    gen_batches=(1, 4, 16, 64, 256),
    gen_tokens=32,
    oom_batch=64,
    oom_budget_mib=2048,
)
SMOKE = Plan(
    texts=64,
    embed_calls=(1, 16),
    cpu_texts=16,
    cpu_calls=(8,),
    mid_params=2_000_000,
    gen_batches=(1, 4),
    gen_tokens=4,
    oom_batch=4,
    oom_budget_mib=64,
)

_PREFIXES = ("", "Hi, ", "Hello, ", "Quick question: ", "Sorry to bother you, ", "Good morning, ")
_SUFFIXES = ("", " Thanks.", " Please help.", " It's urgent.", " Thank you in advance.")


def questions(n: int) -> list[str]:
    """``n`` distinct questions made from the project's own samples (a reference number each)."""
    out = []
    for i in range(n):
        q = QUESTIONS[i % len(QUESTIONS)]
        pre = _PREFIXES[(i // len(QUESTIONS)) % len(_PREFIXES)]
        suf = _SUFFIXES[(i // (len(QUESTIONS) * len(_PREFIXES))) % len(_SUFFIXES)]
        out.append(f"{pre}{q}{suf} (ref {i})")
    return out


def _say(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def _sync() -> None:
    import torch

    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _rate(fn: Callable[[list[str]], Any], texts: list[str], call: int) -> float:
    """Items per second of ``fn`` over ``texts`` in calls of ``call`` items (after one warm call)."""
    fn(texts[:call])
    _sync()
    t0 = time.perf_counter()
    for i in range(0, len(texts), call):
        fn(texts[i : i + call])
    _sync()
    return len(texts) / (time.perf_counter() - t0)


# ---------------------------------------------------------------------------------------- sections


def check_env() -> dict[str, Any]:
    import sentence_transformers
    import torch
    import transformers

    out: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "sentence_transformers": sentence_transformers.__version__,
        "cpu_count": os.cpu_count(),
        "cuda_available": torch.cuda.is_available(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        out.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1))
    return out


def check_nvml(seconds: float = 2.0) -> dict[str, Any]:
    """surge's :class:`GpuSampler` reads the ``gpu_utilization`` gauge idle, then under a matmul load."""
    metrics = create_metrics()
    sampler = GpuSampler(metrics)
    out: dict[str, Any] = {"devices": len(sampler.handles)}
    if not sampler.handles or not _cuda():
        out["skipped"] = "no NVML device (the sampler does nothing without a GPU)"
        return out
    import torch

    def value() -> float | None:
        sampler.sample()
        return metrics.registry.get_sample_value("gpu_utilization", {"device_id": "0"})

    time.sleep(0.5)
    out["idle_pct"] = value()
    stop = threading.Event()

    def load() -> None:
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        while not stop.is_set():
            for _ in range(10):
                a @ a
            torch.cuda.synchronize()

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    readings = []
    t_end = time.monotonic() + seconds
    while time.monotonic() < t_end:
        time.sleep(0.1)
        readings.append(value())
    stop.set()
    worker.join()
    busy = [r for r in readings if r is not None]
    out.update(
        busy_max_pct=max(busy) if busy else None, busy_median_pct=float(np.median(busy)) if busy else None
    )
    out["samples"] = len(readings)
    return out


def check_embedder(plan: Plan, path: str, state: dict[str, Any]) -> dict[str, Any]:
    """MiniLM through :class:`Embedder` on the GPU (``encode``) against the CPU (traced encoder): the
    same vectors, and questions per second at each call size; the accelerator's chunk of 64 against
    256 at the largest call."""
    import torch

    dev = "cuda" if _cuda() else "cpu"
    t0 = time.perf_counter()
    gpu = Embedder(path, device=dev)
    out: dict[str, Any] = {
        "device": dev,
        "load_s": round(time.perf_counter() - t0, 2),
        "chunk": gpu.batch_size,
    }
    out["traced_on_device"] = gpu.traced is not None
    cpu = Embedder(path, device="cpu")
    out["cpu_traced"] = cpu.traced is not None
    state.update(gpu_embedder=gpu, cpu_embedder=cpu)
    texts = questions(plan.texts)
    ref, got = cpu.embed(texts[:256]), gpu.embed(texts[:256])
    cos = (ref * got).sum(axis=1)
    out["cpu_vs_device_min_cosine"] = float(cos.min())
    out["cpu_vs_device_max_abs"] = float(np.abs(ref - got).max())
    rates = {}
    for call in plan.embed_calls:
        rates[str(call)] = round(_rate(gpu.embed, texts, call), 1)
        _say(f"embedder {dev}: calls of {call}: {rates[str(call)]} q/s")
    out["device_qps_by_call"] = rates
    if dev == "cuda":
        big = Embedder(path, device=dev, batch_size=256)
        call = max(plan.embed_calls)
        out["device_qps_chunk256_at_largest_call"] = round(_rate(big.embed, texts, call), 1)
        del big
    cpu_texts = texts[: plan.cpu_texts]
    cpu_rates = {}
    threads = torch.get_num_threads()
    for n_threads in sorted({1, threads}):
        torch.set_num_threads(n_threads)
        for call in plan.cpu_calls:
            key = f"{n_threads}t/{call}"
            cpu_rates[key] = round(_rate(cpu.embed, cpu_texts, call), 1)
            _say(f"embedder cpu {key}: {cpu_rates[key]} q/s")
    torch.set_num_threads(threads)
    out["cpu_qps_by_threads_and_call"] = cpu_rates
    return out


def check_faq(plan: Plan, state: dict[str, Any]) -> dict[str, Any]:
    """The FAQ answerer's limit L (embed + classify at full batches of 128, as ``surge faq eval`` runs
    it) with its embedder on the device and on the CPU, and whether both pick the same intents."""
    import torch

    gpu_emb, cpu_emb = state["gpu_embedder"], state["cpu_embedder"]
    texts = questions(plan.texts)
    on_dev = FAQAnswerer(embedder=gpu_emb)
    on_dev.load()
    on_cpu = FAQAnswerer(embedder=cpu_emb)
    on_cpu.load()
    out: dict[str, Any] = {"call": 128}
    out["device_limit_qps"] = round(_rate(on_dev.classify, texts, 128), 1)
    _say(f"faq on {'cuda' if _cuda() else 'cpu'}: L = {out['device_limit_qps']} q/s")
    out["cpu_limit_qps"] = round(_rate(on_cpu.classify, texts[: plan.cpu_texts], 128), 1)
    out["cpu_threads"] = torch.get_num_threads()
    _say(f"faq on cpu ({out['cpu_threads']} threads): L = {out['cpu_limit_qps']} q/s")
    sample = texts[:512]
    a = [intent for intent, _ in on_dev.classify(sample)]
    b = [intent for intent, _ in on_cpu.classify(sample)]
    out["same_intent_share"] = round(sum(x == y for x, y in zip(a, b, strict=True)) / len(sample), 4)
    return out


def _inputs(texts: list[str], max_tokens: int, temperatures: list[float] | None = None) -> list[ModelInput]:
    temps = temperatures or [0.0] * len(texts)
    return [
        ModelInput(messages=(ChatMessage("user", t),), max_tokens=max_tokens, temperature=temp)
        for t, temp in zip(texts, temps, strict=True)
    ]


def check_causal(tmp: Path) -> dict[str, Any]:
    """A random-weight Llama written with ``save_pretrained`` and loaded by :class:`HFCausalLM` onto
    the GPU: greedy answers repeat, greedy rows inside a sampled batch equal the all-greedy batch,
    log-probabilities come back, and the GPU's greedy answers against the same folder on the CPU."""
    folder = build_tiny_causal_lm(tmp / "tiny")
    lm = HFCausalLM(folder)
    lm.load()
    out: dict[str, Any] = {"device": str(lm.device), "version": lm.version}
    texts = list(QUESTIONS[:8])
    greedy = [o.answer for o in lm.infer(_inputs(texts, 16))]
    again = [o.answer for o in lm.infer(_inputs(texts, 16))]
    out["greedy_repeats"] = greedy == again
    temps = [0.0, 0.8, 0.0, 1.0, 0.0, 0.5, 0.0, 1.2]
    mixed = [o.answer for o in lm.infer(_inputs(texts, 16, temps))]
    rows = [i for i, t in enumerate(temps) if t == 0]
    out["greedy_rows_in_sampled_batch_equal"] = all(mixed[i] == greedy[i] for i in rows)
    lp = lm.infer([ModelInput(messages=(ChatMessage("user", texts[0]),), max_tokens=8, logprobs=True)])[0]
    n_tokens = lp.extra.get("completion_tokens")
    out["logprobs_ok"] = (
        lp.logprobs is not None and len(lp.logprobs) == n_tokens and all(x <= 0 for x in lp.logprobs)
    )
    if _cuda():  # the same folder on the CPU (device_map needs accelerate, which a GPU box has)
        cpu = HFCausalLM(folder, device_map="cpu")
        cpu.load()
        on_cpu = [o.answer for o in cpu.infer(_inputs(texts, 16))]
        out["greedy_equal_to_cpu_share"] = sum(a == b for a, b in zip(greedy, on_cpu, strict=True)) / len(
            texts
        )
        cpu.close()
    lm.close()
    return out


def _tokens(out: ModelOutput, key: str) -> int:
    value = out.extra.get(key, 0)
    return value if isinstance(value, int) else 0


def _timed_generate(lm: HFCausalLM, batch: list[ModelInput]) -> tuple[int, float]:
    """New tokens made and seconds taken by one ``infer`` of ``batch``, after a warm-up at its shape."""
    lm.infer(batch)
    _sync()
    t0 = time.perf_counter()
    outs = lm.infer(batch)
    _sync()
    return sum(_tokens(o, "completion_tokens") for o in outs), time.perf_counter() - t0


def _memory_mib() -> float | None:
    import torch

    return torch.cuda.memory_allocated() / 2**20 if torch.cuda.is_available() else None


def check_batching(plan: Plan, tmp: Path, state: dict[str, Any]) -> dict[str, Any]:
    """Generation throughput of one batched ``generate`` per batch, by batch size, on a random-weight
    Llama of about ``plan.mid_params`` parameters in bfloat16: what micro-batching buys on a GPU."""
    t0 = time.perf_counter()
    folder = build_tiny_causal_lm(tmp / "mid", params_target=plan.mid_params)
    cfg = json.loads((folder / "config.json").read_text())
    out: dict[str, Any] = {
        "params": cfg.get("surge_num_parameters"),
        "build_s": round(time.perf_counter() - t0, 1),
    }
    before = _memory_mib()
    lm = HFCausalLM(folder, dtype="bfloat16", max_batch_size=max(plan.gen_batches))
    lm.load()
    after = _memory_mib()
    out.update(load_s=round(lm.load_seconds or 0, 1), device=str(lm.device))
    if before is not None and after is not None:
        out["weights_mib"] = round(after - before, 1)
    state.update(mid_folder=folder, mid_lm=lm, mid_weights_mib=out.get("weights_mib"))
    texts = questions(max(plan.gen_batches))
    rows = {}
    for b in plan.gen_batches:
        made, dt = _timed_generate(lm, _inputs(texts[:b], plan.gen_tokens))
        rows[str(b)] = {"seconds": round(dt, 3), "new_tokens": made, "tokens_per_s": round(made / dt, 1)}
        _say(f"generate batch {b}: {made} tokens in {dt:.3f} s = {made / dt:.0f} tokens/s")
    out["by_batch"] = rows
    first, last = rows[str(plan.gen_batches[0])], rows[str(plan.gen_batches[-1])]
    out["tokens_per_s_largest_over_1"] = round(last["tokens_per_s"] / max(first["tokens_per_s"], 1e-9), 1)
    return out


def check_oom_split(plan: Plan, state: dict[str, Any]) -> dict[str, Any]:
    """A batch that does not fit: the process is allowed the weights plus ``oom_budget_mib``
    (``torch.cuda.set_per_process_memory_fraction``), a batch of long prompts goes through
    :func:`run_isolated` as the inference agent runs it, and the real CUDA out-of-memory error makes
    it split the batch in halves until the parts fit. Records every call's size."""
    if not _cuda():
        return {"skipped": "needs CUDA (the CPU allocator has no per-process limit to run into)"}
    import torch

    lm: HFCausalLM = state["mid_lm"]
    tok = lm.tokenizer
    room = 2048 - 8
    filler = " ".join(QUESTIONS)
    per = len(tok(filler)["input_ids"])
    text = " ".join([filler] * max(1, room // max(per, 1)))
    prompts = [f"{i}: {text}" for i in range(plan.oom_batch)]
    batch = _inputs(prompts, 4)
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    allowed = torch.cuda.memory_allocated() + plan.oom_budget_mib * 2**20
    calls: list[int] = []
    out: dict[str, Any] = {"batch": plan.oom_batch, "budget_mib_above_weights": plan.oom_budget_mib}
    torch.cuda.set_per_process_memory_fraction(allowed / total)
    try:
        t0 = time.perf_counter()
        results = run_isolated(batch, lm.infer, RetryPolicy(attempts=1), on_call=calls.append)
        out["seconds"] = round(time.perf_counter() - t0, 2)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
    out["prompt_tokens"] = max(
        (_tokens(r, "prompt_tokens") for r in results if not isinstance(r, ModelError)), default=0
    )
    out["calls"] = calls
    out["answered"] = sum(not isinstance(r, ModelError) for r in results)
    out["errors"] = [str(r) for r in results if isinstance(r, ModelError)][:3]
    _say(f"oom split: calls {calls}, {out['answered']} of {plan.oom_batch} answered")
    return out


def check_int8(plan: Plan, state: dict[str, Any]) -> dict[str, Any]:
    """The same random-weight Llama loaded with ``load_in_8bit`` (bitsandbytes): memory against
    bfloat16, and generation at batch 16."""
    if not _cuda():
        try:
            HFCausalLM(state.get("mid_folder") or ".", load_in_8bit=True).load()
        except ModelError as exc:
            return {"skipped": f"refused as it should be without CUDA: {exc}"}
        return {"error": "load_in_8bit loaded without CUDA"}
    import bitsandbytes
    import torch

    folder: Path = state["mid_folder"]
    bf16: HFCausalLM = state["mid_lm"]
    texts = questions(16)
    ref = [o.answer for o in bf16.infer(_inputs(texts, 16))]
    bf16.close()
    state.pop("mid_lm")
    gc.collect()
    torch.cuda.empty_cache()
    before = _memory_mib()
    lm = HFCausalLM(folder, load_in_8bit=True)
    lm.load()
    after = _memory_mib()
    out: dict[str, Any] = {"bitsandbytes": bitsandbytes.__version__, "device": str(lm.device)}
    if before is not None and after is not None:
        out["weights_mib"] = round(after - before, 1)
        out["bf16_weights_mib"] = state.get("mid_weights_mib")
    made, dt = _timed_generate(lm, _inputs(texts, plan.gen_tokens))
    out.update(batch=16, tokens_per_s=round(made / dt, 1))
    greedy = [o.answer for o in lm.infer(_inputs(texts, 16))]
    out["greedy_equal_to_bf16_share"] = sum(a == b for a, b in zip(greedy, ref, strict=True)) / len(texts)
    lm.close()
    _say(f"int8: {out}")
    return out


# ---------------------------------------------------------------------------------------- driver


def run(plan: Plan, embedder_path: str, sections: list[str]) -> dict[str, Any]:
    """Run ``sections`` in order; each gets a dict in the report (its error, if it failed)."""
    report: dict[str, Any] = {"plan": asdict(plan), "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    state: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="surge-gpu-check-") as tmp_s:
        tmp = Path(tmp_s)
        steps: dict[str, Callable[[], dict[str, Any]]] = {
            "env": check_env,
            "nvml": check_nvml,
            "embedder": lambda: check_embedder(plan, embedder_path, state),
            "faq": lambda: check_faq(plan, state),
            "causal": lambda: check_causal(tmp),
            "batching": lambda: check_batching(plan, tmp, state),
            "oom_split": lambda: check_oom_split(plan, state),
            "int8": lambda: check_int8(plan, state),
        }
        for name in sections:
            _say(f"{name} ...")
            t0 = time.perf_counter()
            try:
                report[name] = steps[name]()
            except Exception as exc:  # one section's failure is a finding, not the end of the run
                report[name] = {
                    "error": f"{type(exc).__name__}: {exc}",
                    "trace": traceback.format_exc()[-2000:],
                }
                _say(f"{name} FAILED: {type(exc).__name__}: {exc}")
            report[name]["section_s"] = round(time.perf_counter() - t0, 1)
    return report


def plot(report: dict[str, Any], path: Path) -> None:
    """Embedding questions/s by call size (device and CPU) and generated tokens/s by batch size."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    emb = report.get("embedder", {})
    if "device_qps_by_call" in emb:
        xs = [int(k) for k in emb["device_qps_by_call"]]
        axes[0].plot(xs, list(emb["device_qps_by_call"].values()), "o-", label=f"MiniLM on {emb['device']}")
        for key in sorted({k.split("/")[0] for k in emb.get("cpu_qps_by_threads_and_call", {})}):
            pts = [
                (int(k.split("/")[1]), v)
                for k, v in emb["cpu_qps_by_threads_and_call"].items()
                if k.startswith(key + "/")
            ]
            threads = key.rstrip("t")
            axes[0].plot(
                [p[0] for p in pts], [p[1] for p in pts], "s--", label=f"MiniLM on CPU, {threads} threads"
            )
    axes[0].set(
        xscale="log", yscale="log", xlabel="questions per embed call", ylabel="questions/s", title="embedding"
    )
    axes[0].legend(fontsize=8)
    gen = report.get("batching", {})
    if "by_batch" in gen:
        xs = [int(k) for k in gen["by_batch"]]
        axes[1].plot(xs, [v["tokens_per_s"] for v in gen["by_batch"].values()], "o-", label="HFCausalLM bf16")
    axes[1].set(
        xscale="log",
        yscale="log",
        xlabel="requests per generate call",
        ylabel="new tokens/s",
        title=f"generation ({gen.get('params', '?')} params)",
    )
    axes[1].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


SECTIONS = ["env", "nvml", "embedder", "faq", "causal", "batching", "oom_split", "int8"]
#: sections that use what an earlier one loaded (its models, kept in the run's state)
NEEDS = {"faq": "embedder", "oom_split": "batching", "int8": "batching"}


def missing_needs(sections: list[str]) -> list[str]:
    """Why ``sections`` cannot run in this order: each section whose prerequisite is not before it."""
    return [
        f"{name} needs {NEEDS[name]} before it"
        for i, name in enumerate(sections)
        if name in NEEDS and NEEDS[name] not in sections[:i]
    ]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m pipeline.devtools.gpu_check", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--json", type=Path, default=Path("gpu_check.json"), help="where the report goes")
    ap.add_argument("--plot", type=Path, default=None, help="a PNG of the throughput curves")
    ap.add_argument(
        "--embedder", default=None, help="sentence-transformers folder (default: the packaged MiniLM)"
    )
    ap.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated subset, in this order")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes (the test suite runs this on the CPU)")
    args = ap.parse_args(argv)
    sections = [s for s in args.sections.split(",") if s]
    unknown = [s for s in sections if s not in SECTIONS]
    if unknown:
        print(f"gpu_check: unknown sections {unknown}; choose from {SECTIONS}", file=sys.stderr)
        return 2
    unmet = missing_needs(sections)
    if unmet:
        print(f"gpu_check: {'; '.join(unmet)} (--sections runs them in the order given)", file=sys.stderr)
        return 2
    report = run(SMOKE if args.smoke else FULL, args.embedder or default_embedder_path(), sections)
    args.json.write_text(json.dumps(report, indent=2, default=str))
    if args.plot is not None:
        plot(report, args.plot)
    failed = [s for s in sections if "error" in report[s]]
    _say(f"report {args.json}; sections failed: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
