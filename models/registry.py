"""Build the configured model backend from :class:`Settings` (called by agents/worker.py)."""

from __future__ import annotations

from models.base import ModelBackend
from pipeline.settings import Settings


def apply_num_threads(settings: Settings) -> None:
    """``SURGE_MODEL_NUM_THREADS``: torch's CPU threads for this process; 0 means every core but
    one (at least one), so the event loop (intake, Kafka clients) always has a core of its own.

    Process-wide: the answer model and the embedder share them; numpy's BLAS gets one thread.
    Torch's default (every core) makes its spinning threads fight the event loop: on a 2-core box
    the intake then becomes the bottleneck of the whole worker.
    """
    import os

    import torch

    threads = settings.model_num_threads or max(1, (os.cpu_count() or 2) - 1)
    torch.set_num_threads(threads)
    # numpy's BLAS (the semantic index, the FAQ answerer's neighbours) does small products that one
    # thread does best; its default pool of one thread per core spins between calls, and on the
    # 2-core machine took two thirds of a core from a worker at 30 requests/s
    from threadpoolctl import threadpool_limits

    threadpool_limits(limits=1, user_api="blas")


def cap_primitive_cache(settings: Settings) -> None:
    """``SURGE_ONEDNN_PRIMITIVE_CACHE_ENTRIES``: how many compiled kernels oneDNN keeps in this
    process (docs/architecture.md, "Threads and the GIL").

    Process-wide, and read by oneDNN once, when it first compiles a kernel: so this runs before any
    model or the embedder is loaded (tracing the embedder already runs it). torch has no call for it,
    only oneDNN's environment variable, which this sets (the setting wins over a value already there).
    """
    import os

    os.environ["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(settings.onednn_primitive_cache_entries)


def build_model(settings: Settings) -> ModelBackend:
    """The answer model named by ``settings.model`` (not loaded yet: the worker calls ``load``),
    with torch's thread count and oneDNN's kernel cache set from the settings first."""
    apply_num_threads(settings)
    cap_primitive_cache(settings)
    if settings.model == "faq":
        return build_faq(settings)
    if settings.model == "echo":
        from models.echo import EchoModel

        return EchoModel(
            delay_ms=settings.echo_delay_ms,
            per_item_ms=settings.echo_per_item_ms,
            poison=settings.echo_poison,
        )
    if settings.model == "hf":
        from models.hf_causal import HFCausalLM

        assert settings.model_path is not None
        return HFCausalLM(
            settings.model_path,
            device_map=settings.model_device_map,
            dtype=settings.model_dtype,
            num_threads=settings.model_num_threads or None,
        )
    from models.remote import RemoteOpenAIModel

    assert settings.remote_base_url is not None
    return RemoteOpenAIModel(
        settings.remote_base_url,
        settings.remote_model,
        api_key=settings.remote_api_key,
        timeout_s=settings.remote_timeout_s,
    )


def build_faq(settings: Settings) -> ModelBackend:
    """The FAQ answerer: the default model, and the template answerer under degradation level 3."""
    from models.faq import FAQAnswerer

    return FAQAnswerer(
        settings.faq_data_dir,
        confidence_floor=settings.faq_confidence_floor,
        template_floor=settings.faq_template_confidence_floor,
    )
