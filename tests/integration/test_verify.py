"""``foldckpt verify`` on real converted directories, clean and tampered with (no mocks).

Every tamper test damages real files the way a disk, a copy or a person would, then asserts the
level that catches it, that no cheaper level already failed, and that the report names the damaged
file (and tensor where there is one). The library ``verify()`` is used for most cases; the real
command line for exit codes, ``--json`` and a few representative cases.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from foldckpt.convert import ConvertOptions, convert
from foldckpt.errors import FoldckptError
from foldckpt.fold import reference_fold_heads
from foldckpt.format.consistency import header_sha256
from foldckpt.format.manifest import (
    DIGEST_KEY,
    MANIFEST_NAME,
    SidecarRecord,
    encode_manifest,
    manifest_digest,
    read_manifest,
    write_manifest,
)
from foldckpt.io.direct_io import DIRECT_CHUNK
from foldckpt.io.files import HASH_BUFFER
from foldckpt.io.hashing import chunks, head_digests, in_page_cache
from foldckpt.io.safetensors_format import TensorInfo, read_header
from foldckpt.model.synthetic import make_checkpoint
from foldckpt.tensors import TORCH_DTYPES, read_tensor
from foldckpt.verify import LEVELS, LevelResult, Problem, VerifyOptions, VerifyReport, check_deep, verify
from tests.conftest import direct_io_supported, evict_from_page_cache, run_foldckpt

Converted = Callable[..., tuple[Path, Path]]
# Three MLA layers (3, 5 and the MTP layer 6) of ~590 KB folds, one per sidecar.
SMALL_SHARDS = ConvertOptions(progress=False, max_shard_size=700_000)
SIDECARS = [f"foldckpt-0000{i}-of-00003.safetensors" for i in (1, 2, 3)]


# ------------------------------------------------------------------------------------------------
# helpers: real damage to real files


def run_verify(out_dir: Path, level: str = "deep", **kwargs: object) -> VerifyReport:
    return verify(out_dir, VerifyOptions(level=level, progress=False, **kwargs))  # type: ignore[arg-type]


def failed_level(report: VerifyReport, expected: str) -> LevelResult:
    """The report failed exactly at ``expected``: every cheaper level passed, nothing ran after it."""
    names = [level.name for level in report.levels]
    assert names == list(LEVELS[: LEVELS.index(expected) + 1]), names
    assert all(level.ok for level in report.levels[:-1]), [lv.to_dict() for lv in report.levels]
    assert not report.ok and not report.levels[-1].ok and report.levels[-1].problems
    return report.levels[-1]


def files_named(problems: tuple[Problem, ...]) -> set[str]:
    return {problem.file for problem in problems}


def tensor_info(path: Path, name: str) -> TensorInfo:
    return read_header(path).tensors[name]


def flip_byte(path: Path, offset: int, value: int | None = None) -> None:
    """Change the byte at ``offset`` (all its bits, or to ``value``)."""
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)[0]
        assert value != byte
        handle.seek(offset)
        handle.write(bytes([byte ^ 0xFF if value is None else value]))


def rewrite_tensor(path: Path, info: TensorInfo, transform: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Change one tensor's values in place (same dtype and size), as an edit of the weights would."""
    with open(path, "r+b") as handle:
        handle.seek(info.start)
        data = bytearray(handle.read(info.nbytes))
        tensor = torch.frombuffer(data, dtype=TORCH_DTYPES[info.dtype]).reshape(info.shape)
        new = transform(tensor.clone()).to(tensor.dtype).contiguous()
        assert not torch.equal(new, tensor)
        handle.seek(info.start)
        handle.write(new.view(torch.uint8).numpy().tobytes())


def flip_hex_digit_after(out_dir: Path, needle: str) -> None:
    """Change one byte of the manifest: the first hex digit that follows ``needle`` (which must be unique)."""
    path = out_dir / MANIFEST_NAME
    raw = bytearray(path.read_bytes())
    assert raw.count(needle.encode()) == 1, needle
    position = raw.index(needle.encode()) + len(needle)
    raw[position] = ord("1") if raw[position] == ord("0") else ord("0")
    path.write_bytes(bytes(raw))


def resign_raw(out_dir: Path, edit: Callable[[dict], None]) -> None:
    """Edit the manifest's JSON and re-sign it (a forger who knows the self-digest rule)."""
    path = out_dir / MANIFEST_NAME
    data = json.loads(path.read_bytes())
    edit(data)
    data[DIGEST_KEY] = manifest_digest(data)
    path.write_bytes(encode_manifest(data))


def reseal_manifest(out_dir: Path) -> None:
    """Recompute every sidecar hash of the manifest from the bytes on disk and re-sign it (an
    adversary who edits both a fold and its hashes): unpinned, only ``--deep`` can then tell."""
    manifest = read_manifest(out_dir)
    tensors = dict(manifest.tensors)
    for name, tensor in tensors.items():
        path = out_dir / tensor.file
        info = tensor_info(path, name)
        data = path.read_bytes()[info.start : info.end]
        tensors[name] = dataclasses.replace(tensor, head_blake3=head_digests(data, manifest.geometry.num_heads))
    sidecars = {
        name: SidecarRecord((out_dir / name).stat().st_size, header_sha256(read_header(out_dir / name)))
        for name in manifest.sidecars
    }
    write_manifest(out_dir, dataclasses.replace(manifest, tensors=tensors, sidecars=sidecars))


def fold_names(out_dir: Path, sidecar: str) -> list[str]:
    return [name for name, t in read_manifest(out_dir).tensors.items() if t.file == sidecar]


# ------------------------------------------------------------------------------------------------
# clean conversions


