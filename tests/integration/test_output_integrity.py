"""What OUT_DIR promises, against hostile timing and edits (issue 13), on real files.

* an index-less source (one ``model.safetensors``) gets a generated index, so that no weight
  loader reads the sidecars (stock vLLM loading it: ``tests/e2e/test_layouts.py``);
* a resume, and an "already converted" rerun, check that every placed file still holds the bytes
  recorded, refuse (naming the file) when a source changed, and redo what is only damaged in
  OUT_DIR; a ``touch`` costs a rehash, not a ``--restart``;
* a fold that overflows its dtype is an error at convert naming the layer, and ``verify --deep``
  fails on one;
* OUT_DIR is locked for the whole convert: a second convert, and verify, say so (exit 2);
* a foldckpt output is refused as MODEL_DIR.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from foldckpt.convert import ConvertOptions, convert
from foldckpt.defaults import JOURNAL_NAME
from foldckpt.format.manifest import MANIFEST_NAME, read_manifest
from foldckpt.io.files import exclusive_lock
from foldckpt.io.safetensors_format import read_header
from foldckpt.model.checkpoint import INDEX_NAME
from foldckpt.model.synthetic import make_checkpoint
from tests.conftest import run_foldckpt
from tests.integration.test_resume import (
    CONVERT_ARGS,
    LAYERS,
    convert_args,
    kill_after_layers,
    one_error_line,
)

SHARD = "model-00002-of-00003.safetensors"


def single_file_model(path: Path, **kwargs: object) -> Path:
    """A checkpoint as many small models ship: one ``model.safetensors``, no index."""
    model = make_checkpoint(path, "deepseek_v3", shards=1, **kwargs)  # type: ignore[arg-type]
    (model / "model-00001-of-00001.safetensors").rename(model / "model.safetensors")
    (model / INDEX_NAME).unlink()
    return model


def flip_data_byte(path: Path) -> None:
    """Change one byte of tensor data in place, keeping size and mtime (as a careless tool would)."""
    st = path.stat()
    header = read_header(path)
    info = max(header.tensors.values(), key=lambda t: t.nbytes)
    with open(path, "r+b") as handle:
        handle.seek(info.start + info.nbytes // 2)
        byte = handle.read(1)
        handle.seek(-1, os.SEEK_CUR)
        handle.write(bytes([byte[0] ^ 0x40]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def verify_cli(out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_foldckpt("verify", out, "-q", *args)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("models") / "v3", "deepseek_v3", layers=LAYERS)


# ---------------------------------------------------------------------------------------------
# 1. index-less sources


def test_single_file_source_gets_a_generated_index_that_lists_only_its_weights(tmp_path: Path) -> None:
    model = single_file_model(tmp_path / "single")
    out = tmp_path / "out"
    run = run_foldckpt("convert", model, out, "-q")
    assert run.returncode == 0, run.stderr
    index = json.loads((out / INDEX_NAME).read_text())
    assert set(index["weight_map"].values()) == {"model.safetensors"}
    assert set(index["weight_map"]) == set(read_header(model / "model.safetensors").tensors)
    manifest = read_manifest(out)
    assert manifest.generated_files == (INDEX_NAME,) and INDEX_NAME in manifest.source_files
    assert not (model / INDEX_NAME).exists(), "MODEL_DIR is never written"
    assert verify_cli(out, "--deep").returncode == 0
    again = run_foldckpt("convert", model, out, "-q")
    assert again.returncode == 0 and "nothing to do" in again.stdout
    (out / INDEX_NAME).write_text("{}")  # a damaged generated file is written again
    again = run_foldckpt("convert", model, out, "-q")
    assert again.returncode == 0 and f"repaired   {INDEX_NAME}" in again.stdout, again.stdout
    assert verify_cli(out, "--deep").returncode == 0


def test_indexed_source_gets_no_generated_file(model: Path, tmp_path: Path) -> None:
    convert(model, tmp_path / "out", ConvertOptions(progress=False))
    manifest = read_manifest(tmp_path / "out")
    assert manifest.generated_files == () and "generated_files" not in json.loads(
        (tmp_path / "out" / MANIFEST_NAME).read_text()
    )


# ---------------------------------------------------------------------------------------------
# 2. a source changed between a killed convert and its resume


def copy_model(model: Path, dest: Path) -> Path:
    dest.mkdir()
    for path in model.iterdir():
        (dest / path.name).write_bytes(path.read_bytes())
        os.utime(dest / path.name, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns))
    return dest


@pytest.mark.parametrize("link", ["hard", "copy"])
@pytest.mark.parametrize("how", ["in-place", "replaced"])
def test_resume_refuses_a_source_changed_since_the_killed_run_naming_it(
    model: Path, tmp_path: Path, link: str, how: str
) -> None:
    src = copy_model(model, tmp_path / "src")
    out = tmp_path / "out"
    process = subprocess.Popen(
        [sys.executable, "-m", "foldckpt", *convert_args(src, out, "--link", link)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    from tests.integration.test_resume import journaled_layers, kill_when

    assert kill_when(process, lambda: journaled_layers(out) >= 2)
    shard = src / SHARD
    if how == "in-place":
        flip_data_byte(shard)
    else:  # another file, same name, size and mtime
        st = shard.stat()
        other = tmp_path / "other"
        other.write_bytes(shard.read_bytes())
        flip_data_byte(other)
        other.replace(shard)
        os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    line = one_error_line(run_foldckpt(*convert_args(src, out, "--link", link)))
    assert str(shard) in line and "changed since" in line and "--restart" in line, line
    if link == "hard" and how == "in-place":
        assert "hard link" in line
    assert not (out / MANIFEST_NAME).exists()
    run = run_foldckpt(*convert_args(src, out, "--link", link, "--restart"))
    assert run.returncode == 0, run.stderr
    assert verify_cli(out, "--deep").returncode == 0


def test_touch_on_a_source_costs_a_rehash_not_a_restart(model: Path, tmp_path: Path) -> None:
    src = copy_model(model, tmp_path / "src")
    out = tmp_path / "out"
    assert kill_after_layers(src, out, 2, 0.0)
    (src / SHARD).touch()
    run = run_foldckpt(*convert_args(src, out))
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["layers_resumed"] >= 2
    assert verify_cli(out, "--deep").returncode == 0
    (src / "config.json").touch()  # and on a finished output: still up to date
    run = run_foldckpt(*convert_args(src, out))
    assert run.returncode == 0 and json.loads(run.stdout)["up_to_date"], run.stderr


# ---------------------------------------------------------------------------------------------
# 6. a damaged output rerun with the same convert


def test_rerun_repairs_a_deleted_sidecar_and_an_edited_copy(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert run_foldckpt(*convert_args(model, out, "--link", "copy")).returncode == 0
    sidecar = sorted(out.glob("foldckpt-*.safetensors"))[1]
    sidecar.unlink()
    flip_data_byte(out / SHARD)  # a placed copy edited in OUT_DIR: MODEL_DIR still has the original
    assert verify_cli(out).returncode == 1
    run = run_foldckpt("convert", model, out, *CONVERT_ARGS[:-1], "--link", "copy")
    assert run.returncode == 0, run.stderr
    assert f"repaired   {SHARD}, {sidecar.name}" in run.stdout, run.stdout
    assert "folded     2 of 8" in run.stdout, run.stdout
    assert verify_cli(out, "--deep").returncode == 0
    assert not (out / JOURNAL_NAME).exists()


def test_rerun_refuses_a_source_edited_through_its_hard_link(model: Path, tmp_path: Path) -> None:
    src = copy_model(model, tmp_path / "src")
    out = tmp_path / "out"
    assert run_foldckpt(*convert_args(src, out)).returncode == 0
    time.sleep(0.05)  # past the manifest's timestamp tick
    flip_data_byte(out / SHARD)  # edits MODEL_DIR's file too: one inode
    line = one_error_line(run_foldckpt(*convert_args(src, out)))
    assert str(src / SHARD) in line and "hard link" in line and "--restart" in line, line
    assert run_foldckpt(*convert_args(src, out, "--restart")).returncode == 0
    assert verify_cli(out, "--deep").returncode == 0


# ---------------------------------------------------------------------------------------------
# 3. a fold that overflows its dtype


def scaled_model(tmp_path: Path, factor: float, layer: int = 1, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A one-shard DeepSeek-V3 checkpoint whose layer ``layer`` has q_b_proj and kv_b_proj times ``factor``."""
    model = make_checkpoint(tmp_path / f"scaled-{factor:g}", "deepseek_v3", shards=1, dtype=dtype)
    shard = model / "model-00001-of-00001.safetensors"
    tensors = load_file(str(shard))
    for name in ("q_b_proj", "kv_b_proj"):
        key = f"model.layers.{layer}.self_attn.{name}.weight"
        tensors[key] = (tensors[key].double() * factor).to(tensors[key].dtype)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return model


