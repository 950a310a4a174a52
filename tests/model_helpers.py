"""Helpers shared by the model backend tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from models.base import ChatMessage, ModelInput


def ask(text: str, **kw: object) -> ModelInput:
    """A one-message ModelInput."""
    return ModelInput(messages=(ChatMessage("user", text),), **kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """One torch thread for the module: the same numerics as a server started with
    OMP_NUM_THREADS=1, and on a shared 2-core box torch's spinning intra-op threads make tiny
    matmuls 10-100x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
