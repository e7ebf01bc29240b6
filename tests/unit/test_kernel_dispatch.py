"""CPU tests of the fold GEMM dispatcher, the pre-route threshold and the shipped tuning tables."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from foldckpt.errors import FoldckptError
from foldckpt.runtime.kernels import fold_gemm, fold_route_max_tokens, gpu_key, warmup_fold_gemm
from foldckpt.runtime.kernels.device import gpu_key_from_name
from foldckpt.runtime.kernels.tuning import (
    CPU_FOLD_MAX_TOKENS,
    ENV_FOLD_MAX_TOKENS,
    TRITON_MAX_M,
    _crossover,
    config_dir,
    load_table,
    parse_table,
)

CPU = torch.device("cpu")


def _doc(shapes: list[tuple[int, int]]) -> dict:
    """A minimal valid table document with one bucket per shape."""
    bucket = {"m_max": 16, "backend": "triton", "block_m": 16, "block_n": 64, "block_k": 128, "split_k": 4}
    bucket |= {"num_warps": 4, "num_stages": 4, "use_tma": False, "rows_per_program": 0, "pdl": True}
    bucket |= {"rope_epilogue": True}
    return {
        "meta": {"gpu": "nvidia_test"},
        "shape": [{"n": n, "k": 1536, "fold_max_tokens": t, "bucket": [dict(bucket)]} for n, t in shapes],
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cpu_fold_gemm_matches_linear(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(96, 64, generator=gen).to(dtype)
    fused = torch.randn(5, 80, generator=gen).to(dtype)
    x = fused[:, :64]  # strided row view
    torch.testing.assert_close(fold_gemm(x, w), F.linear(x, w))
    out_buf = torch.full((5, 100), float("nan"), dtype=dtype)
    out = out_buf[:, 2:98]
    assert fold_gemm(x, w, out=out).data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, F.linear(x, w))
    assert torch.isnan(out_buf[:, :2]).all() and torch.isnan(out_buf[:, 98:]).all()


def test_fold_gemm_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="not \\[M, K\\]"):
        fold_gemm(torch.randn(2, 3), torch.randn(4, 5))
    with pytest.raises(ValueError, match="out"):
        fold_gemm(torch.randn(2, 3), torch.randn(4, 3), out=torch.empty(2, 5))


def test_warmup_is_a_noop_on_cpu() -> None:
    warmup_fold_gemm(torch.randn(8, 4), 256)


def test_route_default_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_FOLD_MAX_TOKENS, raising=False)
    assert fold_route_max_tokens(6912, 1536, CPU) == CPU_FOLD_MAX_TOKENS == 256


def test_route_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_FOLD_MAX_TOKENS, "48")
    assert fold_route_max_tokens(6912, 1536, CPU) == 48
    monkeypatch.setenv(ENV_FOLD_MAX_TOKENS, " ")
    assert fold_route_max_tokens(6912, 1536, CPU) == CPU_FOLD_MAX_TOKENS
    for bad in ("lots", "-1", "1.5"):
        monkeypatch.setenv(ENV_FOLD_MAX_TOKENS, bad)
        with pytest.raises(FoldckptError, match=ENV_FOLD_MAX_TOKENS):
            fold_route_max_tokens(6912, 1536, CPU)


@pytest.mark.parametrize(
    ("name", "rocm", "key"),
    [
        ("NVIDIA H200", False, "nvidia_h200"),
        ("NVIDIA H100 80GB HBM3", False, "nvidia_h100"),
        ("NVIDIA H100 PCIe", False, "nvidia_h100_pcie"),
        ("NVIDIA H200 NVL", False, "nvidia_h200_nvl"),
        ("NVIDIA B200", False, "nvidia_b200"),
        ("AMD Instinct MI355X", True, "amd_mi355x"),
        ("AMD Instinct MI300X", True, "amd_mi300x"),
        ("Some Future GPU 9", False, "nvidia_some_future_gpu_9"),
    ],
)
def test_gpu_key_from_name(name: str, rocm: bool, key: str) -> None:
    assert gpu_key_from_name(name, rocm=rocm) == key


def test_gpu_key_cpu() -> None:
    assert gpu_key(CPU) == "cpu"


def test_shipped_tables_parse_with_required_keys() -> None:
    paths = sorted(config_dir().glob("*.toml"))
    assert paths, f"no tuning table under {config_dir()}"
    for path in paths:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
        table = load_table(path.stem)
        assert table is not None and table.gpu == path.stem
        assert {"gpu", "device_name", "torch", "triton", "date", "copy_bandwidth_tb_s"} <= data["meta"].keys()
        assert table.shapes, path
        for entry in table.shapes.values():
            assert entry.fold_max_tokens >= 0
            assert entry.buckets[0].m_max >= 1 and entry.buckets[-1].m_max == TRITON_MAX_M
            for bucket in entry.buckets:
                assert bucket.config.fits(entry.k)


def test_parse_table_rejects_bad_documents() -> None:
    parse_table(_doc([(6912, 224)]), "ok")
    missing = _doc([(6912, 224)])
    del missing["shape"][0]["bucket"][0]["split_k"]
    with pytest.raises(FoldckptError, match="split_k"):
        parse_table(missing, "missing")
    bad_backend = _doc([(6912, 224)])
    bad_backend["shape"][0]["bucket"][0]["backend"] = "cutlass"
    with pytest.raises(FoldckptError, match="backend"):
        parse_table(bad_backend, "bad")
    no_fit = _doc([(6912, 224)])
    no_fit["shape"][0]["bucket"][0]["split_k"] = 5
    with pytest.raises(FoldckptError, match="multiple"):
        parse_table(no_fit, "nofit")
    pdl_as_int = _doc([(6912, 224)])
    pdl_as_int["shape"][0]["bucket"][0]["pdl"] = 1
    with pytest.raises(FoldckptError, match="'pdl' has 1"):
        parse_table(pdl_as_int, "pdl")


def test_crossover_uses_measured_or_conservative_neighbour() -> None:
    table = parse_table(_doc([(3456, 256), (6912, 224), (13824, 192)]), "t")
    assert _crossover(table, 6912, 1536) == 224
    assert _crossover(table, 4608, 1536) == 224  # min of the neighbours 3456 and 6912
    assert _crossover(table, 9216, 1536) == 192  # min of 6912 and 13824
    assert _crossover(table, 1152, 1536) == 256  # below every measured n: the nearest
    assert _crossover(table, 27648, 1536) == 192
    assert _crossover(table, 6912, 1024) is None  # another k: nothing measured


def test_import_needs_no_triton() -> None:
    """The package and the CPU path work where Triton is not installed (CI)."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import torch\n"
        "from foldckpt.runtime.kernels import fold_gemm\n"
        "y = fold_gemm(torch.ones(2, 8), torch.ones(3, 8))\n"
        "assert y.shape == (2, 3) and float(y[0, 0]) == 8.0\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])
