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
from foldckpt.runtime.kernels import fold_gemm, fold_route, gpu_key, warmup_fold_gemm
from foldckpt.runtime.kernels.device import gpu_key_from_name
from foldckpt.runtime.kernels.reference import MlaDims
from foldckpt.runtime.kernels.routing import ENV_FOLD_MAX_TOKENS
from foldckpt.runtime.kernels.tuning import (
    CPU_FOLD_MAX_TOKENS,
    TRITON_MAX_M,
    config_dir,
    load_table,
    parse_table,
    table_fold_max_tokens,
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
    assert fold_route(MlaDims(12), CPU).max_tokens == CPU_FOLD_MAX_TOKENS == 256


def test_route_env_override(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_FOLD_MAX_TOKENS, "48")
    assert fold_route(MlaDims(12), CPU).max_tokens == 48
    monkeypatch.setenv(ENV_FOLD_MAX_TOKENS, " ")
    assert fold_route(MlaDims(12), CPU).max_tokens == CPU_FOLD_MAX_TOKENS
    for bad in ("lots", "-1", "1.5"):
        monkeypatch.setenv(ENV_FOLD_MAX_TOKENS, bad)
        with pytest.raises(FoldckptError, match=ENV_FOLD_MAX_TOKENS):
            fold_route(MlaDims(12), CPU)


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
    assert table_fold_max_tokens(table, 6912, 1536) == 224
    assert table_fold_max_tokens(table, 4608, 1536) == 224  # min of the neighbours 3456 and 6912
    assert table_fold_max_tokens(table, 9216, 1536) == 192  # min of 6912 and 13824
    assert table_fold_max_tokens(table, 1152, 1536) == 256  # below every measured n: the nearest
    assert table_fold_max_tokens(table, 27648, 1536) == 192
    assert table_fold_max_tokens(table, 6912, 1024) is None  # another k: nothing measured


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


# --------------------------------------------------------------------------------------------
# [[q_b_proj]], [[skinny]] and the skinny fold backend: parsing, the table lookup, the dispatcher.
# --------------------------------------------------------------------------------------------
TILED = {"block_m": 16, "block_n": 64, "block_k": 128, "split_k": 1, "num_warps": 4, "num_stages": 4}
TILED |= {"use_tma": False, "rows_per_program": 0, "pdl": True, "rope_epilogue": False}


def _skinny(role: str, n: int, m_max: int, rows: int = 4, block_k: int = 512, warps: int = 1) -> dict:
    return {
        "role": role,
        "n": n,
        "k": 1536,
        "m_max": m_max,
        "rows": rows,
        "block_k": block_k,
        "num_warps": warps,
        "pdl": True,
        "us": 5.0,
    }


def _skinny_doc(n: int = 6912) -> dict:
    """A table as the tuner writes it where the skinny fold won at M <= 2 and the tiled kernel
    above: buckets (skinny 2, triton 16, torch 256), skinny tiles 1, 2, 4 for the fold and 1 for
    its q_b_proj weight, and one [[q_b_proj]] entry."""
    buckets = [
        {"m_max": 2, "backend": "skinny", **TILED, "skinny_us": 4.8},
        {"m_max": 16, "backend": "triton", **TILED, "triton_us": 6.0},
        {"m_max": TRITON_MAX_M, "backend": "torch", **TILED, "block_m": 64},
    ]
    qb_buckets = [
        {"m_max": 16, "backend": "triton", **TILED, "block_n": 32},
        {"m_max": TRITON_MAX_M, "backend": "torch", **TILED},
    ]
    return {
        "meta": {"gpu": "nvidia_test"},
        "shape": [{"n": n, "k": 1536, "fold_max_tokens": 256, "heads": 12, "bucket": buckets}],
        "q_b_proj": [{"n": n // 3, "k": 1536, "heads": 12, "bucket": qb_buckets}],
        "skinny": [
            _skinny("fold", n, 4, rows=2, block_k=256),
            _skinny("fold", n, 1),
            _skinny("fold", n, 2),
            _skinny("q_b_proj", n // 3, 1, rows=1),
        ],
    }


def test_parse_q_b_proj_sections() -> None:
    from foldckpt.runtime.kernels.tuning import q_b_proj_bucket

    table = parse_table(_skinny_doc(), "t")
    buckets = table.q_b_proj[(2304, 1536)]
    assert [(b.m_max, b.backend, b.config.block_n) for b in buckets] == [
        (16, "triton", 32),
        (TRITON_MAX_M, "torch", 64),
    ]
    assert q_b_proj_bucket(table, 2304, 1536, 1) is buckets[0]
    assert q_b_proj_bucket(table, 2304, 1536, 17) is buckets[1]
    assert q_b_proj_bucket(table, 2304, 1536, TRITON_MAX_M + 1) is None
    assert q_b_proj_bucket(table, 1152, 1536, 1) is None and q_b_proj_bucket(None, 2304, 1536, 1) is None
    assert parse_table({**_skinny_doc(), "q_b_proj": []}, "t").q_b_proj == {}
    not_a_list = _skinny_doc()
    not_a_list["q_b_proj"] = {"n": 2304}
    with pytest.raises(FoldckptError, match=r"\[\[q_b_proj\]\] must be an array"):
        parse_table(not_a_list, "t")
    twice = _skinny_doc()
    twice["q_b_proj"] = twice["q_b_proj"] * 2
    with pytest.raises(FoldckptError, match="appears twice"):
        parse_table(twice, "t")
    # The skinny backend is the fold dispatcher's; q_b_proj buckets name the baseline's tiled/cuBLAS choice.
    skinny_qb = _skinny_doc()
    skinny_qb["q_b_proj"][0]["bucket"][0]["backend"] = "skinny"
    with pytest.raises(FoldckptError, match=r"\[\[q_b_proj\]\] #0 bucket #0: backend 'skinny'"):
        parse_table(skinny_qb, "t")
    no_k = _skinny_doc()
    del no_k["q_b_proj"][0]["k"]
    with pytest.raises(FoldckptError, match="missing key 'k'"):
        parse_table(no_k, "t")


def test_parse_skinny_sections() -> None:
    from foldckpt.runtime.kernels.tuning import SkinnyConfig, skinny_config

    table = parse_table(_skinny_doc(), "t")
    fold = table.skinny[("fold", 6912, 1536)]
    assert [c.block_m for c in fold] == [1, 2, 4], "sorted by m_max whatever the file order"
    assert fold[2] == SkinnyConfig(block_m=4, rows=2, block_k=256, num_warps=1, pdl=True)
    assert table.skinny[("q_b_proj", 2304, 1536)] == (SkinnyConfig(1, 1, 512, 1, pdl=True),)
    assert [skinny_config(table, "fold", 6912, 1536, m).block_m for m in (1, 2, 3, 4)] == [1, 2, 4, 4]
    assert skinny_config(table, "fold", 6912, 1536, 5) is None
    assert skinny_config(table, "q_b_proj", 6912, 1536, 1) is None
    assert skinny_config(None, "fold", 6912, 1536, 1) is None
    for change, match in (
        ({"role": "bmm"}, "role 'bmm'"),
        ({"m_max": 32}, "m_max is outside 1..16"),
        ({"m_max": 0}, "m_max is outside 1..16"),
        ({"block_k": 1024}, "does not fit k=1536"),
        ({"rows": 3}, "powers of two"),
        ({"m_max": 3}, "powers of two"),
        ({"pdl": 1}, "'pdl' has 1"),
        ({"m_max": 2}, "appears twice"),
    ):
        doc = _skinny_doc()
        doc["skinny"][0] |= change
        with pytest.raises(FoldckptError, match=match):
            parse_table(doc, "t")
    doc = _skinny_doc()
    doc["skinny"] = {"role": "fold"}
    with pytest.raises(FoldckptError, match=r"\[\[skinny\]\] must be an array"):
        parse_table(doc, "t")


def test_parse_skinny_backend() -> None:
    parse_table(_skinny_doc(), "t")
    # A skinny bucket up to m_max needs fold tiles covering every M up to it ...
    wide = _skinny_doc()
    wide["shape"][0]["bucket"][0]["m_max"] = 8
    with pytest.raises(FoldckptError, match=r"backend 'skinny' up to m_max=8.*cover M <= 4 only"):
        parse_table(wide, "t")
    # ... from the fold's own [[skinny]] entries: q_b_proj tiles of the same n do not count.
    no_fold = _skinny_doc()
    no_fold["skinny"] = [s | {"role": "q_b_proj"} if s["role"] == "fold" else s for s in no_fold["skinny"][:1]]
    with pytest.raises(FoldckptError, match="cover M <= 0 only"):
        parse_table(no_fold, "t")
    other_n = _skinny_doc()
    for s in other_n["skinny"]:
        s["n"] = 3456
    with pytest.raises(FoldckptError, match="n=6912 k=1536 cover M <= 0"):
        parse_table(other_n, "t")
    bad = _skinny_doc()
    bad["shape"][0]["bucket"][1]["backend"] = "gemv"
    with pytest.raises(FoldckptError, match="backend 'gemv' is not one of 'triton', 'torch', 'skinny'"):
        parse_table(bad, "t")


@pytest.fixture
def test_table(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201 - GpuTable
    """``_skinny_doc`` as the table of GPU kind nvidia_test (and no table for any other kind)."""
    from foldckpt.runtime.kernels import dispatch, tuning

    table = parse_table(_skinny_doc(), "t")

    def fake(gpu: str):  # noqa: ANN202
        return table if gpu == "nvidia_test" else None

    monkeypatch.setattr(tuning, "load_table", fake)
    monkeypatch.setattr(dispatch, "load_table", fake)
    return table


def test_kernel_config_for_follows_the_table(test_table) -> None:  # noqa: ANN001
    from foldckpt.runtime.kernels.tuning import KernelConfig, SkinnyConfig, kernel_config_for

    tiles = test_table.skinny[("fold", 6912, 1536)]
    triton_bucket = test_table.shapes[(6912, 1536)].buckets[1]
    got = {m: kernel_config_for("nvidia_test", 6912, 1536, m) for m in (1, 2, 3, 16, 17, TRITON_MAX_M, 257)}
    assert got[1] == tiles[0] and got[2] == tiles[1], "skinny bucket: the fold tile for that M"
    assert isinstance(got[1], SkinnyConfig) and isinstance(got[3], KernelConfig)
    assert got[3] == got[16] == triton_bucket.config, "triton bucket: its tiled config (not the skinny tile 4)"
    assert got[17] is None and got[TRITON_MAX_M] is None and got[257] is None, "torch bucket and above"
    assert kernel_config_for("nvidia_test", 2304, 1536, 1) is None, "[[q_b_proj]] and its skinny tiles: never"
    assert kernel_config_for("nvidia_test", 6912, 1024, 1) is None, "unmeasured (n, k)"
    assert kernel_config_for("nvidia_other", 6912, 1536, 1) is None, "a GPU without a table"


def test_dispatch_picks_what_the_table_says(test_table, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """The dispatcher's choice (``_triton_config``) is the table's, read with CPU tensors standing
    in for a GPU of kind nvidia_test; fold_gemm itself on the CPU stays torch."""
    from foldckpt.runtime.kernels import dispatch
    from foldckpt.runtime.kernels.tuning import KernelConfig, SkinnyConfig

    monkeypatch.setattr(dispatch, "gpu_key", lambda device: "nvidia_test")
    w = torch.zeros(6912, 1536, dtype=torch.bfloat16)
    tiles = test_table.skinny[("fold", 6912, 1536)]
    buckets = test_table.shapes[(6912, 1536)].buckets
    for m, expected in ((1, tiles[0]), (2, tiles[1]), (3, buckets[1].config), (16, buckets[1].config), (17, None)):
        x = torch.zeros(m, 1536, dtype=torch.bfloat16)
        assert dispatch._triton_config(x, w) == expected, m
    assert isinstance(dispatch._triton_config(torch.zeros(1, 1536, dtype=torch.bfloat16), w), SkinnyConfig)
    assert isinstance(dispatch._triton_config(torch.zeros(9, 1536, dtype=torch.bfloat16), w), KernelConfig)
    # What no Triton kernel may take, whatever the table says: fp32, a misaligned row stride, M=0.
    assert dispatch._triton_config(torch.zeros(1, 1536), w.float()) is None
    assert dispatch._triton_config(torch.zeros(2, 1540, dtype=torch.bfloat16)[:, 3:1539], w) is None
    assert dispatch._triton_config(torch.zeros(0, 1536, dtype=torch.bfloat16), w) is None
    # A weight of another shape, or another GPU kind: torch (unknown GPUs unchanged).
    assert dispatch._triton_config(torch.zeros(1, 1536, dtype=torch.bfloat16), w[:3456]) is None
    monkeypatch.setattr(dispatch, "gpu_key", lambda device: "nvidia_other")
    assert dispatch._triton_config(torch.zeros(1, 1536, dtype=torch.bfloat16), w) is None
    # The CPU never launches Triton: fold_gemm is F.linear there.
    monkeypatch.setattr(dispatch, "gpu_key", lambda device: "nvidia_test")
    gen = torch.Generator().manual_seed(0)
    x, wr = torch.randn(2, 1536, generator=gen).bfloat16(), torch.randn(6912, 1536, generator=gen).bfloat16()
    assert torch.equal(fold_gemm(x, wr), F.linear(x, wr))


def test_warm_ms_covers_every_skinny_tile(test_table, monkeypatch: pytest.MonkeyPatch) -> None:  # noqa: ANN001
    """warmup_fold_gemm compiles one kernel per bucket, and in a skinny bucket one per skinny tile."""
    from foldckpt.runtime.kernels import dispatch

    monkeypatch.setattr(dispatch, "gpu_key", lambda device: "nvidia_test")
    w = torch.zeros(6912, 1536, dtype=torch.bfloat16)
    # Buckets (skinny 2, triton 16, torch 256): tiles 1 and 2 inside the skinny bucket.
    assert dispatch._warm_ms(w, TRITON_MAX_M) == [1, 2, 16, TRITON_MAX_M]
    assert dispatch._warm_ms(w, 1) == [1]
    wide = _skinny_doc()
    wide["shape"][0]["bucket"][0]["m_max"] = 4
    monkeypatch.setattr(dispatch, "load_table", lambda gpu: parse_table(wide, "t"))
    # M = 1, 2 and 3 (the first M of tile 4) compile the three tiles; 4 is that bucket's bound.
    assert dispatch._warm_ms(w, 64) == [1, 2, 3, 4, 16, 64]


def _grid_row(m: int, triton: float, torch_us: float, unfolded: float, skinny: float | None = None) -> dict:
    return {
        "n": 6912,
        "m": m,
        "triton_us": triton,
        "torch_us": torch_us,
        "skinny_us": skinny,
        "unfolded_triton_us": unfolded + 1,
        "unfolded_cublas_us": unfolded,
        "unfolded_us": unfolded,
        "q_b_proj_kernel": "cublas",
    }


def _grid(skinny: dict[int, float], fold: float = 8.0, unfolded: float = 9.0) -> list[dict]:
    from foldckpt.tune.search import GRID_M

    return [
        _grid_row(
            m,
            fold if m <= 32 else 20.0,
            fold + 1 if m <= 32 else 10.0,
            unfolded if m <= 64 else 9.5,
            skinny.get(m, 50.0) if m <= 16 else None,
        )
        for m in GRID_M
    ]


def test_decide_splits_the_first_bucket_where_skinny_wins() -> None:
    from foldckpt.tune.search import decide

    # Tiled Triton wins M <= 32 (8.0 vs torch 9.0), torch above; the skinny fold wins at M=1 and 2 only.
    backends, _, crossover = decide(_grid({1: 6.0, 2: 7.5}))
    assert backends == {2: "skinny", 16: "triton", 32: "triton", 64: "torch", 128: "torch", 256: "torch"}
    # Skinny at M=1, not at 2, again at 4: tile 2 keeps the bucket's backend, nothing merges across it.
    backends, _, _ = decide(_grid({1: 6.0, 2: 8.5, 4: 7.0}))
    assert list(backends.items())[:4] == [(1, "skinny"), (2, "triton"), (4, "skinny"), (16, "triton")]
    # The M=16 tile holds the grid points 14 and 16: skinny must win their sum.
    backends, _, _ = decide(_grid({m: 7.0 for m in (1, 2, 4, 8, 14)} | {16: 9.5}))
    assert backends[16] == "triton" and backends[8] == "skinny" and 1 not in backends
    backends, _, _ = decide(_grid({m: 7.0 for m in (1, 2, 4, 8, 14, 16)}))
    assert list(backends.items())[0] == (16, "skinny")
    # A tie is no win (the strict rule of the tiled/torch choice), and no skinny measurement no split.
    assert 1 not in decide(_grid({1: 8.0}))[0]
    assert list(decide([r | {"skinny_us": None} for r in _grid({1: 1.0})])[0]) == [16, 32, 64, 128, 256]
    # The crossover counts the skinny time where the table will run it: a fold losing at M=1 on the
    # tiled kernel (10.0 vs 9.0, beyond the 3% tolerance) routes nothing, on the skinny kernel it does.
    rows = [r | {"triton_us": 10.0} if r["m"] == 1 else r for r in _grid({})]
    assert decide(rows)[2] == 0
    assert decide([r | {"skinny_us": 7.0} if r["m"] == 1 else r for r in rows])[2] == 32


def test_tuner_buckets_round_trip_through_the_toml() -> None:
    """What the tuner writes for a skinny split parses, and kernel_config_for reads it back."""
    from foldckpt.tune.search import BUCKETS, decide, table_buckets
    from foldckpt.tune.table import toml_text

    rows = _grid({1: 6.0, 2: 7.5})
    backends, _, crossover = decide(rows)
    tiled = {b: {"m_max": b, **TILED, "block_m": min(b, 64), "triton_us": 8.0, "torch_us": 9.0} for b in BUCKETS}
    buckets = table_buckets(backends, tiled, rows)
    assert buckets[0] == {"m_max": 2, "backend": "skinny", **TILED, "triton_us": 8.0, "torch_us": 9.0, "skinny_us": 7.5}
    shape = {"n": 6912, "k": 1536, "fold_max_tokens": crossover, "heads": 12, "bucket": buckets}
    skinny = [_skinny("fold", 6912, 1), _skinny("fold", 6912, 2)]
    text = toml_text({"gpu": "nvidia_test", "device_name": "test"}, [shape], [], skinny)
    table = parse_table(tomllib.loads(text), "written")
    entry = table.shapes[(6912, 1536)]
    assert [(b.m_max, b.backend) for b in entry.buckets] == list(backends.items())
    assert entry.buckets[0].config == entry.buckets[1].config, "a skinny sub-bucket carries its bucket's tiled config"


def test_shipped_table_follows_its_measurements() -> None:
    """Every shipped shape whose grid is in docs/bench/tune_<gpu>.json has the backends and the
    threshold ``search.decide`` derives from it: the dispatcher only follows the tuner's decision."""
    import json

    from foldckpt.tune.search import decide

    checked = 0
    for path in sorted(config_dir().glob("*.toml")):
        measurements = Path(__file__).resolve().parents[2] / "docs" / "bench" / f"tune_{path.stem}.json"
        if not measurements.is_file():
            continue
        data = tomllib.loads(path.read_text(encoding="utf-8"))
        grid = json.loads(measurements.read_text(encoding="utf-8"))["grid"]
        tolerance = data["meta"].get("route_tolerance", 1.0)
        for shape in data["shape"]:
            rows = sorted((r for r in grid if r["n"] == shape["n"] and "q_b_proj_kernel" in r), key=lambda r: r["m"])
            if not rows:
                continue  # measured before the tuner recorded the q_b_proj baseline
            backends, _, crossover = decide(rows, tolerance)
            assert [(b["m_max"], b["backend"]) for b in shape["bucket"]] == list(backends.items()), shape["n"]
            assert shape["fold_max_tokens"] == crossover, shape["n"]
            checked += 1
    if (config_dir() / "nvidia_h200.toml").is_file():
        assert checked >= 3