@pytest.mark.parametrize(
    ("fold_dtype", "factor", "advice"),
    [
        ("float16", 2000, "choose --fold-dtype bfloat16 or float32"),
        ("float32", 1e20, "no fold dtype holds it"),  # the fp32 accumulation itself overflows: no wider dtype helps
    ],
)
def test_fold_overflowing_its_dtype_is_an_error_naming_the_layer(
    tmp_path: Path, fold_dtype: str, factor: float, advice: str
) -> None:
    model = scaled_model(tmp_path, factor)
    line = one_error_line(run_foldckpt("convert", model, tmp_path / "out", "--fold-dtype", fold_dtype, "-q"))
    assert "MLA layer 1" in line and f"overflows {fold_dtype}" in line and advice in line, line
    if fold_dtype == "float16":
        assert (
            run_foldckpt("convert", model, tmp_path / "out", "--fold-dtype", "float32", "-q", "--restart").returncode
            == 0
        )


def test_fold_underflowing_float16_is_an_error_naming_the_layer_and_its_rows(tmp_path: Path) -> None:
    """Weights 100x smaller: q_pe (W_qb_pe, about 1e-3) is still normal in fp16, but W_UKᵀ·W_qb_nope
    (about 1e-5) lies below fp16's smallest normal number 6.1e-5 and keeps only a few bits. convert
    stored it (recording 4e-4, behind exact q_pe rows) and verify --deep accepted it."""
    model = scaled_model(tmp_path, 0.01, dtype=torch.float32)
    line = one_error_line(run_foldckpt("convert", model, tmp_path / "out", "--fold-dtype", "float16", "-q"))
    assert "MLA layer 1" in line and "'s ql_nope rows" in line and "float16's smallest normal" in line, line
    assert "choose --fold-dtype bfloat16 or float32" in line, line
    assert (
        run_foldckpt("convert", model, tmp_path / "out", "--fold-dtype", "bfloat16", "-q", "--restart").returncode == 0
    )
    assert verify_cli(tmp_path / "out", "--deep").returncode == 0


