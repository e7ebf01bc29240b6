"""Where a routing threshold comes from, on the CPU: the one rule that turns timings into a
threshold (and that the tuner, the start-up measurement and the decode benchmark all apply), the
start-up measurement's on-disk cache (real files in a temporary cache folder) and the switch that
turns the measurement off. The GPU half (the measurement itself, the routing target) is
tests/gpu/test_routing.py."""

from __future__ import annotations

import ast
import importlib.util
import json
import logging
from pathlib import Path
from types import ModuleType

import pytest
import torch

from foldckpt.errors import FoldckptError
from foldckpt.runtime.kernels import fold_route
from foldckpt.runtime.kernels.reference import MlaDims
from foldckpt.runtime.kernels.routing import (
    AUTOTUNE_ENV,
    ENV_FOLD_MAX_TOKENS,
    autotune_enabled,
    cache_dir,
    cache_path,
    read_cached_points,
    table_route,
    write_cached_points,
)
from foldckpt.runtime.kernels.tuning import (
    CPU_FOLD_MAX_TOKENS,
    FP8_WEIGHT_DTYPE,
    ROUTE_TOLERANCE,
    decide_fold_max_tokens,
    load_table,
)
from foldckpt.tune.search import decide

REPO = Path(__file__).resolve().parents[2]
# Timings of a fold that wins clearly up to M=32, is at parity within the tolerance at M=2, and
# loses from M=64 on: (M, fold µs, unfolded µs).
WINS_TO_32 = [
    (1, 7.0, 8.0),
    (2, 8.1, 8.0),
    (4, 7.2, 8.1),
    (8, 7.3, 8.2),
    (16, 7.6, 8.4),
    (32, 8.0, 8.6),
    (64, 9.5, 8.8),
    (128, 12.0, 9.6),
    (256, 20.0, 12.0),
]


def _key(**changes: object) -> dict:
    key = {
        "schema": 1,
        "device_name": "NVIDIA H100 80GB HBM3",
        "driver": "NVRM 570.86",
        "torch": "2.13.0",
        "triton": "3.6.0",
        "foldckpt": "0.1.0",
        "dims": {"heads": 12},
        "weight_dtype": "bfloat16",
    }
    return key | changes


def test_threshold_rule_on_synthetic_timings() -> None:
    assert decide_fold_max_tokens(WINS_TO_32) == 32
    # The parity point at M=2 (8.1 vs 8.0) is within the tolerance; with none it ends the range.
    assert decide_fold_max_tokens(WINS_TO_32, tolerance=1.0) == 1
    # A loss beyond the tolerance at the first point: no fold anywhere, whatever follows.
    assert decide_fold_max_tokens([(1, 9.0, 8.0)] + WINS_TO_32[1:]) == 0
    # Up to a point the fold must also win in sum: parity alone routes nothing.
    assert decide_fold_max_tokens([(1, 8.1, 8.0), (2, 8.1, 8.0)]) == 0
    assert decide_fold_max_tokens([(1, 8.1, 8.0), (2, 7.0, 8.0), (4, 8.2, 8.0)]) == 4
    # A wrong result (inf) or a NaN time ends the range like a loss.
    assert decide_fold_max_tokens([(1, 7.0, 8.0), (2, float("inf"), 8.0), (4, 7.0, 8.0)]) == 1
    assert decide_fold_max_tokens([(1, 7.0, 8.0), (2, float("nan"), 8.0), (4, 7.0, 8.0)]) == 1
    assert decide_fold_max_tokens([]) == 0
    assert ROUTE_TOLERANCE == 0.97


def _bench_decode() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_decode", REPO / "scripts" / "bench_decode.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_tuner_bench_and_startup_give_one_threshold_from_the_same_timings(tmp_path: Path) -> None:
    """The same timings through the tuner's ``decide``, the benchmark's ``bench_threshold`` and the
    start-up measurement's cache round trip give the same threshold."""
    rows = [
        {
            "n": 6912,
            "m": m,
            "triton_us": fold + 5,
            "torch_us": fold,
            "skinny_us": None,
            "unfolded_us": unfolded,
            "unfolded_cublas_us": unfolded,
            "unfolded_triton_us": None,
        }
        for m, fold, unfolded in WINS_TO_32
    ]
    tuner = decide(rows)[2]
    records = [{"M": m, "folded_us": fold, "unfolded_us": unfolded} for m, fold, unfolded in reversed(WINS_TO_32)]
    bench = _bench_decode().bench_threshold(records, "folded_us")
    path = tmp_path / "route.json"
    assert write_cached_points(path, _key(), WINS_TO_32)
    startup = decide_fold_max_tokens(read_cached_points(path, _key()))
    assert tuner == bench == startup == 32
    assert json.loads(path.read_text())["fold_max_tokens"] == 32


