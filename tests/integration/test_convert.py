"""End-to-end conversion of every family on real files: sidecars, manifest, originals, idempotence."""

from __future__ import annotations

import gc
import hashlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from types import FrameType

import pytest
import torch
from blake3 import blake3
from safetensors import safe_open

from foldckpt import defaults
from foldckpt.convert import ConvertOptions, convert
from foldckpt.convert.plan import plan_conversion
from foldckpt.errors import FoldckptError
from foldckpt.fold import ROUNDING_TOLERANCE, dequantize_fp8_blocks
from foldckpt.format.manifest import MANIFEST_NAME, read_manifest
from foldckpt.io.safetensors_format import read_header
from foldckpt.model.checkpoint import INDEX_NAME
from foldckpt.model.geometry import read_geometry
from foldckpt.model.synthetic import make_checkpoint
from foldckpt.runtime.loader import open_fold_set
from foldckpt.verify import VerifyOptions, verify
from tests.conftest import direct_io_supported, run_foldckpt
from tests.unit.test_fold import fp64_fold_of_head

QUIET = ConvertOptions(progress=False)


def load_source(model_dir: Path, name: str) -> torch.Tensor:
    """A source weight through the real safetensors library, dequantized if it is fp8."""
    weight_map = json.loads((model_dir / INDEX_NAME).read_text())["weight_map"]
    with safe_open(str(model_dir / weight_map[name]), framework="pt") as handle:
        tensor = handle.get_tensor(name)
    if tensor.dtype == torch.float8_e4m3fn:
        with safe_open(str(model_dir / weight_map[f"{name}_scale_inv"]), framework="pt") as handle:
            tensor = dequantize_fp8_blocks(tensor, handle.get_tensor(f"{name}_scale_inv"), (128, 128), name)
    return tensor


@pytest.mark.parametrize(
    ("family", "expected_layers"),
    [("deepseek_v3", [0, 1]), ("deepseek_v3_fp8", [0, 1]), ("kimi_k25", [0, 1]), ("kimi_k3", [3, 5, 6])],
)
def test_every_family_converts_to_folds_equal_to_the_fp64_reference(
    converted: Callable[..., tuple[Path, Path]], family: str, expected_layers: list[int]
) -> None:
    model_dir, out_dir = converted(family)
    manifest = read_manifest(out_dir)
    g = read_geometry(model_dir)
    assert [t.layer_index for t in manifest.tensors.values()] == expected_layers
    if family == "kimi_k3":
        assert manifest.geometry.layers[-1].is_mtp
    for tensor in manifest.tensors.values():
        with safe_open(str(out_dir / tensor.file), framework="pt") as handle:
            fold = handle.get_tensor(tensor.name)
        assert fold.dtype == torch.bfloat16 and tuple(fold.shape) == g.fold_shape
        q_b = load_source(model_dir, f"{tensor.layer_prefix}.self_attn.q_b_proj.weight")
        kv_b = load_source(model_dir, f"{tensor.layer_prefix}.self_attn.kv_b_proj.weight")
        heads = fold.reshape(g.num_heads, g.fold_head_dim, g.q_lora_rank)
        for h in range(g.num_heads):
            reference = fp64_fold_of_head(q_b, kv_b, g, h)
            assert (heads[h].double() - reference).norm() / reference.norm() < ROUNDING_TOLERANCE[torch.bfloat16]
        assert tensor.error["rel_fro_error"] < ROUNDING_TOLERANCE[torch.bfloat16]


def test_a_layer_whose_inputs_straddle_two_shards_is_folded(converted: Callable[..., tuple[Path, Path]]) -> None:
    _, out_dir = converted("deepseek_v3")
    first = next(iter(read_manifest(out_dir).tensors.values()))
    assert first.sources[0].file != first.sources[1].file


def test_originals_are_byte_identical_hard_links_and_the_index_is_unchanged(
    converted: Callable[..., tuple[Path, Path]],
) -> None:
    model_dir, out_dir = converted("kimi_k3")
    originals = sorted(p.name for p in model_dir.iterdir())
    for name in originals:
        assert (out_dir / name).read_bytes() == (model_dir / name).read_bytes()
        assert (out_dir / name).stat().st_ino == (model_dir / name).stat().st_ino
    index = json.loads((out_dir / INDEX_NAME).read_text())
    assert not any(file.startswith("foldckpt-") for file in index["weight_map"].values())
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(
        [*originals, MANIFEST_NAME, "foldckpt-00001-of-00001.safetensors"]
    )


