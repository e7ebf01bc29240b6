"""The same sources and parameters give the same sidecar bytes and the same manifest sha256 whichever
CPU GEMM path folds them: the folds are each element's exact value rounded once, and the manifest
does not record where they were made.

The two paths are real, unmocked: convert in a fresh process with this machine's defaults, and with
``ATEN_CPU_CAPABILITY=avx2`` (torch's AVX2 kernels, so no oneDNN bf16 GEMM) and ``MKL_CBWR=COMPATIBLE``
(MKL's conditional-reproducibility kernels, which sum in another order). A fold rounded from the
GEMM's own sums, as before, differed between them in a few elements per layer.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from foldckpt.format.manifest import file_sha256, read_manifest
from foldckpt.model.synthetic import make_checkpoint
from tests.conftest import run_foldckpt

OTHER_PATH = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "COMPATIBLE"}


@pytest.mark.parametrize(
    ("family", "fold_dtype", "full"), [("kimi_k3", "bfloat16", True), ("deepseek_v3_fp8", "fp8", False)]
)
def test_two_cpu_gemm_paths_give_the_same_sidecars_and_manifest_sha256(
    tmp_path: Path, family: str, fold_dtype: str, full: bool
) -> None:
    """Kimi-K3's real attention shapes in bf16; fp8 block-scaled sources folded to fp8 on small ones."""
    model = make_checkpoint(tmp_path / "model", family, full_geometry=full, layers=2, mtp_layers=0, shards=1)
    outs = []
    for name, env in (("default", {}), ("other", OTHER_PATH)):
        out = tmp_path / name
        run = run_foldckpt("convert", model, out, "--fold-dtype", fold_dtype, "-q", env={**os.environ, **env})
        assert run.returncode == 0, run.stderr
        outs.append(out)
    default, other = outs
    manifest = read_manifest(default)
    assert "fold_device" not in manifest.parameters  # where a fold was made is no part of what it is
    for sidecar in manifest.sidecars:
        assert (default / sidecar).read_bytes() == (other / sidecar).read_bytes(), sidecar
    assert file_sha256(default) == file_sha256(other)
