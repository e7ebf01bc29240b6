"""The tuner's per-bucket search loop (``search.time_bucket``) and table writing (``cli.write``),
which the bf16 and fp8 search spaces share.

What it promises the tables: the base table's winner is timed first (a search cut short never ends
worse than the last one), the rest in an order fixed per bucket, at least one config per bucket
however little time is left, the fastest config that ran wins, and configs that failed to run
(infinite time) never do. The timings here are given, not measured: the loop is what is tested.
"""

from __future__ import annotations

import argparse
import json
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from foldckpt.runtime.kernels.tuning import KernelConfig
from foldckpt.tune.search import BUCKETS, time_bucket

CANDIDATES = [
    KernelConfig(16, block_n, block_k, 1, 4, stages)
    for block_n in (32, 64, 128)
    for block_k in (64, 128)
    for stages in (2, 3)
]


@dataclass
class GivenTimes:
    """Stands in for ``GemmWeights``: each config's time is given; records the order timed."""

    us: dict[KernelConfig, float]
    n: int = 6912
    timed: list[KernelConfig] = field(default_factory=list)

    def time_triton(self, cfg: KernelConfig, m: int) -> tuple[float, float]:
        self.timed.append(cfg)
        return self.us[cfg], 1e-3


def times(fastest: int = 3) -> dict[KernelConfig, float]:
    return {cfg: 1.0 if i == fastest else 2.0 + i for i, cfg in enumerate(CANDIDATES)}


def test_with_time_every_config_is_timed_and_the_fastest_wins() -> None:
    weights, log = GivenTimes(times()), []
    cfg, us = time_bucket(weights, "fold", 16, CANDIDATES, None, time.monotonic() + 60, log)
    assert (cfg, us) == (CANDIDATES[3], 1.0)
    assert sorted(weights.timed, key=CANDIDATES.index) == CANDIDATES
    assert [(row["role"], row["m"], row["block_n"], row["us"]) for row in log] == [
        ("fold", 16, c.block_n, weights.us[c]) for c in weights.timed
    ]


def test_the_order_is_shuffled_the_same_way_every_run_and_the_seed_goes_first() -> None:
    orders = []
    for _ in range(2):
        weights = GivenTimes(times())
        time_bucket(weights, "fold", 32, CANDIDATES, CANDIDATES[5], time.monotonic() + 60, [])
        orders.append(weights.timed)
    assert orders[0] == orders[1]
    assert orders[0][0] == CANDIDATES[5] and len(orders[0]) == len(CANDIDATES)
    assert orders[0] != [CANDIDATES[5]] + [c for c in CANDIDATES if c != CANDIDATES[5]], "not shuffled"


def test_out_of_time_only_the_seed_is_timed() -> None:
    weights = GivenTimes(times())
    assert time_bucket(weights, "fold", 16, CANDIDATES, CANDIDATES[0], time.monotonic() - 1, []) == (CANDIDATES[0], 2.0)
    assert weights.timed == [CANDIDATES[0]]


def test_a_bucket_gets_its_share_of_the_time_left() -> None:
    """A zero share leaves the bucket one config; the same deadline with a share times them all."""
    shares = {**dict.fromkeys(BUCKETS, 1.0), 16: 0.0}
    weights = GivenTimes(times())
    time_bucket(weights, "fold_fp8", 16, CANDIDATES, None, time.monotonic() + 60, [], shares)
    assert len(weights.timed) == 1
    weights = GivenTimes(times())
    time_bucket(weights, "fold_fp8", 32, CANDIDATES, None, time.monotonic() + 60, [], shares)
    assert len(weights.timed) == len(CANDIDATES)