@pytest.mark.parametrize("link", ["copy", "symlink"])
def test_copy_and_symlink_modes_carry_the_same_bytes(converted: Callable[..., tuple[Path, Path]], link: str) -> None:
    model_dir, out_dir = converted("deepseek_v3", ConvertOptions(progress=False, link=link))
    for source in model_dir.iterdir():
        placed = out_dir / source.name
        assert placed.read_bytes() == source.read_bytes()
        assert placed.is_symlink() == (link == "symlink")
        if link == "copy":
            assert placed.stat().st_ino != source.stat().st_ino
    assert verify(out_dir, VerifyOptions(progress=False)).ok


def test_a_rerun_with_another_link_mode_places_the_sources_again(
    converted: Callable[..., tuple[Path, Path]],
) -> None:
    """A finished output of hard links, converted again with --link copy (README's advice before
    editing OUT_DIR's files): every source file becomes a copy, with the same bytes and the same
    manifest, so an edit in OUT_DIR no longer edits MODEL_DIR. It was "nothing to do", the hard
    links kept. ``auto`` takes any placement; --link hard links them back."""
    model_dir, out_dir = converted("kimi_k3")
    manifest = (out_dir / MANIFEST_NAME).read_bytes()
    sources = sorted(p.name for p in model_dir.iterdir())
    result = convert(model_dir, out_dir, ConvertOptions(progress=False, link="copy"))
    assert result.up_to_date and sorted(result.replaced) == sources
    for name in sources:
        assert (out_dir / name).stat().st_ino != (model_dir / name).stat().st_ino
        assert (out_dir / name).read_bytes() == (model_dir / name).read_bytes()
    assert (out_dir / MANIFEST_NAME).read_bytes() == manifest
    assert verify(out_dir, VerifyOptions(progress=False)).ok
    (out_dir / "tokenizer.json").write_text("{}")
    assert (model_dir / "tokenizer.json").read_text() != "{}"
    (out_dir / "tokenizer.json").unlink()
    again = convert(model_dir, out_dir, ConvertOptions(progress=False, link="copy"))  # repairs the edit only
    assert again.repaired == ("tokenizer.json",) and not again.replaced
    assert (out_dir / "tokenizer.json").stat().st_ino != (model_dir / "tokenizer.json").stat().st_ino
    assert not convert(model_dir, out_dir, ConvertOptions(progress=False, link="auto")).replaced
    relinked = convert(model_dir, out_dir, ConvertOptions(progress=False, link="hard"))
    assert sorted(relinked.replaced) == sources
    assert all((out_dir / name).stat().st_ino == (model_dir / name).stat().st_ino for name in sources)
    assert (out_dir / MANIFEST_NAME).read_bytes() == manifest


def _stored_bytes(path: Path, name: str) -> bytes:
    """A tensor's bytes as the real safetensors library reads them."""
    with safe_open(str(path), framework="pt") as handle:
        return handle.get_tensor(name).contiguous().view(torch.uint8).numpy().tobytes()


def test_every_recorded_digest_is_its_definition_and_sidecars_shard(
    make_model: Callable[..., Path], tmp_path: Path
) -> None:
    """Each digest of the manifest recomputed here, with hashlib and the blake3 library on bytes read
    by safetensors: sha256 of every whole file and sidecar header, BLAKE3 of every head block of a
    fold and of every source tensor it was folded from (the rules the manifest states)."""
    model_dir = make_model("kimi_k3", layers=8)
    out_dir = tmp_path / "out"
    result = convert(model_dir, out_dir, ConvertOptions(progress=False, max_shard_size=700_000, tp_sizes=(2,)))
    manifest = read_manifest(out_dir)
    assert len(result.sidecars) == len(manifest.tensors) == 3  # MLA at 4 and 8 (1-based, 8 is the last) + MTP
    heads = manifest.geometry.num_heads
    for name, record in manifest.source_files.items():
        assert record.sha256 == hashlib.sha256((out_dir / name).read_bytes()).hexdigest(), name
    for name, record in manifest.sidecars.items():
        header = (out_dir / name).read_bytes()[: 8 + int.from_bytes((out_dir / name).read_bytes()[:8], "little")]
        assert record.header_sha256 == hashlib.sha256(header).hexdigest(), name
    for tensor in manifest.tensors.values():
        data = _stored_bytes(out_dir / tensor.file, tensor.name)
        block = len(data) // heads
        assert tensor.head_blake3 == tuple(blake3(data[h * block : (h + 1) * block]).hexdigest() for h in range(heads))
        for source in tensor.sources:
            assert source.blake3 == blake3(_stored_bytes(model_dir / source.file, source.name)).hexdigest(), source.name
    assert {"head_blake3", "rank_digest", "sources", "sidecar"} <= set(
        json.loads((out_dir / MANIFEST_NAME).read_text())["integrity"]
    )
    layer = next(iter(manifest.geometry.layers))
    leaves = manifest.tensors[layer.q_fold].head_blake3
    assert (
        open_fold_set(out_dir).rank_digest(layer, 4, 1)
        == blake3(b"".join(bytes.fromhex(leaf) for leaf in leaves[2:4])).hexdigest()
    )
    for tp in (1, 4, 8):  # not the --tp given: the per-head digests serve every size dividing H
        for rank in range(tp):
            assert verify(out_dir, VerifyOptions(progress=False, rank=rank, tp=tp)).ok


