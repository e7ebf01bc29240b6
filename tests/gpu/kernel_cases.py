"""What the bf16 and the fp8 fold-kernel GPU tests share: the shapes, the error bound and a record
of the Triton launches the dispatcher makes."""

from __future__ import annotations

import pytest

from foldckpt.runtime.kernels.reference import MlaDims

K = 1536
# Kimi-K3 TP16 / TP8 / TP4 and DeepSeek-V3 TP8 fold shapes.
SHAPES = tuple(MlaDims(h).fold_rows for h in (6, 12, 24, 16))
# The bf16 output rounding alone gives 1e-3 to 1.7e-3 (against fp64 of the stored weight); a wrong
# tile, a lost split or a wrong scale gives O(1).
MAX_RELERR = 4e-3


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
