"""``convert --device cuda``: the fold computed on a GPU is the same algorithm as on the CPU.

Which bugs these catch: TF32 (or bf16) accumulation on the GPU (a fold off by more than one
rounding of fp64: ``verify --deep`` fails), a fold rounded twice on its way back to the host, heads
or rows reordered by the device path (the CPU fold differs in more than a few ties, or by more
than two fp32 accumulation orders can), and a manifest that does not say where the fold was made.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from foldckpt.convert import ConvertOptions, convert
from foldckpt.format.manifest import SourceTensor, read_manifest
from foldckpt.convert.plan import plan_conversion
from foldckpt.io.safetensors_format import read_header
from foldckpt.tensors import read_tensor
from foldckpt.model.synthetic import make_checkpoint
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
    nope = plan_conversion(model).geometry.qk_nope_head_dim
    for name, tensor in manifest.tensors.items():
        infos = [read_header(out / tensor.file).tensors[name] for out in (tmp_path / "cpu", tmp_path / "gpu")]
        on_cpu, on_gpu = (read_tensor(out / tensor.file, info) for out, info in zip((tmp_path / "cpu", tmp_path / "gpu"), infos))
        ulps = (on_cpu.view(torch.int16).int() - on_gpu.view(torch.int16).int()).abs()
        assert float((ulps == 0).float().mean()) > 0.99, name  # another accumulation order may round a tie the other way
        # Beyond ties, two fp32 sums of the same P products differ by at most 2·P·2^-24·Σ|products|:
        # that, plus one bf16 ulp, where the sum cancels.
        magnitude = torch.maximum(on_cpu.double().abs(), on_gpu.double().abs())
        ulp = torch.where(magnitude > 0, 2.0 ** (torch.floor(torch.log2(magnitude)) - 7), 0.0)
        bound = ulp + 2 * nope * 2.0**-24 * _abs_product_sums(model, tensor.sources, len(tensor.head_blake3), nope)
        assert bool(((on_cpu.double() - on_gpu.double()).abs() <= bound).all()), name


def _abs_product_sums(model: Path, sources: tuple[SourceTensor, ...], heads: int, nope: int) -> torch.Tensor:
    """``Σ_p |W_UK[h][p, l]| · |W_qb_nope[h][p, k]|`` for each element of the fold's ql_nope rows, 0 for
    its q_pe rows (copies), in fp64, from the source weights as safetensors reads them (fp8 ones
    times their 128x128 block scales)."""
    weights = {}
    for source in sources:
        with safe_open(str(model / source.file), "pt") as handle:
            weights[source.name] = handle.get_tensor(source.name).double()

    def weight(suffix: str) -> torch.Tensor:
        name = next(n for n in weights if n.endswith(f"{suffix}.weight"))
        scale = weights.get(f"{name}_scale_inv")
        value = weights[name]
        if scale is not None:
            rows, cols = value.shape
            value = value * scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
        return value.abs()

    q_b, kv_b = weight("q_b_proj"), weight("kv_b_proj")
    q_heads, kv_heads = q_b.reshape(heads, -1, q_b.shape[1]), kv_b.reshape(heads, -1, kv_b.shape[1])
    sums = torch.bmm(kv_heads[:, :nope].transpose(1, 2), q_heads[:, :nope])  # [H, L, Lq]
    rope = torch.zeros(heads, q_heads.shape[1] - nope, q_b.shape[1], dtype=torch.float64)
    return torch.cat([sums, rope], dim=1).reshape(-1, q_b.shape[1])


def test_auto_folds_on_the_gpu_when_torch_sees_one(cuda: torch.device, tmp_path: Path) -> None:
    model = make_checkpoint(tmp_path / "model", "deepseek_v3")
    assert convert(model, tmp_path / "out", ConvertOptions(progress=False, device="auto")).fold_device == "cuda"