@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v3_fp8", "kimi_k3"])
def test_a_clean_conversion_verifies_at_every_level(converted: Converted, family: str) -> None:
    _, out_dir = converted(family)
    for level in LEVELS:
        report = run_verify(out_dir, level)
        assert report.ok, report.to_dict()
        assert [lv.name for lv in report.levels] == list(LEVELS[: LEVELS.index(level) + 1])
    deep = report.levels[-1]
    layers = len(read_manifest(out_dir).tensors)
    assert f"{layers}/{layers} layer(s) recomputed: {layers} bitwise identical to the exact fold" in deep.summary
    content = report.levels[2]  # every source byte and every fold byte once (headers: structure)
    manifest = read_manifest(out_dir)
    assert content.bytes_read == sum(r.size for r in manifest.source_files.values()) + manifest.fold_bytes()


def test_a_clean_multi_sidecar_conversion_verifies_every_rank(converted: Converted) -> None:
    _, out_dir = converted("kimi_k3", SMALL_SHARDS)
    manifest = read_manifest(out_dir)
    assert sorted(manifest.sidecars) == SIDECARS
    assert run_verify(out_dir).ok
    full = run_verify(out_dir, "content").levels[-1].bytes_read
    for tp in (1, 2, 4, 8):
        for rank in range(tp):
            report = run_verify(out_dir, "content", rank=rank, tp=tp)
            assert report.ok, report.to_dict()
            # a serving node reads the sources, the sidecar headers and only its slice of each fold
            fold_bytes = manifest.fold_bytes()
            assert report.levels[-1].bytes_read <= full - fold_bytes + fold_bytes // tp


def test_cli_clean_verify_exits_0_with_a_json_report(converted: Converted) -> None:
    _, out_dir = converted("deepseek_v3")
    run = run_foldckpt("verify", out_dir, "--deep", "--sample", "1", "--json")
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(run.stdout)
    assert report["ok"] is True and [lv["name"] for lv in report["levels"]] == list(LEVELS)
    assert all(lv["ok"] and lv["problems"] == [] for lv in report["levels"])
    assert "1/2 layer(s) recomputed" in report["levels"][-1]["summary"]


@pytest.mark.parametrize("sample", [1, 2, 5])
def test_deep_sample_recomputes_that_many_layers(converted: Converted, sample: int) -> None:
    _, out_dir = converted("kimi_k3")
    report = run_verify(out_dir, sample=sample)
    assert report.ok, report.to_dict()
    assert f"{min(sample, 3)}/3 layer(s) recomputed" in report.levels[-1].summary
    assert "every element within one rounding of fp64" in report.levels[-1].summary


@pytest.mark.parametrize("command", ["verify", "convert"])
def test_torch_s_openmp_threads_sleep_between_the_small_gemms_of_deep_and_convert(
    converted: Converted, tmp_path: Path, command: str
) -> None:
    """OpenMP's default spins each thread after a parallel region (libgomp: GOMP_SPINCOUNT
    300000): ``verify --deep``, whose many small GEMMs each end one, ran ten times and more slower
    on a loaded 2-core machine than with one thread; convert already asked for passive threads,
    verify did not. libgomp reports the setting it runs with (OMP_DISPLAY_ENV)."""
    model, out_dir = converted("kimi_k3")
    # LD_PRELOAD too: vLLM's CPU platform preloads torch's libgomp (into this test process's
    # environment, once a test has built a vLLM config), which then starts before foldckpt can ask.
    env = {key: value for key, value in os.environ.items() if not key.startswith(("OMP_", "GOMP_", "LD_PRELOAD"))}
    env["OMP_DISPLAY_ENV"] = "VERBOSE"
    args = ["verify", out_dir, "--deep", "-q"] if command == "verify" else ["convert", model, tmp_path / "again", "-q"]
    run = run_foldckpt(*args, env=env)
    assert run.returncode == 0, run.stdout + run.stderr
    if "GOMP_SPINCOUNT" not in run.stderr:
        pytest.skip("torch's OpenMP runtime is not libgomp: it does not report its wait policy")
    assert "GOMP_SPINCOUNT = '0'" in run.stderr, run.stderr


# ------------------------------------------------------------------------------------------------
# sidecars


