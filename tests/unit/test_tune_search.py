"""The tuner's per-bucket search loop (``tune.time_bucket``), which the bf16 and fp8 searches share.

What it promises the tables: the base table's winner is timed first (a search cut short never ends
worse than the last one), the rest in an order fixed per bucket, at least one config per bucket
however little time is left, the fastest config that ran wins, and configs that failed to run
(infinite time) never do. The timings here are given, not measured: the loop is what is tested.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest

from foldckpt.tune.bf16 import BUCKETS, time_bucket
from foldckpt.runtime.kernels.tuning import KernelConfig

CANDIDATES = [KernelConfig(16, block_n, block_k, 1, 4, stages) for block_n in (32, 64, 128) for block_k in (64, 128)
              for stages in (2, 3)]  # fmt: skip


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
        CANDIDATES[-1], 9.0,
    ), "out of time, the search goes on until one config ran"  # fmt: skip
    with pytest.raises(RuntimeError, match="none of 12 configs ran"):
        time_bucket(GivenTimes(dict.fromkeys(CANDIDATES, float("inf"))), "fold", 64, CANDIDATES, None, 0.0, [])
