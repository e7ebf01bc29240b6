"""Integrity tests written to catch the mutations of issue 12, each independent of the code it checks.

* durability: every rename of a file foldckpt wrote follows an fsync of that file, and the folder
  is fsynced after it (os.fsync / os.replace traced in-process during a real convert);
* the serving loader (no vLLM needed): a flipped byte in one rank's rows is refused for that rank,
  of any TP size, and accepted for the others; a pinned manifest; one definition of "same geometry";
* the math against references written here, not with the library: fp8 with partial row AND column
  blocks dequantized block by block in fp64; every bf16 element within one rounding of the fp64 fold
  (a bf16-accumulating fold fails);
* the MLA layer lists of each family, hard-coded (verify derives them with convert's code);
* a tamper fuzz: single-bit flips at random offsets of every output file type, and consistent
  forgeries (manifest + files edited together, digest recomputed) caught once the manifest is pinned;
* verify ``--deep`` in bounded address space (RLIMIT_AS), whatever the size of the files.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import resource
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from stat import S_ISLNK

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from foldckpt.convert import ConvertOptions, convert
from foldckpt.errors import FoldckptError, ManifestError
from foldckpt.format.manifest import FORMAT_VERSION, MANIFEST_NAME, encode_manifest, manifest_digest, read_manifest
from foldckpt.io.safetensors_format import read_header
from foldckpt.runtime.loader import open_fold_set, served_fold_set
from foldckpt.verify import VerifyOptions, verify
from tests.conftest import REPO, run_foldckpt
from tests.integration.test_verify import SMALL_SHARDS, flip_hex_digit_after, reseal_manifest, resign_raw

Converted = Callable[..., tuple[Path, Path]]


def check(out_dir: Path, level: str = "content", **kwargs: object) -> object:
    return verify(out_dir, VerifyOptions(level=level, progress=False, **kwargs))  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------
# durability: fsync before every rename, the folder after it


def test_every_rename_of_a_written_file_follows_its_fsync_and_precedes_a_folder_fsync(
    make_model: Callable[..., Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = make_model("kimi_k3")
    out_dir = tmp_path / "out"
    events: list[tuple[str, str]] = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd: int) -> None:
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def in_folder(name: object, folder: object) -> str:
        """The path of ``name``, relative to the folder descriptor ``folder`` when one is given
        (convert renames through its folder's descriptor, never by a path with links on the way)."""
        base = os.readlink(f"/proc/self/fd/{folder}") if isinstance(folder, int) else ""
        return os.path.realpath(os.path.join(base, name))  # type: ignore[arg-type]

    def replace(src: object, dst: object, **kwargs: object) -> None:
        src_path = in_folder(src, kwargs.get("src_dir_fd"))
        dst_path = in_folder(dst, kwargs.get("dst_dir_fd"))
        stat = os.stat(src, dir_fd=kwargs.get("src_dir_fd"), follow_symlinks=False)  # type: ignore[arg-type]
        linked = S_ISLNK(stat.st_mode) or stat.st_nlink > 1  # a placed link: no data of ours
        events.append(("replace-link" if linked else "replace", f"{src_path}\0{dst_path}"))
        real_replace(src, dst, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    convert(model_dir, out_dir, ConvertOptions(progress=False, link="copy"))
    monkeypatch.undo()

    renames = [(i, *path.split("\0")) for i, (kind, path) in enumerate(events) if kind == "replace"]
    journal_saves = [r for r in renames if r[2].endswith(".foldckpt-journal.json")]
    assert journal_saves and any(r[2].endswith(MANIFEST_NAME) for r in renames)
    assert any(r[2].endswith(".safetensors") and "foldckpt-" in r[2] for r in renames)
    for index, src, dst in renames:
        assert ("fsync", src) in events[:index], f"{dst} renamed into place without an fsync of {src}"
        later = events[index + 1 :]
        nxt = next((i for i, (kind, _) in enumerate(later) if kind.startswith("replace")), len(later))
        assert ("fsync", os.path.dirname(dst)) in later[:nxt], f"no fsync of the folder after renaming {dst}"
    # each folded layer's bytes are durable before the journal says so: one sidecar fsync per layer + header
    sidecar_tmp = [p for kind, p in events if kind == "fsync" and p.endswith(".safetensors.foldckpt-tmp")]
    assert len(sidecar_tmp) >= len(read_manifest(out_dir).tensors) + 1


# ------------------------------------------------------------------------------------------------
# the serving loader, in process (foldckpt.runtime.loader needs no vLLM)


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
        handle.seek(offset)
        handle.write(bytes([byte ^ 0x01]))


def test_the_loader_refuses_a_flipped_byte_for_the_rank_that_owns_it_only(converted: Converted) -> None:
    _, out_dir = converted("kimi_k3", ConvertOptions(progress=False, link="copy", tp_sizes=(1,)))
    fold_set = open_fold_set(out_dir)
    layer = fold_set.geometry.layers[1]
    record = fold_set.manifest.tensors[layer.q_fold]
    info = read_header(out_dir / record.file).tensors[record.name]
    head_bytes = info.nbytes // fold_set.geometry.num_heads
    _flip(out_dir / record.file, info.start + 5 * head_bytes + 77)  # head 5: rank 1 of 2, rank 2 of 4, rank 5 of 8
    for tp in (1, 2, 4, 8):  # --tp 1 at convert: every size dividing H is checked all the same
        owner = 5 // (8 // tp)
        for rank in range(tp):
            if rank != owner:
                rows = fold_set.read_rows(layer, tp, rank)
                assert tuple(rows.shape) == (fold_set.geometry.fold_shape[0] // tp, fold_set.geometry.q_lora_rank)
                continue
            with pytest.raises(FoldckptError, match=r"\(heads 5\) do not match their head digests") as caught:
                fold_set.read_rows(layer, tp, rank)
            assert caught.value.path == str(out_dir / record.file) and caught.value.tensor == record.name
    other = fold_set.geometry.layers[0]
    assert fold_set.read_rows(other, 2, 1).shape[0] == fold_set.geometry.fold_shape[0] // 2


def test_the_loader_refuses_a_fold_beside_weights_it_was_not_made_from(converted: Converted) -> None:
    """The manifest and sidecar of one model put into the conversion of another of the same shapes
    (and a fold input rewritten in place at the same size): every file has its recorded size and
    every head its recorded digest, all the loader checked, so vLLM served the other model's fold
    (wrong tokens from the second one on). Now each fold's inputs are hashed as served."""
    _, ours = converted("kimi_k3", ConvertOptions(progress=False, link="copy"), seed=0)
    _, theirs = converted("kimi_k3", ConvertOptions(progress=False, link="copy"), seed=1)
    for name in (MANIFEST_NAME, "foldckpt-00001-of-00001.safetensors"):
        (ours / name).unlink()
        (ours / name).write_bytes((theirs / name).read_bytes())
    fold_set = open_fold_set(ours)  # sizes and structure agree: nothing up front can tell
    layer = fold_set.geometry.layers[0]
    source = fold_set.manifest.tensors[layer.q_fold].sources[0]
    with pytest.raises(
        FoldckptError, match=rf"tensor '{source.name}' is not the one .* belongs to other weights"
    ) as caught:
        fold_set.read_rows(layer, 1, 0)
    assert caught.value.path == str(ours / source.file) and caught.value.tensor == source.name

    record = open_fold_set(theirs).manifest.tensors[layer.q_fold]
    kv_b = next(s for s in record.sources if "kv_b_proj" in s.name)
    _flip(theirs / kv_b.file, read_header(theirs / kv_b.file).tensors[kv_b.name].start + 3)
    fold_set = open_fold_set(theirs)
    with pytest.raises(FoldckptError, match=rf"tensor '{kv_b.name}' is not the one") as caught:
        fold_set.read_rows(layer, 2, 1)
    assert caught.value.tensor == kv_b.name
    other = fold_set.geometry.layers[1]  # folded from other tensors: still served
    assert fold_set.read_rows(other, 2, 1).shape[0] == fold_set.geometry.fold_shape[0] // 2


def test_the_loader_refuses_an_edited_or_unpinned_manifest(
    converted: Converted, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, out_dir = converted("kimi_k3", ConvertOptions(progress=False, link="copy"))
    digest = hashlib.sha256((out_dir / MANIFEST_NAME).read_bytes()).hexdigest()
    monkeypatch.setenv("FOLDCKPT_EXPECT_MANIFEST_SHA256", digest)
    assert open_fold_set(out_dir).manifest.file_sha256 == digest
    monkeypatch.setenv("FOLDCKPT_EXPECT_MANIFEST_SHA256", "1" * 64)
    with pytest.raises(ManifestError, match=f"{MANIFEST_NAME}: sha256 {digest} is not the pinned 1111") as caught:
        open_fold_set(out_dir)
    assert caught.value.path == str(out_dir / MANIFEST_NAME)
    monkeypatch.delenv("FOLDCKPT_EXPECT_MANIFEST_SHA256")
    flip_hex_digit_after(out_dir, read_manifest(out_dir).source_files["config.json"].sha256[:40])
    with pytest.raises(ManifestError, match="self-digest"):
        open_fold_set(out_dir)


def test_a_pin_refuses_a_directory_without_a_manifest(converted: Converted, monkeypatch: pytest.MonkeyPatch) -> None:
    """FOLDCKPT_EXPECT_MANIFEST_SHA256 names the conversion to serve: the unconverted original (or
    a conversion whose manifest went missing) was served unfolded and unchecked, the pin ignored."""
    model_dir, out_dir = converted("kimi_k3", ConvertOptions(progress=False, link="copy"))
    assert served_fold_set(model_dir) is None  # no pin: an unconverted model is served as it is
    digest = hashlib.sha256((out_dir / MANIFEST_NAME).read_bytes()).hexdigest()
    monkeypatch.setenv("FOLDCKPT_EXPECT_MANIFEST_SHA256", digest)
    served = served_fold_set(out_dir)
    assert served is not None and served.manifest.file_sha256 == digest
    for directory in (model_dir, out_dir.with_name("gone")):
        with pytest.raises(
            FoldckptError, match=f"{MANIFEST_NAME}: missing, but FOLDCKPT_EXPECT_MANIFEST_SHA256 pins"
        ) as caught:
            served_fold_set(directory)
        assert caught.value.path == str(directory / MANIFEST_NAME)


@pytest.mark.parametrize(
    "edit",
    [
        lambda c: c["text_config"].update(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}),
        lambda c: c["text_config"].update(num_nextn_predict_layers=0),
        lambda c: c["text_config"]["linear_attn_config"]["kda_layers"].remove(1),
    ],
    ids=["quantization", "mtp-dropped", "kda-layer-now-mla"],
)
def test_one_definition_of_same_geometry_refuses_a_config_edit_in_verify_and_in_serving(
    converted: Converted, edit: Callable[[dict], None]
) -> None:
    _, out_dir = converted("kimi_k3", ConvertOptions(progress=False, link="copy"))
    path = out_dir / "config.json"
    config = json.loads(path.read_text())
    edit(config)
    path.unlink()
    path.write_text(json.dumps(config, indent=2))
    resign_raw(
        out_dir,
        lambda d: d["source_files"]["config.json"].update(
            size=path.stat().st_size, sha256=hashlib.sha256(path.read_bytes()).hexdigest()
        ),
    )
    report = check(out_dir, "structure")
    assert not report.ok and [(p.file, report.levels[-1].name) for p in report.problems] == [
        ("config.json", "structure")
    ]
    assert "describes another model than foldckpt.json was made for" in report.problems[0].what
    with pytest.raises(FoldckptError, match="config.json: describes another model") as caught:
        open_fold_set(out_dir)
    assert caught.value.path == str(path)


def test_the_serving_loader_does_not_import_the_conversion_planner() -> None:
    code = "import sys, foldckpt.runtime.loader; print(sorted(m for m in sys.modules if m in ('foldckpt.convert.plan', 'foldckpt.convert', 'foldckpt.convert.layer')))"
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=REPO)
    assert run.stdout.strip() == "[]"


# ------------------------------------------------------------------------------------------------
# the math, against references written here


def _ulp_bound(exact: torch.Tensor, w_uk: torch.Tensor, w_qb: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """One rounding of the fp64 value to ``dtype`` (at most one ulp there, to be generous with ties
    after an fp32 accumulation) plus the fp32 accumulation error bound P·2⁻²⁴·Σ|a||b|, twice."""
    mantissa = {torch.bfloat16: 7, torch.float16: 10}[dtype]
    exponent = torch.floor(torch.log2(exact.abs().clamp(min=2.0**-126)))
    p = w_uk.shape[0]
    return torch.exp2(exponent - mantissa) + 2 * p * 2.0**-24 * (w_uk.abs().T @ w_qb.abs())


def _fp64_fold(
    q_b: torch.Tensor, kv_b: torch.Tensor, heads: int, nope: int, rope: int, v: int
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Per head: (exact nope rows, W_UK, W_qb_nope, rope rows), all fp64, from the definition."""
    out = []
    for h in range(heads):
        w_qb = q_b[h * (nope + rope) : h * (nope + rope) + nope]
        w_pe = q_b[h * (nope + rope) + nope : (h + 1) * (nope + rope)]
        w_uk = kv_b[h * (nope + v) : h * (nope + v) + nope]
        out.append((w_uk.T @ w_qb, w_uk, w_qb, w_pe))
    return out


def _assert_one_rounding(
    stored: torch.Tensor, q_b: torch.Tensor, kv_b: torch.Tensor, heads: int, nope: int, rope: int, v: int
) -> None:
    lora = kv_b.shape[1]
    per_head = stored.reshape(heads, lora + rope, -1)
    for h, (exact, w_uk, w_qb, w_pe) in enumerate(_fp64_fold(q_b, kv_b, heads, nope, rope, v)):
        got = per_head[h, :lora].to(torch.float64)
        excess = (got - exact).abs() - _ulp_bound(exact, w_uk, w_qb, stored.dtype)
        assert (excess <= 0).all(), f"head {h}: {(excess > 0).sum().item()} element(s) beyond one rounding"
        assert torch.equal(per_head[h, lora:], w_pe.to(stored.dtype)), (
            f"head {h}: rope rows are not the q_b_proj rows rounded once"
        )


def _read(path: Path, name: str) -> torch.Tensor:
    with safe_open(str(path), framework="pt") as handle:  # the safetensors library, not foldckpt's reader
        return handle.get_tensor(name)


@pytest.mark.parametrize("family", ["deepseek_v3", "kimi_k3"])
def test_every_bf16_element_is_the_fp64_fold_rounded_once(converted: Converted, family: str) -> None:
    model_dir, out_dir = converted(family)
    manifest = read_manifest(out_dir)
    g = manifest.geometry
    for tensor in manifest.tensors.values():
        q_src, kv_src = tensor.sources
        q_b = _read(model_dir / q_src.file, q_src.name).to(torch.float64)
        kv_b = _read(model_dir / kv_src.file, kv_src.name).to(torch.float64)
        stored = _read(out_dir / tensor.file, tensor.name)
        assert stored.dtype == torch.bfloat16
        _assert_one_rounding(stored, q_b, kv_b, g.num_heads, g.qk_nope_head_dim, g.qk_rope_head_dim, g.v_head_dim)


def test_a_bf16_accumulated_fold_is_not_one_rounding(converted: Converted) -> None:
    """The check above and verify --deep both tell a bf16-accumulating fold apart."""
    model_dir, out_dir = converted("kimi_k3", SMALL_SHARDS)
    manifest = read_manifest(out_dir)
    g = manifest.geometry
    tensor = next(iter(manifest.tensors.values()))
    q_src, kv_src = tensor.sources
    q_b, kv_b = _read(model_dir / q_src.file, q_src.name), _read(model_dir / kv_src.file, kv_src.name)
    p, r, v = g.qk_nope_head_dim, g.qk_rope_head_dim, g.v_head_dim
    qh, kvh = q_b.reshape(g.num_heads, p + r, -1), kv_b.reshape(g.num_heads, p + v, -1)
    acc = torch.zeros(g.num_heads, g.kv_lora_rank, g.q_lora_rank, dtype=torch.bfloat16)
    for k in range(p):  # accumulate in bf16: one rounding per term (CPU bf16 matmul accumulates in fp32)
        acc = acc + kvh[:, k, :, None] * qh[:, k, None, :]
    bad = torch.cat([acc, qh[:, p:]], dim=1).reshape(g.fold_shape)
    with pytest.raises(AssertionError, match="beyond one rounding"):
        _assert_one_rounding(bad, q_b.double(), kv_b.double(), g.num_heads, p, r, v)
    info = read_header(out_dir / tensor.file).tensors[tensor.name]
    with open(out_dir / tensor.file, "r+b") as handle:
        handle.seek(info.start)
        handle.write(bad.contiguous().view(torch.uint8).numpy().tobytes())
    reseal_manifest(out_dir)
    report = check(out_dir, "deep")
    assert not report.ok and report.levels[-1].name == "deep"
    assert [(p.file, p.tensor) for p in report.problems] == [(tensor.file, tensor.name)]


_FP8 = dict(heads=6, q_lora=200, kv_lora=200, nope=32, rope=16, v=40, layers=2, mtp=1)


def _write_fp8_model(model_dir: Path) -> None:
    """A DeepSeek-V3 fp8 checkpoint (attention only) whose q_b_proj [288, 200] and kv_b_proj
    [432, 200] end in partial 128x128 blocks along rows AND columns, each block with its own scale."""
    d = _FP8
    model_dir.mkdir(parents=True)
    config = {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "num_attention_heads": d["heads"],
        "q_lora_rank": d["q_lora"],
        "kv_lora_rank": d["kv_lora"],
        "qk_nope_head_dim": d["nope"],
        "qk_rope_head_dim": d["rope"],
        "v_head_dim": d["v"],
        "num_hidden_layers": d["layers"],
        "num_nextn_predict_layers": d["mtp"],
        "hidden_size": 64,
        "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]},
    }
    (model_dir / "config.json").write_text(json.dumps(config))
    generator = torch.Generator().manual_seed(7)
    tensors = {}
    for layer in range(d["layers"] + d["mtp"]):
        for name, rows, cols in (
            ("q_b_proj", d["heads"] * (d["nope"] + d["rope"]), d["q_lora"]),
            ("kv_b_proj", d["heads"] * (d["nope"] + d["v"]), d["kv_lora"]),
        ):
            blocks = (-(-rows // 128), -(-cols // 128))
            scale = torch.rand(blocks, generator=generator) * 0.02 + 0.001  # a different scale per block
            expanded = scale.repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
            weight = (torch.randn(rows, cols, generator=generator) * 100).clamp(-440, 440).to(torch.float8_e4m3fn)
            tensors[f"model.layers.{layer}.self_attn.{name}.weight"] = weight
            tensors[f"model.layers.{layer}.self_attn.{name}.weight_scale_inv"] = scale
            assert expanded.shape == (rows, cols)
    save_file(tensors, str(model_dir / "model.safetensors"))


def _dequantize_by_blocks(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    out = weight.to(torch.float64)
    for bi in range(scale.shape[0]):
        for bj in range(scale.shape[1]):
            out[bi * 128 : (bi + 1) * 128, bj * 128 : (bj + 1) * 128] *= float(scale[bi, bj])
    return out


def test_fp8_with_partial_blocks_matches_an_independent_blockwise_reference(tmp_path: Path) -> None:
    model_dir, out_dir = tmp_path / "fp8", tmp_path / "fp8-folded"
    _write_fp8_model(model_dir)
    convert(model_dir, out_dir, ConvertOptions(progress=False))
    manifest = read_manifest(out_dir)
    assert [layer.index for layer in manifest.geometry.layers] == [0, 1, 2]
    d = _FP8
    for layer in range(3):
        prefix = f"model.layers.{layer}.self_attn"
        q_b = _dequantize_by_blocks(
            _read(model_dir / "model.safetensors", f"{prefix}.q_b_proj.weight"),
            _read(model_dir / "model.safetensors", f"{prefix}.q_b_proj.weight_scale_inv"),
        )
        kv_b = _dequantize_by_blocks(
            _read(model_dir / "model.safetensors", f"{prefix}.kv_b_proj.weight"),
            _read(model_dir / "model.safetensors", f"{prefix}.kv_b_proj.weight_scale_inv"),
        )
        stored = _read(out_dir / manifest.tensors[f"{prefix}.q_fold.weight"].file, f"{prefix}.q_fold.weight")
        _assert_one_rounding(stored, q_b, kv_b, d["heads"], d["nope"], d["rope"], d["v"])
    run = run_foldckpt("verify", out_dir, "--deep", "-q")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "every element within one rounding of fp64" in run.stdout


# ------------------------------------------------------------------------------------------------
# the MLA layers of each family, hard-coded (not derived with geometry.py, which convert uses)

EXPECTED_LAYERS = {  # (family, make_checkpoint kwargs) -> [(config index, tensor prefix, is_mtp)]
    ("deepseek_v3", (("layers", 2), ("mtp_layers", 1))): [
        (0, "model.layers.0", False),
        (1, "model.layers.1", False),
        (2, "model.layers.2", True),
    ],
    ("kimi_k25", ()): [(0, "language_model.model.layers.0", False), (1, "language_model.model.layers.1", False)],
    # Kimi-K3, 6 layers: MLA every 4th (1-based) and the last, i.e. config indices 3 and 5, plus MTP 6
    ("kimi_k3", ()): [
        (3, "language_model.model.layers.3", False),
        (5, "language_model.model.layers.5", False),
        (6, "language_model.model.layers.6", True),
    ],
    ("kimi_k3", (("layers", 8),)): [
        (3, "language_model.model.layers.3", False),
        (7, "language_model.model.layers.7", False),
        (8, "language_model.model.layers.8", True),
    ],
}


@pytest.mark.parametrize(("family", "kwargs"), list(EXPECTED_LAYERS), ids=lambda v: str(v))
def test_convert_and_verify_cover_exactly_the_expected_mla_layers(
    converted: Converted, family: str, kwargs: tuple
) -> None:
    _, out_dir = converted(family, **dict(kwargs))
    expected = EXPECTED_LAYERS[(family, kwargs)]
    manifest = read_manifest(out_dir)
    assert [(layer.index, layer.prefix, layer.is_mtp) for layer in manifest.geometry.layers] == expected
    assert list(manifest.tensors) == [f"{prefix}.self_attn.q_fold.weight" for _, prefix, _ in expected]
    assert check(out_dir, "structure").ok


# ------------------------------------------------------------------------------------------------
# tamper fuzz: single-bit flips at random offsets of every output file type, consistent forgeries


def _file_types(out_dir: Path) -> dict[str, tuple[str, int, int]]:
    """file type -> (file, first offset, end offset) to flip bits in."""
    manifest = read_manifest(out_dir)
    sidecar = next(iter(manifest.sidecars))
    header = read_header(out_dir / sidecar)
    shard = max(
        (n for n in manifest.source_files if n.endswith(".safetensors")), key=lambda n: manifest.source_files[n].size
    )
    shard_header = read_header(out_dir / shard)
    size = lambda name: (out_dir / name).stat().st_size  # noqa: E731
    return {
        "sidecar header": (sidecar, 0, 8 + header.header_size),
        "sidecar fold data": (sidecar, 8 + header.header_size, size(sidecar)),
        "source shard header": (shard, 0, 8 + shard_header.header_size),
        "source shard data": (shard, 8 + shard_header.header_size, size(shard)),
        "index": ("model.safetensors.index.json", 0, size("model.safetensors.index.json")),
        "config": ("config.json", 0, size("config.json")),
        "tokenizer": ("tokenizer.json", 0, size("tokenizer.json")),
        "manifest": (MANIFEST_NAME, 0, size(MANIFEST_NAME)),
    }


FLIPS_PER_TYPE = 12


def test_tamper_fuzz_catches_every_single_bit_flip_and_every_pinned_forgery(
    converted: Converted, capsys: pytest.CaptureFixture
) -> None:
    _, out_dir = converted("kimi_k3", ConvertOptions(progress=False, link="copy"))
    rng = random.Random(12)
    caught: dict[str, int] = {}
    for kind, (file, start, end) in _file_types(out_dir).items():
        path = out_dir / file
        original = path.read_bytes()
        caught[kind] = 0
        for _ in range(FLIPS_PER_TYPE):
            offset, bit = rng.randrange(start, end), 1 << rng.randrange(8)
            data = bytearray(original)
            data[offset] ^= bit
            path.write_bytes(bytes(data))
            try:
                report = check(out_dir)
            except FoldckptError as exc:  # unusable input (exit 2) counts as caught only if it names the file
                ok, names = False, {Path(exc.path or "").name}
            else:
                ok, names = report.ok, {p.file for p in report.problems}
            if kind == "manifest":
                assert names == {MANIFEST_NAME}, (offset, bit, names)
                assert report.levels[-1].name == "manifest"  # the first level, exit 1
            if not ok:
                caught[kind] += 1
            path.write_bytes(original)
        assert check(out_dir).ok
    total = sum(caught.values())
    with capsys.disabled():
        print(f"\ntamper fuzz: {total}/{FLIPS_PER_TYPE * len(caught)} single-bit flips caught: {caught}")
    assert total == FLIPS_PER_TYPE * len(caught), caught

    # consistent forgeries: files and manifest edited together, the self-digest recomputed
    pinned = hashlib.sha256((out_dir / MANIFEST_NAME).read_bytes()).hexdigest()
    manifest = read_manifest(out_dir)
    tensor = next(iter(manifest.tensors.values()))
    info = read_header(out_dir / tensor.file).tensors[tensor.name]
    _flip(out_dir / tensor.file, info.start + 1000)  # a fold's low bit: within any tolerance
    reseal_manifest(out_dir)
    forged = [check(out_dir).ok]
    resign_raw(
        out_dir, lambda d: d["tensors"][tensor.name]["error_vs_fp64"].update(rel_fro_error=1e-9)
    )  # manifest only
    forged.append(check(out_dir).ok)
    assert all(forged), "a consistent forgery is indistinguishable without a pin"
    report = check(out_dir, expect_manifest_sha256=pinned)
    assert not report.ok and [p.file for p in report.problems] == [MANIFEST_NAME]
    with pytest.raises(ManifestError, match="not the pinned"):
        open_fold_set(out_dir, expect_sha256=pinned)


# ------------------------------------------------------------------------------------------------
# bounded memory: verify --deep under RLIMIT_AS, whatever the size of the files

_VMPEAK = "import atexit, sys; atexit.register(lambda: print([l for l in open('/proc/self/status') if l.startswith('VmPeak')][0], file=sys.stderr)); from foldckpt.cli import main; main(sys.argv[1:])"


def _add_big_sparse_shard(model_dir: Path, size: int) -> None:
    """A shard holding one big tensor (a sparse file: no disk written), listed in the index."""
    name, tensor = "model-extra.safetensors", "model.extra_experts.weight"
    header = json.dumps({tensor: {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}}).encode()
    header += b" " * (-len(header) % 8)
    with open(model_dir / name, "wb") as handle:
        handle.write(struct.pack("<Q", len(header)) + header)
        handle.truncate(8 + len(header) + size)
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"][tensor] = name
    index_path.write_text(json.dumps(index))


def _limited(limit: int | None) -> Callable[[], None] | None:
    if limit is None:
        return None
    return lambda: resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def _verify_deep(out_dir: Path, limit: int | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "MALLOC_ARENA_MAX": "2", "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-c", _VMPEAK, "verify", str(out_dir), "--deep", "-q", "--workers", "2"],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
        preexec_fn=_limited(limit),
        check=False,
    )


def test_verify_deep_runs_in_bounded_address_space_whatever_the_file_sizes(
    make_model: Callable[..., Path], tmp_path: Path
) -> None:
    small_model = make_model("deepseek_v3")
    convert(small_model, tmp_path / "small", ConvertOptions(progress=False))
    baseline = _verify_deep(tmp_path / "small")
    assert baseline.returncode == 0, baseline.stdout + baseline.stderr
    peak_kb = int(baseline.stderr.strip().splitlines()[-1].split()[1])
    big_model = make_model("deepseek_v3")
    big = 2 * 1024**3  # 2 GiB in one tensor: a whole-file map or read would need that much more
    _add_big_sparse_shard(big_model, big)
    convert(big_model, tmp_path / "big", ConvertOptions(progress=False))
    limit = peak_kb * 1024 + 512 * 1024**2
    run = _verify_deep(tmp_path / "big", limit)
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    assert "verified in" in run.stdout


@pytest.mark.parametrize("version", [1, 2, 3, 4])
def test_an_output_of_an_older_manifest_format_is_refused_then_replaced_by_restart(
    converted: Converted, version: int
) -> None:
    model_dir, out_dir = converted("deepseek_v3")
    path = out_dir / MANIFEST_NAME
    data = json.loads(path.read_bytes())
    if version == 1:
        del data["manifest_sha256"]
        data.update(format_version=1, tp_sizes=[1, 2, 4, 8])
    elif version == 2:  # whole-file sidecar hashes, self-digested
        data["format_version"] = 2
        for record in data["sidecars"].values():
            record["sha256"] = record.pop("header_sha256")
        data["manifest_sha256"] = manifest_digest(data)
    elif version == 4:  # folds rounded from fp32 sums, and the device that made them
        data["format_version"] = 4
        data["fold"]["accumulation_dtype"] = "float32"
        del data["fold"]["rounding"]
        data["parameters"]["fold_device"] = "cpu"
        data["manifest_sha256"] = manifest_digest(data)
    else:  # sha256 where format 4 has BLAKE3, self-digested
        data["format_version"] = 3
        for tensor in data["tensors"].values():
            tensor["head_sha256"] = tensor.pop("head_blake3")
            for source in tensor["sources"]:
                source["sha256"] = source.pop("blake3")
        data["manifest_sha256"] = manifest_digest(data)
    path.write_bytes(encode_manifest(data))
    for attempt in (
        lambda: open_fold_set(out_dir),
        lambda: convert(model_dir, out_dir, ConvertOptions(progress=False)),
    ):
        with pytest.raises(FoldckptError, match=f"manifest format {version} .* reconvert") as caught:
            attempt()
        assert not isinstance(caught.value, ManifestError)  # unusable input (exit 2), not a failed check
    convert(model_dir, out_dir, ConvertOptions(progress=False, restart=True))
    assert read_manifest(out_dir).format_version == FORMAT_VERSION == 5 and check(out_dir).ok


@pytest.mark.parametrize("version", [1, 2, 3, 4, 6])
def test_an_edited_format_version_fails_the_self_digest_not_the_format_check(
    converted: Converted, version: int
) -> None:
    """``"format_version": 5`` edited in the file's bytes: an edit of a current manifest (exit 1,
    self-digest), not an output of an older foldckpt to reconvert (exit 2), which the format check,
    run before the digest, called it."""
    _, out_dir = converted("deepseek_v3")
    path = out_dir / MANIFEST_NAME
    raw = path.read_bytes()
    assert raw.count(b'"format_version": 5,') == 1
    path.write_bytes(raw.replace(b'"format_version": 5,', f'"format_version": {version},'.encode()))
    run = run_foldckpt("verify", out_dir, "-q")
    assert run.returncode == 1, run.stdout + run.stderr
    assert (
        "FAIL manifest" in run.stdout and "its self-digest (manifest_sha256) does not match its content" in run.stdout
    )
    assert "reconvert" not in run.stdout + run.stderr
    with pytest.raises(ManifestError, match="self-digest"):
        open_fold_set(out_dir)