@pytest.mark.parametrize("sidecar", SIDECARS)
def test_a_flipped_byte_in_any_sidecar_fold_fails_content_naming_the_file_and_tensor(
    converted: Converted, sidecar: str
) -> None:
    _, out_dir = converted("kimi_k3", SMALL_SHARDS)
    (tensor,) = fold_names(out_dir, sidecar)
    info = tensor_info(out_dir / sidecar, tensor)
    flip_byte(out_dir / sidecar, info.start + info.nbytes // 3)
    level = failed_level(run_verify(out_dir), "content")
    assert files_named(level.problems) == {sidecar}
    (problem,) = level.problems
    assert problem.tensor == tensor and f"tensor '{tensor}' differs from its head digests" in problem.what


def test_a_flipped_byte_in_a_sidecar_header_fails_structure(converted: Converted) -> None:
    _, out_dir = converted("kimi_k3", SMALL_SHARDS)
    flip_byte(out_dir / SIDECARS[1], 8)  # the header's opening brace
    level = failed_level(run_verify(out_dir), "structure")
    assert files_named(level.problems) == {SIDECARS[1]}
    assert "not a valid safetensors file" in level.problems[0].what


def test_a_flipped_byte_in_sidecar_metadata_fails_structure_with_the_tensors_intact(converted: Converted) -> None:
    _, out_dir = converted("deepseek_v3")
    sidecar = "foldckpt-00001-of-00001.safetensors"
    raw = (out_dir / sidecar).read_bytes()
    flip_byte(out_dir / sidecar, raw.index(b'"foldckpt ') + 1, ord("F"))  # "producer": "Foldckpt x.y": still valid
    level = failed_level(run_verify(out_dir), "structure")
    assert [(p.file, p.tensor) for p in level.problems] == [(sidecar, None)]  # the header digest only: folds are fine
    assert "header sha256" in level.problems[0].what


def test_the_rank_slice_mode_checks_only_what_that_rank_loads(converted: Converted) -> None:
    _, out_dir = converted("kimi_k3", SMALL_SHARDS)
    sidecar = SIDECARS[0]
    (tensor,) = fold_names(out_dir, sidecar)
    info = tensor_info(out_dir / sidecar, tensor)
    geometry = read_manifest(out_dir).geometry
    start, _ = geometry.rank_rows(2, 1)
    flip_byte(out_dir / sidecar, info.start + start * (info.nbytes // geometry.fold_shape[0]) + 5)
    assert run_verify(out_dir, "content", rank=0, tp=2).ok  # rank 0's rows are intact
    level = failed_level(run_verify(out_dir, "content", rank=1, tp=2), "content")
    assert [(p.file, p.tensor) for p in level.problems] == [(sidecar, tensor)]
    assert "rank 1/2 rows of" in level.problems[0].what and "(head(s) 4)" in level.problems[0].what
    level = failed_level(run_verify(out_dir), "content")
    affected = next(p for p in level.problems if p.tensor == tensor).what
    assert "rank slices affected: 0/1, 1/2, 2/4, 4/8" in affected


def test_cli_rank_and_tp_errors_are_unusable_input(converted: Converted) -> None:
    _, out_dir = converted("deepseek_v3", ConvertOptions(progress=False, tp_sizes=(2, 4)))
    assert run_verify(out_dir, "content", rank=7, tp=8).ok  # any TP size dividing H, whatever --tp said
    with pytest.raises(FoldckptError, match=r"--tp 3: does not divide the model's 8 attention heads"):
        run_verify(out_dir, "content", rank=0, tp=3)
    with pytest.raises(FoldckptError, match="--rank 4 is outside TP 4"):
        run_verify(out_dir, "content", rank=4, tp=4)
    with pytest.raises(FoldckptError, match="--rank and --tp go together"):
        run_verify(out_dir, "content", rank=1)
    run = run_foldckpt("verify", out_dir, "--rank", "1", "--tp", "3")
    assert run.returncode == 2 and "--tp 3: does not divide" in run.stderr, run.stderr


def test_a_deleted_sidecar_fails_the_manifest_level(converted: Converted) -> None:
    _, out_dir = converted("kimi_k3", SMALL_SHARDS)
    (out_dir / SIDECARS[2]).unlink()
    level = failed_level(run_verify(out_dir), "manifest")
    assert [(p.file, p.what) for p in level.problems] == [(SIDECARS[2], "listed in foldckpt.json but missing")]


def test_cli_a_deleted_sidecar_exits_1_and_the_json_names_it(converted: Converted) -> None:
    _, out_dir = converted("deepseek_v3")
    sidecar = "foldckpt-00001-of-00001.safetensors"
    (out_dir / sidecar).unlink()
    run = run_foldckpt("verify", out_dir, "--json")
    assert run.returncode == 1, run.stdout + run.stderr
    report = json.loads(run.stdout)
    assert report["ok"] is False and [lv["name"] for lv in report["levels"]] == ["manifest"]
    (problem,) = report["levels"][0]["problems"]
    assert problem["file"] == sidecar and problem["what"] == "listed in foldckpt.json but missing"
    text = run_foldckpt("verify", out_dir, "--quiet")
    assert (
        text.returncode == 1
        and f"- {sidecar}: listed in foldckpt.json but missing" in text.stdout
        and "verification FAILED" in text.stdout
    )


@pytest.mark.parametrize("stray", ["foldckpt-00002-of-00002.safetensors", "model-00004-of-00004.safetensors"])
def test_a_stray_safetensors_file_fails_the_manifest_level(converted: Converted, stray: str) -> None:
    _, out_dir = converted("deepseek_v3")
    shutil.copyfile(out_dir / "foldckpt-00001-of-00001.safetensors", out_dir / stray)
    level = failed_level(run_verify(out_dir), "manifest")
    assert files_named(level.problems) == {stray} and "stray" in level.problems[0].what


def add_chat_template(out_dir: Path, outside: Path) -> str:
    (out_dir / "chat_template.jinja").write_text("{{ messages }}")
    return "chat_template.jinja"


def add_remote_code(out_dir: Path, outside: Path) -> str:
    (out_dir / "modeling_deepseek.py").write_text("import os\n")
    return "modeling_deepseek.py"


def add_tokenizer_link(out_dir: Path, outside: Path) -> str:
    (outside / "tokenizer.model").write_bytes(b"\x00" * 64)
    (out_dir / "tokenizer.model").symlink_to(outside / "tokenizer.model")
    return "tokenizer.model"


def add_dangling_link(out_dir: Path, outside: Path) -> str:
    (out_dir / "preprocessor_config.json").symlink_to(outside / "nowhere.json")
    return "preprocessor_config.json"


def add_nested_folder(out_dir: Path, outside: Path) -> str:
    (out_dir / "extra" / "deeper").mkdir(parents=True)
    (out_dir / "extra" / "deeper" / "tokenizer_config.json").write_text("{}")
    return "extra"


def add_empty_folder(out_dir: Path, outside: Path) -> str:
    (out_dir / "empty").mkdir()
    return "empty"


def add_hidden_file(out_dir: Path, outside: Path) -> str:
    (out_dir / ".cache").mkdir()
    (out_dir / ".cache" / "notes").write_text("x")
    return ".cache"


def add_fifo(out_dir: Path, outside: Path) -> str:
    os.mkfifo(out_dir / "pipe")
    return "pipe"


def add_temporary_file(out_dir: Path, outside: Path) -> str:
    (out_dir / ".config.json.foldckpt-tmp").write_text("{}")
    return ".config.json.foldckpt-tmp"


@pytest.mark.parametrize(
    "add",
    [
        add_chat_template,
        add_remote_code,
        add_tokenizer_link,
        add_dangling_link,
        add_nested_folder,
        add_empty_folder,
        add_hidden_file,
        add_fifo,
        add_temporary_file,
    ],
)
def test_every_entry_the_manifest_does_not_list_fails_verify_and_serving_unless_allowed(
    converted: Converted, tmp_path: Path, add: Callable[[Path, Path], str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A chat template, remote code or a tokenizer added to OUT_DIR changes what is served, and
    verify (pinned too) passed with them: only stray safetensors files were looked for. Every
    unlisted entry now fails the manifest level (exit 1), is refused by the serving loader, and
    passes only through an allow-list that the report records and prints."""
    from foldckpt.runtime.loader import open_fold_set

    _, out_dir = converted("deepseek_v3")
    outside = tmp_path / "outside"
    outside.mkdir()
    entry = add(out_dir, outside)
    pinned = hashlib.sha256((out_dir / MANIFEST_NAME).read_bytes()).hexdigest()
    run = run_foldckpt("verify", out_dir, "--quiet", "--expect-manifest-sha256", pinned)
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"     - {entry}: " in run.stdout and "--allow-extra" in run.stdout and "verification FAILED" in run.stdout
    level = failed_level(run_verify(out_dir, "content"), "manifest")
    assert files_named(level.problems) == {entry}, level.problems
    with pytest.raises(FoldckptError, match=f"{out_dir / entry}: "):
        open_fold_set(out_dir)
    allowed = run_foldckpt("verify", out_dir, "--json", "--allow-extra", "nothing-*", "--allow-extra", f"{entry[:3]}*")
    assert allowed.returncode == 0, allowed.stdout + allowed.stderr
    report = json.loads(allowed.stdout)
    assert report["allow_extra"] == {"patterns": ["nothing-*", f"{entry[:3]}*"], "allowed": [entry]}
    printed = run_foldckpt("verify", out_dir, "--quiet", "--allow-extra", f"{entry[:3]}*")
    assert printed.returncode == 0 and f"allowed by --allow-extra '{entry[:3]}*': {entry}" in printed.stdout, (
        printed.stdout
    )
    monkeypatch.setenv("FOLDCKPT_ALLOW_EXTRA", f"nothing-*:{entry[:3]}*")
    assert open_fold_set(out_dir).manifest.file_sha256 == pinned


def test_a_conversions_resume_journal_fails_verify_whatever_is_allowed(converted: Converted) -> None:
    """OUT_DIR/.foldckpt-journal.json beside a manifest: a convert that did not finish there (killed
    after writing the manifest, or repairing the directory); no allow-list lets it through."""
    _, out_dir = converted("deepseek_v3")
    (out_dir / ".foldckpt-journal.json").write_text("{}")
    run = run_foldckpt("verify", out_dir, "--quiet", "--allow-extra", "*")
    assert run.returncode == 1, run.stdout
    assert "- .foldckpt-journal.json: the resume journal of a convert that has not finished" in run.stdout, run.stdout


def test_a_symlink_where_the_manifest_needs_a_folder_fails_verify(
    make_model: Callable[..., Path], tmp_path: Path
) -> None:
    """A folder of listed files (``original/``) replaced by a symlink to a copy elsewhere: the files
    still hash right, but what serves is no longer OUT_DIR's own."""
    from foldckpt.convert import convert

    model = make_model("deepseek_v3")
    (model / "original").mkdir()
    shutil.copyfile(model / "config.json", model / "original" / "params.json")
    out_dir = convert(model, tmp_path / "out", ConvertOptions(progress=False, link="copy")).out_dir
    assert run_verify(out_dir, "content").ok
    shutil.move(out_dir / "original", tmp_path / "elsewhere")
    (out_dir / "original").symlink_to(tmp_path / "elsewhere")
    level = failed_level(run_verify(out_dir, "content"), "manifest")
    assert [(p.file, p.what.split(";")[0]) for p in level.problems] == [
        ("original", f"a symlink (to {tmp_path / 'elsewhere'}) where convert makes a folder")
    ]


@pytest.mark.parametrize("victim", [SIDECARS[1], "model-00002-of-00003.safetensors", "config.json"])
def test_a_truncated_file_fails_the_manifest_level(converted: Converted, victim: str) -> None:
    _, out_dir = converted("kimi_k3", SMALL_SHARDS)
    path = out_dir / victim
    size = path.stat().st_size
    with open(path, "r+b") as handle:
        handle.truncate(size - 1)
    level = failed_level(run_verify(out_dir), "manifest")
    assert [p.file for p in level.problems] == [victim]
    assert f"size {size - 1} bytes, foldckpt.json records {size}" in level.problems[0].what


# ------------------------------------------------------------------------------------------------
# source files (hard links: damage in OUT_DIR is damage in MODEL_DIR, and the other way round)


@pytest.mark.parametrize("shard", ["model-00001-of-00003.safetensors", "model-00003-of-00003.safetensors"])
def test_a_flipped_byte_in_a_linked_source_shard_fails_content_naming_it(converted: Converted, shard: str) -> None:
    model_dir, out_dir = converted("deepseek_v3")
    assert (out_dir / shard).stat().st_ino == (model_dir / shard).stat().st_ino
    header = read_header(out_dir / shard)
    folded = {s.name for t in read_manifest(out_dir).tensors.values() for s in t.sources}
    victim = next(info for name, info in header.tensors.items() if name not in folded and info.nbytes)
    flip_byte(out_dir / shard, victim.start + victim.nbytes // 2)
    assert (model_dir / shard).read_bytes() == (out_dir / shard).read_bytes()  # same inode
    level = failed_level(run_verify(out_dir), "content")
    assert [(p.file, p.tensor) for p in level.problems] == [(shard, None)]


def test_a_flipped_byte_in_a_small_source_file_fails_content(converted: Converted) -> None:
    _, out_dir = converted("deepseek_v3")
    flip_byte(out_dir / "tokenizer.json", 100)
    level = failed_level(run_verify(out_dir), "content")
    assert files_named(level.problems) == {"tokenizer.json"}


@pytest.mark.parametrize(
    ("family", "suffix"),
    [
        ("deepseek_v3", "layers.1.self_attn.kv_b_proj.weight"),
        ("kimi_k3", "layers.5.self_attn.q_b_proj.weight"),
        ("deepseek_v3_fp8", "layers.0.self_attn.q_b_proj.weight_scale_inv"),
    ],
)
def test_a_source_tensor_modified_after_conversion_is_named_by_content_and_deep(
    converted: Converted, family: str, suffix: str
) -> None:
    model_dir, out_dir = converted(family)
    manifest = read_manifest(out_dir)
    source = next(s for t in manifest.tensors.values() for s in t.sources if s.name.endswith(suffix))
    fold = next(t.name for t in manifest.tensors.values() if source in t.sources)
    # the user edits the ORIGINAL model after conversion; OUT_DIR holds hard links to it
    rewrite_tensor(model_dir / source.file, tensor_info(model_dir / source.file, source.name), lambda t: t.float() * 2)

    level = failed_level(run_verify(out_dir), "content")
    assert files_named(level.problems) == {source.file}
    changed = next(p for p in level.problems if p.tensor == source.name)
    assert f"source tensor '{source.name}' is not the one folded into '{fold}'" in changed.what

    deep = check_deep(out_dir, manifest, VerifyOptions(level="deep", progress=False))
    assert not deep.ok
    assert [(p.file, p.tensor) for p in deep.problems] == [(source.file, source.name)]
    assert "changed since conversion" in deep.problems[0].what


def test_a_copied_output_is_independent_of_later_edits_to_the_original(converted: Converted) -> None:
    model_dir, out_dir = converted("deepseek_v3", ConvertOptions(progress=False, link="copy"))
    source = next(iter(read_manifest(out_dir).tensors.values())).sources[0]
    rewrite_tensor(model_dir / source.file, tensor_info(model_dir / source.file, source.name), lambda t: -t)
    assert run_verify(out_dir).ok


def test_an_index_that_no_longer_matches_the_shard_headers_fails_structure(converted: Converted) -> None:
    _, out_dir = converted("deepseek_v3")
    path = out_dir / "model.safetensors.index.json"
    index = json.loads(path.read_text())
    dropped = "model.layers.1.mlp.experts.0.up_proj.weight"
    shard = index["weight_map"].pop(dropped)
    size = path.stat().st_size
    path.unlink()  # a new file: the model directory's hard-linked index stays as it was
    path.write_text(json.dumps(index, indent=2).ljust(size))  # same size: the manifest level cannot tell
    level = failed_level(run_verify(out_dir), "structure")
    assert [(p.file, p.tensor) for p in level.problems] == [("model.safetensors.index.json", dropped)]
    assert f"does not map tensor '{dropped}', which {shard}'s header holds" in level.problems[0].what


# ------------------------------------------------------------------------------------------------
# the manifest


def test_cli_a_manifest_that_is_no_longer_json_fails_verification_naming_it(converted: Converted) -> None:
    _, out_dir = converted("deepseek_v3")
    flip_byte(out_dir / MANIFEST_NAME, 0)  # the opening brace
    level = failed_level(run_verify(out_dir), "manifest")
    assert [p.file for p in level.problems] == [MANIFEST_NAME] and "invalid JSON" in level.problems[0].what
    run = run_foldckpt("verify", out_dir)
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"- {MANIFEST_NAME}: invalid JSON" in run.stdout and "Traceback" not in run.stdout + run.stderr


@pytest.mark.parametrize(
    "hostile",
    [b"[" * 100_000 + b"]" * 100_000, b'{"format": ' + b"7" * 5000 + b"}"],
    ids=["nested-too-deeply", "huge-integer"],
)
def test_cli_a_manifest_python_cannot_parse_fails_verification_in_exit_1(converted: Converted, hostile: bytes) -> None:
    """JSON that ``json.loads`` refuses with RecursionError or a digit-limit ValueError (not a
    JSONDecodeError) used to end verify and inspect in exit 3, "internal error"."""
    _, out_dir = converted("deepseek_v3")
    (out_dir / MANIFEST_NAME).write_bytes(hostile)
    run = run_foldckpt("verify", out_dir)
    assert run.returncode == 1, run.stdout + run.stderr
    assert f"- {MANIFEST_NAME}: invalid JSON" in run.stdout
    inspected = run_foldckpt("inspect", out_dir)
    assert inspected.returncode == 2 and "foldckpt.json: invalid JSON" in inspected.stderr, inspected.stderr


@pytest.mark.parametrize("record", ["file", "sidecar", "head", "source"])
def test_a_flipped_hex_digit_anywhere_in_the_manifest_fails_its_first_level(converted: Converted, record: str) -> None:
    _, out_dir = converted("kimi_k3", SMALL_SHARDS)
    manifest = read_manifest(out_dir)
    tensor = manifest.tensors[fold_names(out_dir, SIDECARS[1])[0]]
    needle = {
        "file": manifest.source_files["model-00002-of-00003.safetensors"].sha256,
        "sidecar": manifest.sidecars[SIDECARS[2]].header_sha256,
        "head": tensor.head_blake3[5],
        "source": tensor.sources[1].blake3,
    }[record]
    flip_hex_digit_after(out_dir, needle[:40])
    level = failed_level(run_verify(out_dir), "manifest")
    assert [(p.file, p.tensor) for p in level.problems] == [(MANIFEST_NAME, None)]
    assert "self-digest" in level.problems[0].what
    run = run_foldckpt("verify", out_dir, "--quiet", "--level", "manifest")
    assert run.returncode == 1 and f"- {MANIFEST_NAME}: its self-digest" in run.stdout, run.stdout + run.stderr


def test_a_manifest_edit_that_keeps_its_content_is_caught_by_its_encoding(converted: Converted) -> None:
    _, out_dir = converted("deepseek_v3")
    path = out_dir / MANIFEST_NAME
    raw = path.read_bytes()
    path.write_bytes(raw.replace(b'"format": "foldckpt"', b'"format": "\\u0066oldckpt"', 1))  # the same JSON content
    level = failed_level(run_verify(out_dir), "manifest")
    assert "not byte-for-byte the encoding foldckpt writes" in level.problems[0].what


def test_a_manifest_of_format_1_is_refused_with_a_clear_message(converted: Converted) -> None:
    _, out_dir = converted("deepseek_v3")
    path = out_dir / MANIFEST_NAME
    data = json.loads(path.read_bytes())
    del data[DIGEST_KEY]
    data.update(format_version=1, tp_sizes=[1, 2, 4, 8])
    path.write_text(json.dumps(data, indent=2))
    with pytest.raises(FoldckptError, match="manifest format 1 .* reconvert"):
        run_verify(out_dir)
    run = run_foldckpt("verify", out_dir)
    assert run.returncode == 2 and "format 1" in run.stderr and "--restart" in run.stderr


def test_the_manifest_sha256_is_printed_and_can_be_pinned(converted: Converted) -> None:
    _, out_dir = converted("deepseek_v3")
    digest = hashlib.sha256((out_dir / MANIFEST_NAME).read_bytes()).hexdigest()  # what sha256sum prints
    assert run_verify(out_dir, "manifest").manifest_sha256 == digest
    run = run_foldckpt("verify", out_dir, "-q", "--expect-manifest-sha256", digest)
    assert run.returncode == 0 and run.stdout.splitlines()[0] == f"sha256     {digest}  foldckpt.json", run.stdout
    assert "pinned sha256 and self-digest match" in run.stdout
    assert json.loads(run_foldckpt("verify", out_dir, "--json").stdout)["manifest_sha256"] == digest
    inspect = run_foldckpt("inspect", out_dir)
    assert f"sha256     {digest}  foldckpt.json" in inspect.stdout.splitlines()
    assert json.loads(run_foldckpt("inspect", out_dir, "--json").stdout)["manifest_sha256"] == digest
    other = "0" * 64
    run = run_foldckpt("verify", out_dir, "-q", "--expect-manifest-sha256", other)
    assert run.returncode == 1 and f"- {MANIFEST_NAME}: sha256 {digest} is not the pinned {other}" in run.stdout
    bad = run_foldckpt("verify", out_dir, "--expect-manifest-sha256", "xyz")
    assert bad.returncode == 2 and "--expect-manifest-sha256" in bad.stderr


def test_a_consistent_forgery_passes_unpinned_and_fails_pinned(converted: Converted) -> None:
    _, out_dir = converted("kimi_k3", SMALL_SHARDS)
    pinned = hashlib.sha256((out_dir / MANIFEST_NAME).read_bytes()).hexdigest()
    (tensor,) = fold_names(out_dir, SIDECARS[0])

    def nudge(t: torch.Tensor) -> torch.Tensor:  # +1 ulp on one element: within deep's tolerance
        bits = t.view(torch.int16).clone()
        bits[0, 0] += 1
        return bits.view(torch.bfloat16)

    rewrite_tensor(out_dir / SIDECARS[0], tensor_info(out_dir / SIDECARS[0], tensor), nudge)
    reseal_manifest(out_dir)
    assert run_verify(out_dir, "content").ok  # a forgery the manifest alone cannot reveal ...
    level = failed_level(run_verify(out_dir, "content", expect_manifest_sha256=pinned), "manifest")  # ... a pin does
    assert [p.file for p in level.problems] == [MANIFEST_NAME] and "is not the pinned" in level.problems[0].what


@pytest.fixture(scope="module")
def kimi_model_and_out(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A Kimi-K3 checkpoint (8 heads) and its conversion, to copy and edit."""
    root = tmp_path_factory.mktemp("schema")
    model = make_checkpoint(root / "model", "kimi_k3")
    convert(model, root / "out", ConvertOptions(progress=False))
    return model, root / "out"


def first_fold(data: dict) -> dict:
    return next(iter(data["tensors"].values()))


FOLD = '"language_model.model.layers.3.self_attn.q_fold.weight"'


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        (  # inspect exited 3, verify passed
            lambda d: first_fold(d)["error_vs_fp64"].update(rel_fro_error="abc"),
            f"tensors[{FOLD}].error_vs_fp64.rel_fro_error must be a number >= 0 or null, got 'abc'",
        ),
        (  # verify --deep exited 3
            lambda d: d["parameters"].update(max_shard_size="5GiB"),
            "parameters.max_shard_size must be an integer >= 1, got '5GiB'",
        ),
        (  # "--max-shard-size must be positive", a flag nobody passed
            lambda d: d["parameters"].update(max_shard_size=0),
            "parameters.max_shard_size must be an integer >= 1, got 0",
        ),
        (lambda d: d["geometry"].update(num_heads=True), "geometry.num_heads must be an integer >= 1, got true"),
        (lambda d: first_fold(d).update(shape=[4608]), f"tensors[{FOLD}].shape must be a list of 2, got [4608]"),
        (
            lambda d: d["source_files"]["config.json"].update(size=-1),
            'source_files["config.json"].size must be an integer >= 0, got -1',
        ),
        (
            lambda d: first_fold(d)["error_vs_fp64"].update(worst_head=1),
            f"tensors[{FOLD}].error_vs_fp64.worst_head must be one of the heads measured, [0, 2, 5, 7], got 1",
        ),
        (lambda d: d["geometry"]["layers"][0].update(is_mtp=0), "geometry.layers[0].is_mtp must be true or false"),
        (lambda d: d.update(notes="mine"), "notes is not a field of manifest format 5"),
        (lambda d: d["fold"].update(formula="W_fold = W_qb"), "fold.formula must be one of 'W_fold[h] = [W_UK[h]^T"),
    ],
)
def test_a_manifest_field_of_the_wrong_type_or_range_is_named_in_one_line(
    kimi_model_and_out: tuple[Path, Path], tmp_path: Path, edit: Callable[[dict], None], field: str
) -> None:
    """A manifest edited by hand with its digest recomputed crashed its readers (issue 46): a
    string error figure made inspect exit 3, a text shard size made verify --deep exit 3, a shard
    size of 0 blamed --max-shard-size. Every field's type and range is checked where the manifest
    is read: verify fails (exit 1) and the other commands refuse (exit 2), naming foldckpt.json
    and the field."""
    model, converted_out = kimi_model_and_out
    out = Path(shutil.copytree(converted_out, tmp_path / "out"))
    resign_raw(out, edit)
    expected = f"{MANIFEST_NAME}: field {field}"
    level = failed_level(run_verify(out), "manifest")
    assert [(p.file, p.tensor) for p in level.problems] == [(MANIFEST_NAME, None)]
    assert str(level.problems[0]).startswith(expected), level.problems[0]
    run = run_foldckpt("verify", out, "--deep", "-q")
    assert run.returncode == 1 and f"     - {expected}" in run.stdout, (run.stdout, run.stderr)
    for argv in (["inspect", out], ["convert", model, out, "-q"], ["convert", model, out, "--dry-run"]):
        run = run_foldckpt(*argv)
        assert run.returncode == 2 and run.stderr.startswith(f"foldckpt: error: {out}/{expected}"), (argv, run.stderr)
        assert len(run.stderr.splitlines()) == 1, run.stderr


@pytest.mark.parametrize(
    ("edit", "mismatch"),
    [
        (lambda e: e.update(rel_fro_error=round(e["rel_fro_error"] * 1.01, 6)), "rel_fro_error recorded"),
        (lambda e: e["rel_fro_error_rows"].update(q_pe=1e-3), "rel_fro_error_rows.q_pe recorded 0.001, measured 0 "),
        (lambda e: e.update(max_abs_error=None), "max_abs_error recorded null, measured"),
        (lambda e: e.update(worst_head=next(h for h in e["heads"] if h != e["worst_head"])), "worst_head recorded"),
    ],
)
def test_deep_compares_the_recorded_error_figures_with_its_own(
    kimi_model_and_out: tuple[Path, Path], tmp_path: Path, edit: Callable[[dict], None], mismatch: str
) -> None:
    """inspect and convert's summary show each fold's recorded error vs fp64; verify --deep, which
    measures every head again, passed a manifest whose figures had been rewritten (digest
    recomputed). It now compares them, on the heads convert measured, at the precision recorded."""
    _, converted_out = kimi_model_and_out
    out = Path(shutil.copytree(converted_out, tmp_path / "out"))
    resign_raw(out, lambda d: edit(first_fold(d)["error_vs_fp64"]))
    assert run_verify(out, "content").ok
    level = failed_level(run_verify(out), "deep")
    name = FOLD.strip('"')
    assert [(p.file, p.tensor) for p in level.problems] == [(MANIFEST_NAME, name)]
    assert level.problems[0].what.startswith(f"the error vs fp64 it records for '{name}' is not the fold's ({mismatch}")


def test_a_hash_that_is_not_hex_fails_the_manifest_level(converted: Converted) -> None:
    _, out_dir = converted("deepseek_v3")
    resign_raw(out_dir, lambda d: d["source_files"]["config.json"].update(sha256="g" * 64))
    level = failed_level(run_verify(out_dir), "manifest")
    assert files_named(level.problems) == {MANIFEST_NAME} and "'config.json' has sha256" in level.problems[0].what


def test_a_manifest_file_name_escaping_the_output_is_refused_before_any_read(converted: Converted) -> None:
    _, out_dir = converted("deepseek_v3")

    def escape(data: dict) -> None:
        data["source_files"]["../model-00001-of-00003.safetensors"] = data["source_files"]["config.json"]

    resign_raw(out_dir, escape)
    level = failed_level(run_verify(out_dir), "manifest")
    assert files_named(level.problems) == {MANIFEST_NAME} and "escapes the output directory" in level.problems[0].what


def test_a_resigned_manifest_whose_head_hash_disagrees_with_the_bytes_names_that_head(converted: Converted) -> None:
    _, out_dir = converted("kimi_k3", SMALL_SHARDS)
    name = fold_names(out_dir, SIDECARS[1])[0]
    resign_raw(out_dir, lambda d: d["tensors"][name]["head_blake3"].__setitem__(2, "0" * 64))
    level = failed_level(run_verify(out_dir), "content")
    (problem,) = level.problems  # one digest per byte: the bytes and their head digest disagree, nothing else
    assert (problem.file, problem.tensor) == (SIDECARS[1], name) and "head(s) 2" in problem.what
    assert run_verify(out_dir, "content", rank=0, tp=4).ok  # heads 0-1: unaffected
    level = failed_level(run_verify(out_dir, "content", rank=1, tp=4), "content")  # heads 2-3
    assert [(p.file, p.tensor) for p in level.problems] == [(SIDECARS[1], name)]


# ------------------------------------------------------------------------------------------------
# --deep: the math, when every hash has been made to agree


def test_deep_catches_a_wrong_fold_whose_hashes_were_resealed(converted: Converted) -> None:
    _, out_dir = converted("kimi_k3", SMALL_SHARDS)
    (tensor,) = fold_names(out_dir, SIDECARS[1])
    geometry = read_manifest(out_dir).geometry
    heads = geometry.num_heads, geometry.fold_head_dim, geometry.q_lora_rank
    rewrite_tensor(
        out_dir / SIDECARS[1],
        tensor_info(out_dir / SIDECARS[1], tensor),
        lambda t: t.reshape(heads)[[1, 0, *range(2, heads[0])]].reshape(t.shape),
    )  # swap heads 0 and 1
    reseal_manifest(out_dir)
    assert run_verify(out_dir, "content").ok  # every hash agrees with the bytes ...
    level = failed_level(run_verify(out_dir), "deep")  # ... but the fold is not the fold of its sources
    assert [(p.file, p.tensor) for p in level.problems] == [(SIDECARS[1], tensor)]
    assert "is not the fold of its sources" in level.problems[0].what


def test_deep_refuses_a_fold_one_ulp_from_the_exact_rounding_and_a_two_ulp_forgery(converted: Converted) -> None:
    _, out_dir = converted("kimi_k3", SMALL_SHARDS)
    (tensor,) = fold_names(out_dir, SIDECARS[0])

    info = tensor_info(out_dir / SIDECARS[0], tensor)
    manifest = read_manifest(out_dir)
    q_b, kv_b = (
        read_tensor(out_dir / src.file, tensor_info(out_dir / src.file, src.name))
        for src in manifest.tensors[tensor].sources
    )
    exact = reference_fold_heads(q_b, kv_b, manifest.geometry, (0,))[0, 0, 0].item()

    def other_rounding(t: torch.Tensor) -> torch.Tensor:  # element 0 one ulp toward the fp64 value
        bits = t.view(torch.int16).clone()
        bits[0, 0] += -1 if abs(t[0, 0].item()) > abs(exact) else 1
        return bits.view(torch.bfloat16)

    rewrite_tensor(out_dir / SIDECARS[0], info, other_rounding)
    reseal_manifest(out_dir)
    # within one rounding of fp64, as an fp32-summed fold could be, but not the exact rounding
    level = failed_level(run_verify(out_dir), "deep")
    assert [(p.file, p.tensor) for p in level.problems] == [(SIDECARS[0], tensor)]
    assert "(1 element(s) differ from the exact fold recomputed here;" in level.problems[0].what
    assert "; 0 element(s) beyond one rounding of the fp64 fold)" in level.problems[0].what

    def forge(t: torch.Tensor) -> torch.Tensor:
        bits = t.view(torch.int16).clone()
        bits[3, 5] += 2
        return bits.view(torch.bfloat16)

    rewrite_tensor(out_dir / SIDECARS[0], info, forge)
    reseal_manifest(out_dir)
    level = failed_level(run_verify(out_dir), "deep")
    assert [(p.file, p.tensor) for p in level.problems] == [(SIDECARS[0], tensor)]
    assert "beyond one rounding of the fp64 fold" in level.problems[0].what


# ------------------------------------------------------------------------------------------------
# content reads: plain bounded reads, the same bytes whether cached or not


def test_the_bounded_reads_yield_exactly_the_file_bytes(converted: Converted) -> None:
    _, out_dir = converted("deepseek_v3")
    path = max(out_dir.glob("model-*.safetensors"), key=lambda p: p.stat().st_size)
    data = path.read_bytes()
    size = len(data)
    assert size > 2 * HASH_BUFFER
    segments = [(0, 100), (1000, size - 1000), (size - 7, size + 50)]  # the last runs past the end: clipped
    with open(path, "rb", buffering=0) as handle:
        got = [(pos, bytes(chunk)) for pos, chunk in chunks(handle, size, segments)]
    for start, end in segments:
        assert b"".join(chunk for pos, chunk in got if start <= pos < end) == data[start:end]
    assert [pos for pos, _ in got] == sorted(pos for pos, _ in got)
    assert max(len(chunk) for _, chunk in got) == HASH_BUFFER


def test_content_streams_cold_files_past_the_page_cache(converted: Converted, tmp_path: Path) -> None:
    """``--level content`` reads a cold file with direct I/O, which leaves it out of the page cache:
    from huge pages that kept this project's VM's disk 2.6x as busy as plain reads with prefetch
    (8.3 GB: 3.4 s against 8.8 s). Files of full Kimi-K3 geometry: the smaller ones are read
    plainly."""
    if not direct_io_supported(tmp_path):
        pytest.skip("this filesystem has no O_DIRECT")
    _, out_dir = converted("kimi_k3", layers=4, shards=1, full_geometry=True)
    large = [path for path in out_dir.iterdir() if path.stat().st_size >= DIRECT_CHUNK]
    assert len(large) >= 2  # the source shard and the sidecar
    evict_from_page_cache(*large)
    assert run_verify(out_dir, "content").ok
    for path in large:
        fd = os.open(path, os.O_RDONLY)
        try:
            assert not in_page_cache(fd, path.stat().st_size), path.name
        finally:
            os.close(fd)


def test_a_file_evicted_from_the_page_cache_is_read_and_still_named_when_damaged(converted: Converted) -> None:
    _, out_dir = converted("deepseek_v3")
    shard = "model-00002-of-00003.safetensors"
    flip_byte(out_dir / shard, (out_dir / shard).stat().st_size // 2)
    evict_from_page_cache(*out_dir.iterdir())
    level = failed_level(run_verify(out_dir), "content")
    assert files_named(level.problems) == {shard}


# ------------------------------------------------------------------------------------------------
# unusable input


def test_cli_unusable_directories_exit_2_with_one_line(make_model: Callable[..., Path], tmp_path: Path) -> None:
    model_dir = make_model("deepseek_v3")
    for target, message in [
        (tmp_path / "nowhere", f"{tmp_path / 'nowhere'}: no such directory"),
        (model_dir, f"{model_dir / MANIFEST_NAME}: not found"),
        (model_dir / "config.json", f"{model_dir / 'config.json'}: not a directory"),
    ]:
        with pytest.raises(FoldckptError, match="not found|not a directory|no such directory"):
            run_verify(target)
        if target.name == "config.json":
            continue  # the command line path is the same as for "nowhere"
        run = run_foldckpt("verify", target, "--json")
        assert run.returncode == 2, run.stdout + run.stderr
        lines = run.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"foldckpt: error: {message}"), run.stderr
        assert json.loads(run.stdout) == {
            "error": {"code": 2, "kind": "input", "message": lines[0].removeprefix("foldckpt: error: ")}
        }


@pytest.mark.parametrize("name", ["a" * 300, "d/" * 2100 + "x"], ids=["component", "path"])
def test_a_listed_name_no_file_can_have_fails_verification_not_the_command(
    kimi_model_and_out: tuple[Path, Path], tmp_path: Path, name: str
) -> None:
    """A manifest (re-signed) listing a file under a name longer than NAME_MAX, or a path longer
    than PATH_MAX, met ENAMETOOLONG when verify looked the file up: a refusal of the user's path
    (exit 2), where it is the manifest that is wrong (verification fails, exit 1)."""
    _, converted_out = kimi_model_and_out
    out = Path(shutil.copytree(converted_out, tmp_path / "out"))
    resign_raw(out, lambda d: d["source_files"].update({name: {"size": 1, "sha256": "0" * 64}}))
    level = failed_level(run_verify(out), "manifest")
    assert any("is longer than a file name can be" in str(p) for p in level.problems), level.problems
    run = run_foldckpt("verify", out, "-q")
    assert run.returncode == 1, (run.stdout, run.stderr)