def test_rerun_is_idempotent(converted: Callable[..., tuple[Path, Path]]) -> None:
    model_dir, out_dir = converted("deepseek_v3")
    before = {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out_dir.iterdir()}
    result = convert(model_dir, out_dir, QUIET)
    assert result.up_to_date and result.layers_folded == 0
    assert {p.name: (p.stat().st_mtime_ns, p.read_bytes()) for p in out_dir.iterdir()} == before


def test_float32_fold_is_within_fp32_rounding(converted: Callable[..., tuple[Path, Path]]) -> None:
    _, out_dir = converted("deepseek_v3", ConvertOptions(progress=False, fold_dtype="float32"))
    manifest = read_manifest(out_dir)
    assert manifest.fold_dtype == "float32"
    assert all(t.dtype == "F32" and t.error["rel_fro_error"] < 1e-6 for t in manifest.tensors.values())


def test_cli_dry_run_reports_the_plan_and_writes_nothing(make_model: Callable[..., Path], tmp_path: Path) -> None:
    model_dir = make_model("kimi_k3")
    out_dir = tmp_path / "never"
    run = run_foldckpt("convert", model_dir, out_dir, "--dry-run", "--tp", "1,2,4,8")
    assert run.returncode == 0, run.stderr
    assert "MLA layers 3: 3, 5, 6 (mtp)" in run.stdout
    assert "GPU memory extra per rank: TP1 1.8 MB, TP2 884.7 KB, TP4 442.4 KB, TP8 221.2 KB" in run.stdout
    assert not out_dir.exists()


def test_cli_convert_verify_inspect(make_model: Callable[..., Path], tmp_path: Path) -> None:
    model_dir = make_model("deepseek_v3_fp8")
    out_dir = tmp_path / "out"
    run = run_foldckpt("convert", model_dir, out_dir, "--quiet", "--json")
    assert run.returncode == 0, run.stderr
    assert json.loads(run.stdout)["layers_folded"] == 2
    run = run_foldckpt("verify", out_dir, "--deep", "--quiet")
    assert run.returncode == 0 and "verified" in run.stdout, run.stdout + run.stderr
    run = run_foldckpt("inspect", out_dir)
    assert run.returncode == 0 and "fold       2/2 layers, bfloat16" in run.stdout
    # dry run (the plan), inspect and the manifest count the same fold bytes; the sidecar files
    # add only their headers
    plan = json.loads(run_foldckpt("convert", model_dir, tmp_path / "again", "--dry-run", "--json").stdout)
    inspected = json.loads(run_foldckpt("inspect", out_dir, "--json").stdout)
    manifest = read_manifest(out_dir)
    layer_bytes = manifest.geometry.fold_shape[0] * manifest.geometry.fold_shape[1] * 2  # bf16
    assert plan["fold_bytes"] == inspected["fold_bytes"] == manifest.fold_bytes() == 2 * layer_bytes
    sidecar_sizes = sum((out_dir / name).stat().st_size for name in manifest.sidecars)
    assert manifest.sidecar_bytes() == sidecar_sizes
    assert 0 < sidecar_sizes - manifest.fold_bytes() <= 4096 * len(manifest.sidecars)  # a page-sized header each


def test_cli_bad_tp_is_a_one_line_error(make_model: Callable[..., Path], tmp_path: Path) -> None:
    run = run_foldckpt("convert", make_model("deepseek_v3"), tmp_path / "out", "--tp", "3")
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == ["foldckpt: error: --tp 3: does not divide the model's 8 attention heads"]


