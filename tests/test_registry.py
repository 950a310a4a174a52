"""models/registry.py: the configured backend, and SURGE_MODEL_NUM_THREADS reaching torch."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch

from models.echo import EchoModel
from models.hf_causal import HFCausalLM
from models.registry import build_model
from pipeline.settings import Settings


@pytest.fixture(autouse=True)
def keep_torch_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[int]:
    """Every test starts from the defaults and leaves torch's thread count as it found it."""
    for name in list(os.environ):
        if name.upper().startswith("SURGE_"):
            monkeypatch.delenv(name)
    before = torch.get_num_threads()
    yield before
    torch.set_num_threads(before)


def test_model_num_threads_sets_torch_threads(keep_torch_threads: int) -> None:
    wanted = 2 if keep_torch_threads == 1 else 1
    model = build_model(Settings.load(model="echo", model_num_threads=wanted))
    assert isinstance(model, EchoModel)
    assert torch.get_num_threads() == wanted


def test_zero_leaves_one_core_to_the_event_loop(keep_torch_threads: int) -> None:
    build_model(Settings.load(model="echo", model_num_threads=0))
    assert torch.get_num_threads() == max(1, (os.cpu_count() or 2) - 1)


def test_hf_model_gets_the_thread_count_for_its_load(tmp_path: os.PathLike[str]) -> None:
    model = build_model(Settings.load(model="hf", model_path=str(tmp_path), model_num_threads=1))
    assert isinstance(model, HFCausalLM) and model.num_threads == 1
    unset = build_model(Settings.load(model="hf", model_path=str(tmp_path)))
    assert isinstance(unset, HFCausalLM) and unset.num_threads is None