def _calls(path: Path, name: str) -> bool:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return any(isinstance(n, ast.Call) and getattr(n.func, "id", None) == name for n in ast.walk(tree))


def test_every_threshold_comes_from_the_one_rule() -> None:
    """The tuner, the start-up measurement and the benchmark each call ``decide_fold_max_tokens``;
    nothing else in the package compares a fold time with an unfolded time against the tolerance."""
    for path in ("foldckpt/tune/search.py", "foldckpt/runtime/kernels/routing.py", "scripts/bench_decode.py"):
        assert _calls(REPO / path, "decide_fold_max_tokens"), path
    defined = [
        p for p in (REPO / "foldckpt").rglob("*.py") if "def decide_fold_max_tokens" in p.read_text(encoding="utf-8")
    ]
    assert [p.relative_to(REPO).as_posix() for p in defined] == ["foldckpt/runtime/kernels/tuning.py"]


def test_cache_file_is_per_key_in_the_user_cache_dir(tmp_path: Path) -> None:
    env = {"XDG_CACHE_HOME": str(tmp_path)}
    assert cache_dir(env) == tmp_path / "foldckpt"
    assert cache_dir({"XDG_CACHE_HOME": "relative/dir"}) == Path.home() / ".cache" / "foldckpt"
    assert cache_dir({}) == Path.home() / ".cache" / "foldckpt"
    path = cache_path(_key(), env)
    assert path.parent == tmp_path / "foldckpt" and path == cache_path(dict(reversed(_key().items())), env)
    others = [
        _key(device_name="NVIDIA H200"),
        _key(driver="NVRM 580.1"),
        _key(torch="2.14.0"),
        _key(triton="3.7.0"),
        _key(foldckpt="0.2.0"),
        _key(dims={"heads": 6}),
        _key(weight_dtype="float8_e4m3fn"),
    ]
    assert len({cache_path(k, env) for k in others} | {path}) == len(others) + 1


def test_cache_round_trip_and_invalidation(tmp_path: Path) -> None:
    path = cache_path(_key(), {"XDG_CACHE_HOME": str(tmp_path)})
    assert read_cached_points(path, _key()) is None, "nothing cached yet"
    assert write_cached_points(path, _key(), WINS_TO_32)
    assert read_cached_points(path, _key()) == WINS_TO_32
    assert [p.name for p in path.parent.iterdir()] == [path.name], "no temporary file left behind"
    # The same file read for another GPU, driver or torch (a hash collision, a copied cache) is stale.
    for other in (_key(device_name="NVIDIA H200"), _key(driver="NVRM 580.1"), _key(torch="2.14.0")):
        assert read_cached_points(path, other) is None
    # Rewritten (a later measurement): replaced whole.
    assert write_cached_points(path, _key(), WINS_TO_32[:3])
    assert read_cached_points(path, _key()) == WINS_TO_32[:3]


def _tamper(doc: dict, what: str) -> dict:
    doc = json.loads(json.dumps(doc))
    if what == "threshold":
        doc["fold_max_tokens"] = 256
    elif what == "time":
        doc["points"][1][1] = -1.0
    elif what == "int_time":
        doc["points"][1][2] = 8
    elif what == "m":
        doc["points"][1][0] = 3
    elif what == "key":
        doc["key"]["torch"] = "0.0"
    elif what == "points":
        doc["points"] = {}
    elif what == "short_point":
        doc["points"][0] = [1, 7.0]
    return doc


