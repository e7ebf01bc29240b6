"""Fixtures for the GPU tests (run on the device machine; CI has no GPU and skips them)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture
def cuda() -> torch.device:
    """The CUDA device, or a skip where there is none."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    return torch.device("cuda")


@pytest.fixture
def gen(cuda: torch.device) -> torch.Generator:
    """A seeded CUDA generator: fresh random inputs per test, reproducible per run."""
    return torch.Generator(device=cuda).manual_seed(1234)
