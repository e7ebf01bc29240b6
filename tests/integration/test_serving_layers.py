"""Which fold the serving loader gives each MLA module vLLM builds, per family (no vLLM here).

vLLM names modules differently from the checkpoint's tensors in two places: MTP layers are built
under ``...mtp_block.self_attn``, and Kimi-K3's MTP model drops the ``language_model.`` its tensors
carry. A wrong match would load another layer's fold (a silently wrong model) or refuse a good
checkpoint; a KDA layer must never get a fold.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from foldckpt.errors import FoldckptError
from foldckpt.runtime.loader import open_fold_set


def test_kimi_k3_main_and_mtp_modules_find_their_folds(converted: Callable[..., tuple[Path, Path]]) -> None:
    # 6 layers, MLA at 1-based 4 and 6 (0-based 3 and 5), MTP layer 6.
    _, out_dir = converted("kimi_k3")
    fold_set = open_fold_set(out_dir)
    found = {
        name: (layer.index, layer.is_mtp)
        for name in (
            "language_model.model.layers.3.self_attn",
            "language_model.model.layers.5.self_attn",
            "model.layers.6.mtp_block.self_attn",
        )
        for layer in [fold_set.layer_for_module(name)]
    }
    assert found == {
        "language_model.model.layers.3.self_attn": (3, False),
        "language_model.model.layers.5.self_attn": (5, False),
        "model.layers.6.mtp_block.self_attn": (6, True),
    }
    for kda_or_absent in (
        "language_model.model.layers.0.self_attn",
        "language_model.model.layers.4.self_attn",
        "model.layers.3.self_attn.extra",
    ):
        with pytest.raises(FoldckptError, match=f"vLLM built the MLA layer '{kda_or_absent}'"):
            fold_set.layer_for_module(kda_or_absent)


def test_deepseek_mtp_module_finds_its_fold(converted: Callable[..., tuple[Path, Path]]) -> None:
    _, out_dir = converted("deepseek_v3", mtp_layers=1)
    fold_set = open_fold_set(out_dir)
    assert fold_set.layer_for_module("model.layers.1.self_attn").index == 1
    mtp = fold_set.layer_for_module("model.layers.2.mtp_block.self_attn")
    assert (mtp.index, mtp.is_mtp) == (2, True)
    with pytest.raises(FoldckptError, match="vLLM built the MLA layer 'language_model.model.layers.1.self_attn'"):
        fold_set.layer_for_module("language_model.model.layers.1.self_attn")
