"""HFCausalLM on a tiny random-weight Llama written by build_tiny_causal_lm and loaded the real way."""

from __future__ import annotations

import json
import shutil
import weakref
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
import torch

from models.base import ChatMessage, ModelInput, ModelOutput
from models.exceptions import ModelError, ModelLoadError, ModelOutOfMemoryError
from models.hf_causal import HFCausalLM
from models.tiny import build_tiny_causal_lm
from pipeline.isolation import RetryPolicy, run_isolated
from tests.model_helpers import ask, one_torch_thread  # noqa: F401 - an autouse fixture


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_causal_lm(tmp_path_factory.mktemp("tiny-lm"))


@pytest.fixture(scope="module")
def lm(tiny_dir: Path) -> HFCausalLM:
    model = HFCausalLM(tiny_dir, name="tiny", max_batch_size=8)
    model.load()
    return model


PROMPTS = [
    "hi",
    "my card was declined twice today at the shop, what can I do",
    "how do I change the pin code on my new debit card before I travel abroad next week " * 3,
    "balance?",
]


def test_tiny_model_is_about_one_million_parameters(tiny_dir: Path) -> None:
    config = json.loads((tiny_dir / "config.json").read_text())
    assert 500_000 < config["surge_num_parameters"] < 2_000_000
    assert (tiny_dir / "tokenizer.json").is_file()


def test_params_target_sets_the_size(tmp_path: Path) -> None:
    folder = build_tiny_causal_lm(tmp_path, params_target=3_000_000)
    n = json.loads((folder / "config.json").read_text())["surge_num_parameters"]
    assert abs(n - 3_000_000) / 3_000_000 < 0.15


def test_version_covers_config_and_weights_and_is_known_before_loading(
    lm: HFCausalLM, tiny_dir: Path, tmp_path: Path
) -> None:
    assert lm.version.startswith("tiny@") and len(lm.version) == len("tiny@") + 8
    # the intake keys its cache by the version without loading the model: the same string
    assert HFCausalLM(tiny_dir, name="tiny").peek_version() == lm.version
    # new weights under the same config are a new version (a model fix never serves old answers)
    import shutil

    copy = tmp_path / "fixed"
    shutil.copytree(tiny_dir, copy)
    weights = next(p for p in copy.iterdir() if p.suffix == ".safetensors")
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF
    weights.write_bytes(bytes(data))
    assert HFCausalLM(copy, name="tiny").peek_version() != lm.version


def test_batch_of_different_lengths_gives_one_output_each_within_max_tokens(lm: HFCausalLM) -> None:
    limits = [3, 7, 5, 1]
    outs = lm.infer([ask(p, max_tokens=n) for p, n in zip(PROMPTS, limits, strict=True)])
    assert len(outs) == len(PROMPTS)
    prompt_lengths = [o.extra["prompt_tokens"] for o in outs]
    assert len(set(prompt_lengths)) == len(PROMPTS)  # really different lengths, padded together
    for out, limit in zip(outs, limits, strict=True):
        n = out.extra["completion_tokens"]
        assert isinstance(n, int) and n <= limit
        assert out.finish_reason == ("length" if n == limit else "stop")
        assert out.logprobs is None
    assert any(o.finish_reason == "length" for o in outs)


def test_left_padding_gives_the_same_greedy_answer_as_alone(lm: HFCausalLM) -> None:
    batch = [ask(p, max_tokens=6) for p in PROMPTS]
    together = lm.infer(batch)
    alone = [lm.infer([inp])[0] for inp in batch]
    assert [o.answer for o in together] == [o.answer for o in alone]


def test_greedy_is_deterministic(lm: HFCausalLM) -> None:
    batch = [ask(p, max_tokens=8) for p in PROMPTS]
    assert [o.answer for o in lm.infer(batch)] == [o.answer for o in lm.infer(batch)]


def test_logprobs_when_asked_one_per_token_and_not_positive(lm: HFCausalLM) -> None:
    outs = lm.infer([ask(PROMPTS[0], max_tokens=6, logprobs=True), ask(PROMPTS[1], max_tokens=4)])
    first, second = outs
    assert first.logprobs is not None
    assert len(first.logprobs) == first.extra["completion_tokens"]
    assert all(lp <= 0.0 for lp in first.logprobs)
    assert second.logprobs is None


def test_mixed_temperatures_keep_greedy_rows_greedy(lm: HFCausalLM) -> None:
    greedy = [ask(p, max_tokens=6) for p in PROMPTS[:2]]
    expected = [o.answer for o in lm.infer(greedy)]
    mixed = [greedy[0], ask("tell me about fees", max_tokens=6, temperature=1.3, logprobs=True), greedy[1]]
    outs = lm.infer(mixed)
    assert [outs[0].answer, outs[2].answer] == expected
    assert outs[1].extra["completion_tokens"] <= 6
    assert outs[1].logprobs is not None and all(lp <= 0.0 for lp in outs[1].logprobs)


def test_batches_above_max_batch_size_run_in_chunks(tiny_dir: Path, lm: HFCausalLM) -> None:
    small = HFCausalLM(tiny_dir, name="tiny", max_batch_size=2)
    small.load()
    batch = [ask(p, max_tokens=4) for p in [*PROMPTS, "one more"]]
    assert [o.answer for o in small.infer(batch)] == [o.answer for o in lm.infer(batch)]


