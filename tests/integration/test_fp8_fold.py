"""``convert --fold-dtype fp8`` on real files, judged against an fp64 reference written here.

Which bugs these catch: a scale that is not ``amax(|row|)/448`` of the exact row (per head block
instead of per row, from the bf16-rounded fold, off by a factor), values rounded twice or not to
the nearest e4m3 value, rows of the scale out of step with the fold's rows, a scale tensor missing
from the manifest's hash tree (a flipped scale byte would serve), and a deep check that lets a
value two e4m3 steps off through.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from foldckpt.convert import ConvertOptions
from foldckpt.errors import FoldckptError
from foldckpt.format.manifest import read_manifest, write_manifest
from foldckpt.io.hashing import head_digests
from foldckpt.runtime.loader import open_fold_set
from tests.integration.test_verify import Converted, failed_level, flip_byte, rewrite_tensor, run_verify, tensor_info
from tests.unit.test_fold import fp64_fold_of_head

FP8 = ConvertOptions(progress=False, fold_dtype="fp8")
# Every finite e4m3fn value, decoded by torch from its 256 bit patterns (0x7f / 0xff are NaN).
E4M3_GRID = torch.unique(
    torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)
)
E4M3_GRID = E4M3_GRID[torch.isfinite(E4M3_GRID)]


def _nearest_e4m3(x: torch.Tensor) -> torch.Tensor:
    """The e4m3 grid value nearest to each element (the distance is what is compared)."""
    index = torch.bucketize(x, E4M3_GRID).clamp(1, len(E4M3_GRID) - 1)
    low, high = E4M3_GRID[index - 1], E4M3_GRID[index]
    return torch.where((x - low).abs() <= (high - x).abs(), low, high)


@pytest.mark.parametrize("family", ["kimi_k3", "deepseek_v3", "deepseek_v3_fp8"])
def test_an_fp8_fold_is_the_nearest_e4m3_of_the_fp64_fold_over_its_row_scale(converted: Converted, family: str) -> None:
    model_dir, out_dir = converted(family, FP8)
    manifest = read_manifest(out_dir)
    g = manifest.geometry
    assert manifest.fold_dtype == "fp8"
    for name, record in manifest.tensors.items():
        assert record.scale is not None and record.scale.name == name + "_scale"
        with safe_open(out_dir / record.file, "pt") as sidecar:
            values = sidecar.get_tensor(name)
            scale = sidecar.get_tensor(record.scale.name)
        assert values.dtype == torch.float8_e4m3fn and values.shape == g.fold_shape
        assert scale.dtype == torch.float32 and scale.shape == (g.fold_shape[0],)
        sources = {source.name: source for source in record.sources}
        q_b, kv_b = (_source(out_dir, sources, record.layer_prefix, proj) for proj in ("q_b_proj", "kv_b_proj"))
        for h in range(g.num_heads):
            exact = fp64_fold_of_head(q_b, kv_b, g, h)  # [L+R, Lq]
            rows = slice(h * g.fold_head_dim, (h + 1) * g.fold_head_dim)
            want_scale = exact.abs().amax(dim=1) / 448
            assert torch.allclose(scale[rows].double(), want_scale, rtol=1e-5, atol=0), (name, h)
            target = exact / scale[rows].double().unsqueeze(1)
            got = values[rows].to(torch.float64)
            slack = (got - target).abs() - (_nearest_e4m3(target) - target).abs()
            assert float(slack.max()) <= 1e-3 * float(target.abs().max()), (name, h)  # nearest, but for fp32 ties
    assert run_verify(out_dir).ok


def _source(out_dir: Path, sources: dict, prefix: str, proj: str) -> torch.Tensor:
    """A fold input as fp64, dequantized here for fp8 sources (128x128 blocks, written independently)."""
    source = sources[f"{prefix}.self_attn.{proj}.weight"]
    with safe_open(out_dir / source.file, "pt") as shard:
        weight = shard.get_tensor(source.name)
        if weight.dtype != torch.float8_e4m3fn:
            return weight.double()
        scale_name = source.name + "_scale_inv"
        scale_file = sources[scale_name].file
    with safe_open(out_dir / scale_file, "pt") as shard:
        scale = shard.get_tensor(scale_name).double()
    full = torch.kron(scale, torch.ones(128, 128, dtype=torch.float64))[: weight.shape[0], : weight.shape[1]]
    return weight.double() * full


@pytest.mark.parametrize("tp", [2, 4])
def test_each_tensor_parallel_rank_reads_the_scales_of_its_own_heads(converted: Converted, tp: int) -> None:
    """Serving reads a rank's scales by head range; every other test reads them at TP 1, where a
    rank reading its neighbour's rows is the same read. Here each rank of 2 and 4 must get exactly
    the fp64 ``amax/448`` of its own heads (H/tp consecutive heads from rank*H/tp), and the e4m3
    rows beside them, as an independent reader (safetensors) slices them from the sidecar."""
    _, out_dir = converted("kimi_k3", FP8)
    fold_set = open_fold_set(out_dir)
    g = fold_set.geometry
    per_rank = g.num_heads // tp
    for layer in g.layers:
        record = fold_set.manifest.tensors[layer.q_fold]
        sources = {source.name: source for source in record.sources}
        q_b, kv_b = (_source(out_dir, sources, record.layer_prefix, proj) for proj in ("q_b_proj", "kv_b_proj"))
        with safe_open(out_dir / record.file, "pt") as sidecar:
            values = sidecar.get_tensor(record.name)
        for rank in range(tp):
            heads = range(rank * per_rank, (rank + 1) * per_rank)
            want = torch.cat([fp64_fold_of_head(q_b, kv_b, g, h).abs().amax(dim=1) / 448 for h in heads])
            scale = fold_set.read_scale_rows(layer, tp, rank)
            assert scale is not None and scale.dtype == torch.float32 and scale.shape == want.shape
            assert torch.allclose(scale.double(), want, rtol=1e-5, atol=0), (layer.prefix, tp, rank)
            rows = slice(heads.start * g.fold_head_dim, heads.stop * g.fold_head_dim)
            assert torch.equal(fold_set.read_rows(layer, tp, rank).view(torch.uint8), values[rows].view(torch.uint8))


def test_fp8_halves_the_fold_bytes_of_bf16(converted: Converted) -> None:
    _, bf16 = converted("kimi_k3")
    _, fp8 = converted("kimi_k3", FP8)
    g = read_manifest(fp8).geometry
    values, scales = g.fold_shape[0] * g.fold_shape[1], g.fold_shape[0] * 4
    assert read_manifest(fp8).fold_bytes() == len(read_manifest(fp8).tensors) * (values + scales)
    assert read_manifest(fp8).fold_bytes() / read_manifest(bf16).fold_bytes() == pytest.approx(0.5 + 2 / g.q_lora_rank)


def test_a_flipped_scale_byte_fails_content_and_serving_names_the_scale(converted: Converted) -> None:
    _, out_dir = converted("kimi_k3", FP8)
    manifest = read_manifest(out_dir)
    record = next(iter(manifest.tensors.values()))
    assert record.scale is not None
    info = tensor_info(out_dir / record.file, record.scale.name)
    flip_byte(out_dir / record.file, info.start + 4 * manifest.geometry.fold_head_dim * 1 + 2)  # head 1
    level = failed_level(run_verify(out_dir), "content")
    assert [(p.file, p.tensor) for p in level.problems] == [(record.file, record.scale.name)]
    assert "head(s) 1" in level.problems[0].what
    with pytest.raises(FoldckptError, match="weight_scale"):
        open_fold_set(out_dir).read_scale_rows(manifest.geometry.layers[0], 1, 0)
    assert run_verify(out_dir, "content", rank=0, tp=8).ok  # heads 0: its rows are intact


def test_deep_refuses_an_fp8_value_two_steps_off_when_every_hash_was_resealed(converted: Converted) -> None:
    _, out_dir = converted("kimi_k3", FP8)
    manifest = read_manifest(out_dir)
    name, record = next(iter(manifest.tensors.items()))

    def two_steps(t: torch.Tensor) -> torch.Tensor:
        bits = t.view(torch.uint8).clone()
        bits[3, 5] = (int(bits[3, 5]) & 0x80) | min((int(bits[3, 5]) & 0x7F) + 2, 0x7D)
        return bits.view(torch.float8_e4m3fn)

    rewrite_tensor(out_dir / record.file, tensor_info(out_dir / record.file, name), two_steps)
    data = (out_dir / record.file).read_bytes()
    info = tensor_info(out_dir / record.file, name)
    leaves = head_digests(data[info.start : info.end], manifest.geometry.num_heads)
    write_manifest(
        out_dir,
        dataclasses.replace(
            manifest, tensors={**manifest.tensors, name: dataclasses.replace(record, head_blake3=leaves)}
        ),
    )
    assert run_verify(out_dir, "content").ok  # every hash agrees ...
    level = failed_level(run_verify(out_dir), "deep")  # ... the math does not
    assert [(p.file, p.tensor) for p in level.problems] == [(record.file, name)]
    assert "1 element(s) beyond one rounding" in level.problems[0].what
