"""A damaged conversion stops the engine with a message naming the file, never serves unfolded.

The engine tests start a real vLLM on a copy of a converted directory with its sidecar corrupted
(bytes flipped inside the fold data: only the sha256 can tell) or deleted. The in-process tests
exercise the checks vLLM runs before any weight is read (:func:`open_fold_set`), which need no
engine.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from foldckpt.errors import FoldckptError
from foldckpt.format.manifest import MANIFEST_NAME, read_manifest
from foldckpt.io.safetensors_format import read_header
from foldckpt.runtime.loader import open_fold_set
from tests.e2e.harness import requires_vllm, start_engine


def _copy(converted: Path, dest: Path) -> tuple[Path, Path]:
    """A private copy of a converted directory and the path of its (only) sidecar."""
    shutil.copytree(converted, dest)
    (sidecar,) = read_manifest(dest).sidecars
    return dest, dest / sidecar


def _flip(path: Path, offset: int, mask: int) -> None:
    """XOR one byte of ``path`` in place: its size, and so every header, stays valid."""
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ mask]))


@pytest.mark.e2e
@pytest.mark.slow
@requires_vllm
def test_corrupted_sidecar_stops_the_engine(engine_dir: Path, converted_bf16: Path, tmp_path: Path) -> None:
    model, sidecar = _copy(converted_bf16, tmp_path / "corrupted")
    _flip(sidecar, sidecar.stat().st_size - 64, 0xFF)  # inside the last fold tensor's data
    returncode, log = start_engine(engine_dir, "corrupted-sidecar", model)
    assert returncode != 0
    assert f"FoldckptError: {sidecar}: tensor 'model.layers.1.self_attn.q_fold.weight'" in log
    assert "do not match their head digests" in log


@pytest.mark.e2e
@pytest.mark.slow
@requires_vllm
def test_missing_sidecar_stops_the_engine(engine_dir: Path, converted_bf16: Path, tmp_path: Path) -> None:
    model, sidecar = _copy(converted_bf16, tmp_path / "missing")
    sidecar.unlink()
    returncode, log = start_engine(engine_dir, "missing-sidecar", model)
    assert returncode != 0
    assert f"FoldckptError: {sidecar}: listed in foldckpt.json but missing" in log


@pytest.mark.e2e
@pytest.mark.slow
@requires_vllm
def test_a_fold_input_changed_in_place_stops_the_engine(engine_dir: Path, converted_bf16: Path, tmp_path: Path) -> None:
    """One bit of layer 1's q_b_proj flipped in its shard, the size kept: the sidecar is intact,
    every file has its recorded size, and the engine served the fold of the old weights beside the
    new ones. It must refuse, naming the shard and the tensor."""
    model, _ = _copy(converted_bf16, tmp_path / "changed-input")
    source = next(
        s
        for s in read_manifest(model).tensors["model.layers.1.self_attn.q_fold.weight"].sources
        if s.name.endswith("q_b_proj.weight")
    )
    _flip(model / source.file, read_header(model / source.file).tensors[source.name].start, 0x01)
    returncode, log = start_engine(engine_dir, "changed-input", model)
    assert returncode != 0
    assert f"FoldckptError: {model / source.file}: tensor '{source.name}' is not the one" in log
    assert "the fold belongs to other weights" in log


@pytest.mark.e2e
@pytest.mark.slow
@requires_vllm
def test_a_pinned_engine_refuses_an_unconverted_model(engine_dir: Path, tiny_model: Path, converted_bf16: Path) -> None:
    """With the pin set, serving the original instead of its conversion stops the engine (it
    served the original unfolded)."""
    pin = hashlib.sha256((converted_bf16 / MANIFEST_NAME).read_bytes()).hexdigest()
    returncode, log = start_engine(
        engine_dir, "pinned-unconverted", tiny_model, env={"FOLDCKPT_EXPECT_MANIFEST_SHA256": pin}
    )
    assert returncode != 0
    assert f"FoldckptError: {tiny_model / MANIFEST_NAME}: missing, but FOLDCKPT_EXPECT_MANIFEST_SHA256 pins" in log


def test_fold_set_of_a_good_conversion(converted_bf16: Path) -> None:
    fold_set = open_fold_set(converted_bf16)
    layer = fold_set.layer_for_module("model.layers.1.self_attn")
    rows = fold_set.read_rows(layer, tp_size=2, tp_rank=1)
    geometry = fold_set.geometry
    assert tuple(rows.shape) == (geometry.fold_shape[0] // 2, geometry.q_lora_rank)


def test_truncated_sidecar_is_refused_before_loading(converted_bf16: Path, tmp_path: Path) -> None:
    model, sidecar = _copy(converted_bf16, tmp_path / "truncated")
    sidecar.write_bytes(sidecar.read_bytes()[:-128])
    with pytest.raises(FoldckptError, match=f"{sidecar}: size .* bytes, foldckpt.json records"):
        open_fold_set(model)


def test_manifest_for_another_model_is_refused(converted_bf16: Path, tmp_path: Path) -> None:
    model, _ = _copy(converted_bf16, tmp_path / "other-config")
    config = json.loads((model / "config.json").read_text())
    config["num_attention_heads"] = 4
    (model / "config.json").write_text(json.dumps(config))
    # the edited config no longer has the size the manifest vouches for; with the manifest re-signed
    # to match, its geometry is refused (tests/integration/test_integrity.py)
    expected = rf"config.json: size \d+ bytes, {MANIFEST_NAME} records \d+"
    with pytest.raises(FoldckptError, match=expected):
        open_fold_set(model)


def test_layer_without_fold_is_refused(converted_bf16: Path) -> None:
    with pytest.raises(FoldckptError, match="vLLM built the MLA layer 'model.layers.7.self_attn'"):
        open_fold_set(converted_bf16).layer_for_module("model.layers.7.self_attn")
