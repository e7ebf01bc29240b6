"""``convert --device cuda``: the fold computed on a GPU is the same algorithm as on the CPU.

Which bugs these catch: TF32 (or bf16) accumulation on the GPU (a fold off by more than one
rounding of fp64: ``verify --deep`` fails), a fold rounded twice on its way back to the host, heads
or rows reordered by the device path (the CPU fold differs in more than a few ties), and a manifest
that does not say where the fold was made.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from foldckpt.convert import ConvertOptions, convert
from foldckpt.manifest import read_manifest
from foldckpt.safetensors_format import read_header, read_tensor
from foldckpt.synthetic import make_checkpoint
from foldckpt.verify import VerifyOptions, verify

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("family", ["kimi_k3", "deepseek_v3_fp8"])
def test_a_gpu_fold_is_one_rounding_of_fp64_and_matches_the_cpu_fold(cuda: torch.device, tmp_path: Path, family: str) -> None:
    model = make_checkpoint(tmp_path / "model", family)
    cpu = convert(model, tmp_path / "cpu", ConvertOptions(progress=False))
    gpu = convert(model, tmp_path / "gpu", ConvertOptions(progress=False, device="cuda"))
    assert (cpu.fold_device, gpu.fold_device) == ("cpu", "cuda")
    assert read_manifest(tmp_path / "gpu").parameters["fold_device"] == "cuda"
    report = verify(tmp_path / "gpu", VerifyOptions(level="deep", progress=False))
    assert report.ok, report.to_dict()
    manifest = read_manifest(tmp_path / "gpu")
    for name, tensor in manifest.tensors.items():
        infos = [read_header(out / tensor.file).tensors[name] for out in (tmp_path / "cpu", tmp_path / "gpu")]
        on_cpu, on_gpu = (read_tensor(out / tensor.file, info) for out, info in zip((tmp_path / "cpu", tmp_path / "gpu"), infos))
        ulps = (on_cpu.view(torch.int16).int() - on_gpu.view(torch.int16).int()).abs()
        assert int(ulps.max()) <= 1, name  # another accumulation order may round a tie the other way
        assert float((ulps == 0).float().mean()) > 0.99, name


def test_auto_folds_on_the_gpu_when_torch_sees_one(cuda: torch.device, tmp_path: Path) -> None:
    model = make_checkpoint(tmp_path / "model", "deepseek_v3")
    assert convert(model, tmp_path / "out", ConvertOptions(progress=False, device="auto")).fold_device == "cuda"
