"""``convert --device cuda``: the fold computed on a GPU is the fold computed on the CPU, byte for byte.

Every element is its exact value rounded once (foldckpt.rounding), whichever GEMM sums it, and the
manifest does not record the device: a conversion on the GPU and one on the CPU give the same
sidecars and the same manifest sha256. Which bugs these catch: TF32, bf16 or fp32 accumulation on
the GPU that the bound does not cover, a fold rounded twice on its way back to the host, a GPU
rounding kernel that differs from the CPU's (ties, subnormals, the sign of zero), heads or rows
reordered by the device path, and a manifest that says where the fold was made.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from foldckpt.convert import ConvertOptions, convert
from foldckpt.format.manifest import file_sha256, read_manifest
from foldckpt.model.synthetic import make_checkpoint
from foldckpt.verify import VerifyOptions, verify

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(
    ("family", "fold_dtype", "full"),
    [
        ("kimi_k3", "bfloat16", True),
        ("kimi_k3", "float16", False),
        ("kimi_k3", "float32", False),
        ("deepseek_v3_fp8", "bfloat16", False),
        ("deepseek_v3_fp8", "fp8", False),
    ],
)
def test_a_gpu_fold_is_byte_for_byte_the_cpu_fold(
    cuda: torch.device, tmp_path: Path, family: str, fold_dtype: str, full: bool
) -> None:
    model = make_checkpoint(tmp_path / "model", family, full_geometry=full, layers=2 if full else None)
    cpu = convert(model, tmp_path / "cpu", ConvertOptions(progress=False, fold_dtype=fold_dtype))
    gpu = convert(model, tmp_path / "gpu", ConvertOptions(progress=False, fold_dtype=fold_dtype, device="cuda"))
    assert (cpu.fold_device, gpu.fold_device) == ("cpu", "cuda")
    manifest = read_manifest(tmp_path / "gpu")
    assert "fold_device" not in manifest.parameters
    for sidecar in manifest.sidecars:
        assert (tmp_path / "cpu" / sidecar).read_bytes() == (tmp_path / "gpu" / sidecar).read_bytes(), sidecar
    assert file_sha256(tmp_path / "cpu") == file_sha256(tmp_path / "gpu")
    report = verify(tmp_path / "gpu", VerifyOptions(level="deep", progress=False))
    assert report.ok, report.to_dict()


def test_auto_folds_on_the_gpu_when_torch_sees_one(cuda: torch.device, tmp_path: Path) -> None:
    model = make_checkpoint(tmp_path / "model", "deepseek_v3")
    assert convert(model, tmp_path / "out", ConvertOptions(progress=False, device="auto")).fold_device == "cuda"