def test_verify_deep_fails_on_a_fold_whose_ql_nope_rows_underflowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An output made without the convert-time check (an older foldckpt): the deep level measures
    the ql_nope rows on their own and refuses them."""
    import foldckpt.convert.layer

    monkeypatch.setattr(foldckpt.convert.layer, "check_fold_accuracy", lambda *a: None)
    model = scaled_model(tmp_path, 0.01, dtype=torch.float32)
    convert(model, tmp_path / "out", ConvertOptions(fold_dtype="float16", progress=False))
    run = verify_cli(tmp_path / "out", "--deep")
    assert run.returncode == 1, run.stdout
    assert "'model.layers.1.self_attn.q_fold.weight' is not the fold of its sources rounded once" in run.stdout, (
        run.stdout
    )


def one_head_scaled_model(tmp_path: Path, factor: float, dtype: torch.dtype, head: int = 3) -> Path:
    """A one-shard DeepSeek-V3 checkpoint (8 heads) whose layer 1 has head ``head``'s W_qb_nope rows
    of q_b_proj times ``factor``: head 3 is not among the heads convert samples (0, 2, 5, 7)."""
    model = make_checkpoint(tmp_path / f"head-scaled-{factor:g}", "deepseek_v3", shards=1, dtype=dtype)
    shard = model / "model-00001-of-00001.safetensors"
    tensors = load_file(str(shard))
    key = "model.layers.1.self_attn.q_b_proj.weight"
    heads = tensors[key].double().reshape(8, -1, tensors[key].shape[1]).clone()
    heads[head, : json.loads((model / "config.json").read_text())["qk_nope_head_dim"]] *= factor
    tensors[key] = heads.reshape(tensors[key].shape).to(tensors[key].dtype)
    save_file(tensors, str(shard), metadata={"format": "pt"})
    return model


@pytest.mark.parametrize(
    ("factor", "dtype", "fold_dtype"),
    [
        # W_UKᵀ·W_qb_nope below 1e-39: bf16's subnormals (the fold is exact, then rounded once: only the
        # stored dtype's range can lose the head)
        (1e-38, torch.bfloat16, "bfloat16"),
        (1e-4, torch.bfloat16, "float16"),  # near 1e-6: fp16's subnormals
    ],
)
def test_one_head_of_weights_below_the_fold_dtypes_range_is_refused_by_convert(
    tmp_path: Path, factor: float, dtype: torch.dtype, fold_dtype: str
) -> None:
    """Convert measured 4 sampled heads against fp64 in one pool: a head outside the sample (or
    drowned in it) whose ql_nope rows underflowed was written with exit 0."""
    model = one_head_scaled_model(tmp_path, factor, dtype)
    line = one_error_line(run_foldckpt("convert", model, tmp_path / "out", "--fold-dtype", fold_dtype, "-q"))
    assert "MLA layer 1" in line and "in head 3's ql_nope rows" in line and f"one rounding to {fold_dtype}" in line, (
        line
    )


def test_verify_deep_judges_each_head_against_the_tolerance(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An fp16 fold with one head of weights 1e-4 times the others' (made without the convert-time
    check, as an older foldckpt did): each of its elements is one rounding of the fp64 value, but
    the head's subnormal ql_nope rows are 5e-3 off, five times fp16's tolerance; the error pooled
    over all heads hid it and verify --deep passed."""
    import foldckpt.convert.layer

    monkeypatch.setattr(foldckpt.convert.layer, "check_fold_accuracy", lambda *a: None)
    model = one_head_scaled_model(tmp_path, 1e-4, torch.bfloat16)
    convert(model, tmp_path / "out", ConvertOptions(fold_dtype="float16", progress=False))
    run = verify_cli(tmp_path / "out", "--deep")
    assert run.returncode == 1, run.stdout
    assert "'model.layers.1.self_attn.q_fold.weight' is not the fold of its sources rounded once" in run.stdout, (
        run.stdout
    )
    assert "in head 3's ql_nope rows is more than one rounding to float16" in run.stdout, run.stdout