def test_plain_role_join_when_the_tokenizer_has_no_chat_template(tiny_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "no-template"
    shutil.copytree(tiny_dir, folder)
    (folder / "chat_template.jinja").unlink()
    model = HFCausalLM(folder)
    model.load()
    inp = ModelInput(messages=(ChatMessage("system", "be brief"), ChatMessage("user", "hello")), max_tokens=3)
    assert model.render_prompt(inp) == "system: be brief\nuser: hello\nassistant:"
    (out,) = model.infer([inp])
    assert out.extra["completion_tokens"] <= 3


def test_missing_folder_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="does not exist"):
        HFCausalLM(tmp_path / "nowhere").load()


def test_folder_without_config_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"config\.json"):
        HFCausalLM(tmp_path).load()


def test_corrupt_weights_are_a_load_error(tiny_dir: Path, tmp_path: Path) -> None:
    folder = tmp_path / "corrupt"
    shutil.copytree(tiny_dir, folder)
    (folder / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(ModelLoadError, match="cannot load"):
        HFCausalLM(folder).load()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_8bit_without_cuda_is_a_load_error(tiny_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="needs CUDA"):
        HFCausalLM(tiny_dir, load_in_8bit=True).load()


def test_infer_before_load_is_a_model_error(tiny_dir: Path) -> None:
    with pytest.raises(ModelError, match="not loaded"):
        HFCausalLM(tiny_dir).infer([ask("hi")])


def test_unknown_dtype_is_refused(tiny_dir: Path) -> None:
    with pytest.raises(ModelLoadError, match="dtype"):
        HFCausalLM(tiny_dir, dtype="float8")


def test_intake_and_inference_key_an_hf_answer_alike(tiny_dir: Path) -> None:
    """With the ``hf`` backend the intake keys its exact cache before the model is loaded (by
    ``peek_version``) and inference stores answers after (by ``version``), both through
    ``pipeline.keys.scope_of`` with the served name (not the folder path): the keys must agree, or
    the intake's cache never hits what inference stored."""
    from models.registry import build_model
    from pipeline.keys import cache_key, scope_of
    from pipeline.records import InferenceRequest
    from pipeline.settings import Settings

    s = Settings.load(model="hf", model_path=str(tiny_dir))
    req = InferenceRequest.model_validate(
        {"request_id": "r1", "user_id": "u1", "prompt": "How do I freeze my card?", "max_tokens": 8}
    )
    intake_model = build_model(s)  # the intake never loads it
    intake_key = cache_key(req.text(), scope_of(req, s.served_model, intake_model.peek_version()))
    served = build_model(s)
    served.load()
    inp = ModelInput(tuple(ChatMessage(m.role, m.content) for m in req.chat()), max_tokens=req.max_tokens)
    inference_key = cache_key(inp.text, scope_of(req, s.served_model, served.version))
    assert intake_key == inference_key
    assert str(tiny_dir) not in s.served_model  # a folder path would tie answers to where it is mounted


class _Hog:
    """Stands for the tensors (the batch's KV cache) a failed ``generate`` call had allocated."""


def test_out_of_memory_frees_the_failed_calls_tensors_before_the_halves_run(
    tiny_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A CUDA out-of-memory error's traceback holds the failed call's frames and their tensors. If the
    backend's ModelOutOfMemoryError kept it (raised inside the except block, or chained), the batch's
    KV cache would stay allocated while run_isolated tries the halves, and they would run out of memory
    too (found on an H200: docs/architecture.md, "Models on a GPU")."""
    model = HFCausalLM(tiny_dir, name="tiny", max_batch_size=8)
    model.load()
    real_generate = model._model.generate
    hogs: list[weakref.ref[_Hog]] = []
    sizes: list[int] = []

    def generate(**kw: Any) -> Any:
        n = int(kw["input_ids"].shape[0])
        sizes.append(n)
        if n > 1:
            hog = _Hog()
            hogs.append(weakref.ref(hog))
            raise torch.cuda.OutOfMemoryError(f"CUDA out of memory. Tried to allocate {n} GiB")
        return real_generate(**kw)

    monkeypatch.setattr(model._model, "generate", generate)
    alive_at_each_call: list[int] = []

    def infer(batch: Sequence[ModelInput]) -> list[ModelOutput]:
        alive_at_each_call.append(sum(ref() is not None for ref in hogs))
        return model.infer(batch)

    results = run_isolated([ask(p, max_tokens=3) for p in PROMPTS], infer, RetryPolicy(attempts=1))
    assert sizes == [4, 2, 1, 1, 2, 1, 1]
    assert not [r for r in results if isinstance(r, ModelError)]
    assert alive_at_each_call == [0] * 7
    with pytest.raises(ModelOutOfMemoryError) as info:
        model.infer([ask(p, max_tokens=3) for p in PROMPTS[:2]])
    assert info.value.batch_size == 2 and info.value.__cause__ is None and info.value.__context__ is None


def test_a_folder_that_holds_no_model_stops_the_worker_in_one_line_before_topics(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``SURGE_MODEL=hf`` with a missing folder, or one of another kind, ended the worker's start
    in a FileNotFoundError traceback, after it had created its topics."""
    from pipeline import cli

    (tmp_path / "not-a-model").mkdir()
    (tmp_path / "not-a-model" / "faq_weights.npz").write_bytes(b"x")
    monkeypatch.setenv("SURGE_BROKER", "kafka://127.0.0.1:1")  # never reached: refused before
    monkeypatch.setenv("SURGE_MODEL", "hf")
    for folder in (tmp_path / "missing", tmp_path / "not-a-model"):
        monkeypatch.setenv("SURGE_MODEL_PATH", str(folder))
        with pytest.raises(ModelLoadError, match="not a Hugging Face model folder"):
            HFCausalLM(folder, name="x").peek_version()
        assert cli.main(["worker", "--role", "all"]) == 2
        err = capsys.readouterr().err
        assert "ModelLoadError" in err and "config.json" in err and "Traceback" not in err
