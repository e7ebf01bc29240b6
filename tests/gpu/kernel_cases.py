"""What the bf16 and the fp8 fold-kernel GPU tests share: the shapes, the error bound and a record
of the Triton launches the dispatcher makes."""

from __future__ import annotations

import pytest
import torch

from foldckpt.fold import quantize_fp8_rows
from foldckpt.runtime.kernels.reference import MlaDims

K = 1536
# Kimi-K3 TP16 / TP8 / TP4 and DeepSeek-V3 TP8 fold shapes.
SHAPES = tuple(MlaDims(h).fold_rows for h in (6, 12, 24, 16))
# The bf16 output rounding alone gives 1e-3 to 1.7e-3 (against fp64 of the stored weight); a wrong
# tile, a lost split or a wrong scale gives O(1).
MAX_RELERR = 4e-3


def fp8_weight(n: int, device: torch.device, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """An fp8 fold weight as convert writes it: a random fold quantized per row, and its scale."""
    return quantize_fp8_rows(torch.randn(n, K, device=device, generator=gen) / K**0.5)


def fp8_relerr(y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> float:
    """Relative error of an fp8 fold's output against fp64 of the dequantized weight (what the
    kernels compute before the one bf16 rounding of y); inf where y holds NaN or Inf."""
    ref = x.double() @ (w.double() * scale.double()[:, None]).t()
    diff = y.double() - ref
    if not torch.isfinite(diff).all():
        return float("inf")
    return (diff.norm() / ref.norm()).item()


def record_launches(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, object, bool]]:
    """Every tiled / skinny Triton fold launch from now on: (kind, config, whether a scale was passed)."""
    triton_gemm = pytest.importorskip("foldckpt.runtime.kernels.triton_gemm")
    launches: list[tuple[str, object, bool]] = []
    tiled, skinny = triton_gemm.launch_fold_gemm, triton_gemm.launch_skinny_gemm

    def launch_tiled(x, w, y, cfg, rope=None, scale=None):  # noqa: ANN001, ANN202 - mirrors the real signature
        launches.append(("tiled", cfg, scale is not None))
        tiled(x, w, y, cfg, rope, scale=scale)

    def launch_skinny(x, w, y, cfg, scale=None):  # noqa: ANN001, ANN202
        launches.append(("skinny", cfg, scale is not None))
        skinny(x, w, y, cfg, scale=scale)

    monkeypatch.setattr(triton_gemm, "launch_fold_gemm", launch_tiled)
    monkeypatch.setattr(triton_gemm, "launch_skinny_gemm", launch_skinny)
    return launches