@pytest.mark.parametrize("what", ["threshold", "time", "int_time", "m", "key", "points", "short_point"])
def test_a_corrupt_cache_file_is_ignored(tmp_path: Path, what: str, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "route.json"
    write_cached_points(path, _key(), WINS_TO_32)
    path.write_text(json.dumps(_tamper(json.loads(path.read_text()), what)))
    with caplog.at_level(logging.WARNING, logger="vllm.foldckpt"):
        assert read_cached_points(path, _key()) is None
    assert "ignoring the routing cache" in caplog.text and str(path) in caplog.text


@pytest.mark.parametrize("text", ["", "{", "[]", "null", '{"key": 1}', "\x00\x01"])
def test_an_unreadable_cache_file_is_ignored(tmp_path: Path, text: str) -> None:
    path = tmp_path / "route.json"
    path.write_text(text)
    assert read_cached_points(path, _key()) is None


def test_an_unwritable_cache_dir_is_no_error(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    blocker = tmp_path / "foldckpt"
    blocker.write_text("a file where the cache folder would be")
    with caplog.at_level(logging.WARNING, logger="vllm.foldckpt"):
        assert not write_cached_points(blocker / "route.json", _key(), WINS_TO_32)
    assert "cannot write the routing cache" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["foldckpt"]
    # The rename fails once the temporary file is written (a folder at the cache file's name): removed.
    (tmp_path / "cache" / "route.json").mkdir(parents=True)
    assert not write_cached_points(tmp_path / "cache" / "route.json", _key(), WINS_TO_32)
    assert [p.name for p in (tmp_path / "cache").iterdir()] == ["route.json"]


def test_autotune_switch() -> None:
    assert autotune_enabled({}) and autotune_enabled({AUTOTUNE_ENV: " "}) and autotune_enabled({AUTOTUNE_ENV: "yes"})
    for off in ("0", "false", "No", "OFF"):
        assert not autotune_enabled({AUTOTUNE_ENV: off})
    with pytest.raises(FoldckptError, match=f"{AUTOTUNE_ENV}='of'"):
        autotune_enabled({AUTOTUNE_ENV: "of"})


def test_no_table_and_autotune_off_means_no_fold() -> None:
    """A GPU kind without a table: FOLDCKPT_AUTOTUNE=0 gives threshold 0 ("off": served unfolded),
    never a guessed one; with the measurement on, the table gives no route (the measurement does)."""
    dims = MlaDims(12)
    assert load_table("nvidia_gpu_without_table") is None
    for dtype in (None, FP8_WEIGHT_DTYPE):
        route = table_route("nvidia_gpu_without_table", dims, dtype, {AUTOTUNE_ENV: "0"})
        assert (route.max_tokens, route.source) == (0, "off")
        assert f"{AUTOTUNE_ENV}=0" in route.describe()
        assert table_route("nvidia_gpu_without_table", dims, dtype, {}) is None


def test_a_table_route_comes_from_the_table_whatever_the_switch() -> None:
    table = load_table("nvidia_h200")
    if table is None:
        pytest.skip("no H200 table shipped")
    entry = next(iter(table.shapes.values()))
    dims = MlaDims(entry.n // MlaDims(1).fold_head, q_lora=entry.k)
    for env in ({}, {AUTOTUNE_ENV: "0"}):
        route = table_route("nvidia_h200", dims, None, env)
        assert (route.max_tokens, route.source) == (entry.fold_max_tokens, "table")
    # A k the table never measured is not taken from a neighbour: off, or measured.
    assert table_route("nvidia_h200", MlaDims(12, q_lora=2048), None, {AUTOTUNE_ENV: "0"}).source == "off"


def test_cpu_route_is_unchanged(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU measures nothing, whatever FOLDCKPT_AUTOTUNE says; the environment overrides all."""
    monkeypatch.delenv(ENV_FOLD_MAX_TOKENS, raising=False)
    for switch in ("0", "1"):
        monkeypatch.setenv(AUTOTUNE_ENV, switch)
        route = fold_route(MlaDims(12), torch.device("cpu"))
        assert (route.max_tokens, route.source) == (CPU_FOLD_MAX_TOKENS, "cpu")
    monkeypatch.setenv(ENV_FOLD_MAX_TOKENS, "5")
    assert fold_route(MlaDims(12), torch.device("cpu"), FP8_WEIGHT_DTYPE).source == "env"