def test_an_fp8_fold_whose_row_scales_would_underflow_float32_is_refused(tmp_path: Path) -> None:
    """Row scales are amax/448: rows whose values are about 1e-40 get a subnormal scale (a few
    bits) or 0 (and NaN values, which read as an overflow)."""
    model = scaled_model(tmp_path, 1e-19, dtype=torch.float32)
    line = one_error_line(run_foldckpt("convert", model, tmp_path / "out", "--fold-dtype", "fp8", "-q"))
    assert "MLA layer 1" in line and "row scale(s) of the fp8 fold fall below float32's smallest normal" in line, line


def test_verify_deep_fails_on_a_float32_fold_with_one_element_off_by_400_ulps(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One element 5e-5 (relative) off moves its head's relative error by less than float32's
    1e-6 tolerance; the per-element bound, once kept for bf16/fp16 folds, covers fp32 too."""
    import foldckpt.convert.layer
    from foldckpt.fold import fold_layer_chunks

    def edited(*args: object, **kwargs: object) -> Iterator[tuple[slice, torch.Tensor]]:
        for heads, values in fold_layer_chunks(*args, **kwargs):  # type: ignore[arg-type]
            if heads.start == 0:
                values[0, 3, 7] *= 1 + 5e-5
            yield heads, values

    monkeypatch.setattr(foldckpt.convert.layer, "fold_layer_chunks", edited)
    out = tmp_path / "out"
    convert(model, out, ConvertOptions(fold_dtype="float32", progress=False))
    run = verify_cli(out, "--deep")
    assert run.returncode == 1, run.stdout
    assert "element(s) beyond one rounding of the fp64 fold" in run.stdout and "tolerance 1.0e-06" in run.stdout, (
        run.stdout
    )


def test_an_all_zero_layer_converts_and_verifies_deep(tmp_path: Path) -> None:
    """Its fold is exactly zero; verify --deep's probe divided 0 by 0 and failed it."""
    model = scaled_model(tmp_path, 0.0)
    assert run_foldckpt("convert", model, tmp_path / "out", "-q").returncode == 0
    run = verify_cli(tmp_path / "out", "--deep")
    assert run.returncode == 0, run.stdout


def test_verify_deep_fails_on_a_fold_with_inf(model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An output made without the convert-time check (an older foldckpt): the deep level catches it."""
    import foldckpt.convert.layer
    from foldckpt.fold import fold_layer_chunks

    def overflowing(*args: object, **kwargs: object) -> Iterator[tuple[slice, torch.Tensor]]:
        for heads, values in fold_layer_chunks(*args, **kwargs):  # type: ignore[arg-type]
            if heads.start == 0:
                values[0, 0, 0] = float("inf")
            yield heads, values

    monkeypatch.setattr(foldckpt.convert.layer, "fold_layer_chunks", overflowing)
    monkeypatch.setattr(foldckpt.convert.layer, "check_fold_finite", lambda *a: None)
    monkeypatch.setattr(foldckpt.convert.layer, "check_fold_accuracy", lambda *a: None)  # its error is Inf too
    out = tmp_path / "out"
    convert(model, out, ConvertOptions(fold_dtype="float16", progress=False))
    run = verify_cli(out, "--deep")
    assert run.returncode == 1, run.stdout
    assert "values are Inf or NaN" in run.stdout and "overflows float16" in run.stdout, run.stdout


# ---------------------------------------------------------------------------------------------
# 4. one convert at a time


def test_a_locked_out_dir_refuses_a_second_convert_and_verify(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    convert(model, out, ConvertOptions(progress=False))
    with exclusive_lock(out):  # as a running convert holds it
        line = one_error_line(run_foldckpt("convert", model, out, "-q"))
        assert str(out) in line and "another foldckpt convert is writing" in line, line
        line = one_error_line(run_foldckpt("convert", model, out, "-q", "--restart"))
        assert "another foldckpt convert is writing" in line, line
        line = one_error_line(verify_cli(out))
        assert str(out) in line and "convert is writing this directory right now" in line, line
    assert verify_cli(out).returncode == 0


def test_two_concurrent_converts_into_one_out_dir(model: Path, tmp_path: Path) -> None:
    """Started together: one converts; the other is refused (exit 2, one line) or, if it comes
    after, finds the output done. Never a missing-file error, a stray journal, a failing output."""
    other = make_checkpoint(tmp_path / "other", "deepseek_v3", layers=LAYERS, seed=1)
    out = tmp_path / "out"
    for extra in ((model, ()), (other, ("--restart",))):
        commands = [convert_args(model, out), convert_args(extra[0], out, *extra[1])]
        procs = [
            subprocess.Popen(
                [sys.executable, "-m", "foldckpt", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
            for args in commands
        ]
        results = [(p.wait(timeout=120), p.stderr.read()) for p in procs]  # type: ignore[union-attr]
        assert 0 in [code for code, _ in results], results
        for code, err in results:
            assert code in (0, 2), results
            if code == 2:  # refused by the lock, or (plain after --restart) by the other model's output
                assert len(err.strip().splitlines()) == 1, err
                assert "another foldckpt convert is writing" in err or "other inputs" in err, err
        assert not (out / JOURNAL_NAME).exists()
        assert verify_cli(out).returncode == 0


# ---------------------------------------------------------------------------------------------
# 5. a foldckpt output as MODEL_DIR


def test_a_foldckpt_output_is_refused_as_model_dir(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    convert(model, out, ConvertOptions(progress=False))
    line = one_error_line(run_foldckpt("convert", out, tmp_path / "out2", "-q"))
    assert str(out) in line and "is a foldckpt output" in line and MANIFEST_NAME in line, line
    assert not (tmp_path / "out2").exists()