@pytest.mark.parametrize("link", ["auto", "copy"])
def test_convert_reads_every_source_byte_once_and_hashes_every_fold_byte_once(tmp_path: Path, link: str) -> None:
    """Issue 14: the pass that hashes a source file hands the fold its inputs (no second read), and
    the fold's head digests are its only hash (the sidecar's record is its header's digest)."""
    model = make_checkpoint(tmp_path / "model", "kimi_k3", shards=3)
    result = convert(model, tmp_path / "out", ConvertOptions(progress=False, link=link))
    plan = plan_conversion(model)
    sources = sum((model / name).stat().st_size for name in plan.files_to_place)
    inputs = sum(info.nbytes for layer in plan.layers for _, info in layer.input_tensors())
    copied = sources if link == "copy" else 0
    assert result.io["bytes_reread"] == 0
    assert result.io["bytes_read"] == sources + copied  # a copy reads each source once more, to copy it
    assert result.io["bytes_hashed"] == sources + inputs + plan.fold_bytes
    assert result.io["bytes_copied"] == copied
    assert result.io["bytes_written"] == plan.sidecar_bytes + copied
    assert set(result.io["stage_busy_s"]) >= {"fold", "write", "source_passes"}
    # Each sidecar's header fills whole pages, so its folds (whole pages in this geometry, as in
    # Kimi-K3's) go from their page-aligned buffers to disk with no staging copy: only the
    # headers are staged, where the filesystem does direct I/O (elsewhere nothing is).
    headers = [8 + read_header(tmp_path / "out" / shard.name).header_size for shard in plan.shards]
    assert all(size % 4096 == 0 for size in headers)
    assert result.io["bytes_staged"] == (sum(headers) if direct_io_supported(tmp_path) else 0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without a GPU")
@pytest.mark.skipif(any(map(os.path.exists, defaults.GPU_DEVICE_FILES)), reason="a machine without GPU device files")
def test_device_cuda_on_a_machine_without_a_gpu_is_one_line_exit_2_and_auto_folds_on_the_cpu(tmp_path: Path) -> None:
    model = make_checkpoint(tmp_path / "model", "deepseek_v3")
    run = run_foldckpt("convert", model, tmp_path / "out", "--device", "cuda")
    assert run.returncode == 2 and "--device cuda: torch sees no GPU" in run.stderr, run.stderr
    assert len(run.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "out").exists()  # refused before OUT_DIR is touched
    result = convert(model, tmp_path / "auto", ConvertOptions(progress=False, device="auto"))
    assert result.fold_device == "cpu"


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a GPU here")
def test_device_cuda_where_torch_sees_no_gpu_is_refused_before_any_fold_and_auto_folds_on_the_cpu(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A GPU device file but no GPU for torch (a CPU build of torch on a GPU host): --device cuda
    is confirmed once torch is imported, while the sources are hashed, so it fails then, with
    nothing folded; auto asks torch up front and folds on the CPU."""
    device_file = tmp_path / "nvidiactl"
    device_file.touch()
    monkeypatch.setattr(defaults, "GPU_DEVICE_FILES", (str(device_file),))
    model = make_checkpoint(tmp_path / "model", "deepseek_v3")
    with pytest.raises(
        FoldckptError, match=r"--device cuda: torch sees no GPU \(torch.cuda.is_available\(\) is False"
    ) as caught:
        convert(model, tmp_path / "out", ConvertOptions(progress=False, device="cuda"))
    assert str(caught.value).endswith("nothing was folded: rerun with --device cpu or auto, and --restart")
    assert not (tmp_path / "out" / MANIFEST_NAME).exists()
    assert not list((tmp_path / "out").glob("foldckpt-*.safetensors"))
    result = convert(model, tmp_path / "out", ConvertOptions(progress=False, device="auto", restart=True))
    assert result.fold_device == "cpu" and result.layers_folded == len(plan_conversion(model).layers)


def _inside(frame: FrameType | None, function: str) -> bool:
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False


def test_no_garbage_collection_runs_while_the_layers_are_folded(tmp_path: Path) -> None:
    """The folds are a conversion's critical path, and once torch is imported a collection walks its
    ~250k objects holding the GIL. With a collection due at every allocation, some run before and
    after the folds, none while any thread is inside one."""
    model = make_checkpoint(tmp_path / "model", "deepseek_v3", layers=4)
    during: list[bool] = []

    def watch(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            during.append(any(_inside(frame, "_write_shard") for frame in sys._current_frames().values()))

    threshold = gc.get_threshold()
    gc.callbacks.append(watch)
    gc.set_threshold(1)
    try:
        convert(model, tmp_path / "out", QUIET)
    finally:
        gc.set_threshold(*threshold)
        gc.callbacks.remove(watch)
    assert during and not any(during), f"{sum(during)} of {len(during)} collections ran while folding"


@pytest.mark.parametrize("enabled", [True, False], ids=["collector-on", "collector-off"])
def test_convert_leaves_the_garbage_collector_as_it_found_it(tmp_path: Path, enabled: bool) -> None:
    """convert pauses the collector while it imports torch and folds: a library call must not leave
    it off, nor turn on a collector its caller turned off."""
    model = make_checkpoint(tmp_path / "model", "deepseek_v3")
    (gc.enable if enabled else gc.disable)()
    try:
        convert(model, tmp_path / "out", QUIET)
        assert gc.isenabled() == enabled
    finally:
        gc.enable()