def test_configs_that_did_not_run_never_win() -> None:
    us = {cfg: float("inf") for cfg in CANDIDATES}
    us[CANDIDATES[-1]] = 9.0
    weights = GivenTimes(us)
    assert time_bucket(weights, "q_b_proj", 64, CANDIDATES, CANDIDATES[0], time.monotonic() - 1, []) == (
        CANDIDATES[-1],
        9.0,
    ), "out of time, the search goes on until one config ran"
    with pytest.raises(RuntimeError, match="none of 12 configs ran"):
        time_bucket(GivenTimes(dict.fromkeys(CANDIDATES, float("inf"))), "fold", 64, CANDIDATES, None, 0.0, [])


def _entry(n: int, threshold: int) -> dict:
    config = KernelConfig(16, 64, 128, 1, 4, 4)
    bucket = {"m_max": 16, "backend": "triton", **{k: v for k, v in config.__dict__.items() if k != "mma_f16"}}
    return {"n": n, "k": 1536, "fold_max_tokens": threshold, "heads": n // 576, "bucket": [bucket]}


def _skinny(role: str, n: int) -> dict:
    return {"role": role, "n": n, "k": 1536, "m_max": 1, "rows": 4, "block_k": 256, "num_warps": 1, "pdl": False}


@pytest.mark.parametrize("dtype", ["bf16", "fp8"])
def test_one_loop_writes_its_dtype_and_keeps_the_rest_of_the_base(tmp_path: Path, dtype: str) -> None:
    """Whichever search space ran, ``cli.write`` replaces only that dtype's entries of the tuned
    shapes in the base table (and its records in the tune JSON) and keeps everything else."""
    from foldckpt.runtime.kernels.tuning import parse_table
    from foldckpt.tune.cli import SPACES, write

    space = SPACES[dtype]
    base = {
        "meta": {"gpu": "nvidia_test", "device_name": "test", "date": "old", "fp8_date": "old"},
        "shape": [_entry(6912, 64), _entry(3456, 32)],
        "fp8_shape": [_entry(6912, 16), _entry(3456, 8)],
        "skinny": [_skinny("fold", 6912), _skinny("fold_fp8", 6912), _skinny("fold_fp8", 3456)],
    }
    base_json = tmp_path / "base.json"
    base_json.write_text(json.dumps({"meta": {}, f"{space.prefix}grid": [{"n": 6912, "m": 1}, {"n": 3456, "m": 1}]}))
    args = argparse.Namespace(out=tmp_path, base_json=base_json)
    fold_role = space.roles[0]
    tuned_entries = {space.section: [_entry(6912, 128)]}
    tuned_skinny = [_skinny(fold_role, 6912) | {"rows": 8}]
    meta = {f"{space.prefix}date": "new"}
    write(args, "nvidia_test", base, meta, tuned_entries, tuned_skinny, [], [{"n": 6912, "m": 2}], space)
    table = parse_table(tomllib.loads((tmp_path / "nvidia_test.toml").read_text()), "written")
    tuned, other = (table.fp8_shapes, table.shapes) if dtype == "fp8" else (table.shapes, table.fp8_shapes)
    assert tuned[(6912, 1536)].fold_max_tokens == 128 and tuned[(3456, 1536)].fold_max_tokens in (32, 8)
    kept = {6912: 64, 3456: 32} if dtype == "fp8" else {6912: 16, 3456: 8}
    assert {n: e.fold_max_tokens for (n, _), e in other.items()} == kept
    assert table.skinny[(fold_role, 6912, 1536)][0].rows == 8
    kept_role = "fold" if dtype == "fp8" else "fold_fp8"
    assert table.skinny[(kept_role, 6912, 1536)][0].rows == 4 and ("fold_fp8", 3456, 1536) in table.skinny
    assert table.meta[f"{space.prefix}date"] == "new" and table.meta["fp8_date" if dtype == "bf16" else "date"] == "old"
    doc = json.loads((tmp_path / "tune_nvidia_test.json").read_text())
    assert doc[f"{space.prefix}grid"] == [{"n": 3456, "m": 1}, {"n": 6912, "m": 2}]
