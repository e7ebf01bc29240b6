"""``convert --dry-run`` makes every check the run makes before writing, a refused run leaves
OUT_DIR as it found it and says what differs, and ``inspect`` tells an interrupted or running
conversion (issue 32).

The dry run exited 0 where the real run then refused (too little free space, ``--link hard``
across filesystems, a read-only OUT_DIR) and said the sources would be "placed unchanged" where
they would be copied; a refused run left an OUT_DIR it had created, holding a journal. Each case
runs both commands for real (real mounts: a small tmpfs, a read-only bind mount) and requires the
same exit code and the same one-line message, and the dry run's placement to be what the run did.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from foldckpt.defaults import JOURNAL_NAME
from foldckpt.format.manifest import MANIFEST_NAME, read_manifest
from foldckpt.inspect import conversion_status, describe_conversion
from foldckpt.model.synthetic import make_checkpoint
from tests.conftest import run_foldckpt
from tests.integration.test_out_dir_confinement import convert_removing_after_the_plan
from tests.integration.test_resume import (
    CONVERT_ARGS,
    LAYERS,
    journaled_layers,
    kill_after_layers,
    kill_when,
    one_error_line,
    spawn_convert,
)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("dry-run") / "model", "deepseek_v3", layers=LAYERS)


@pytest.fixture(scope="module")
def small_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A checkpoint that fits the small tmpfs twice over."""
    return make_checkpoint(tmp_path_factory.mktemp("dry-run-small") / "model", "deepseek_v3")


def assert_refused_alike(model: Path, out: Path, *options: str) -> str:
    """The dry run and the run refuse with the same line, and OUT_DIR is as it was."""
    existed = out.exists()
    before = sorted(p.name for p in out.iterdir()) if existed else None
    dry = one_error_line(run_foldckpt("convert", model, out, "--dry-run", *options))
    real = one_error_line(run_foldckpt("convert", model, out, *options))
    assert dry == real
    assert out.exists() == existed, "the refused run left an OUT_DIR it created"
    if existed:
        assert sorted(p.name for p in out.iterdir()) == before
    return real


def test_too_little_free_space_is_refused_by_the_dry_run_too(model: Path, small_filesystem: Path) -> None:
    out = small_filesystem / "out"
    filler = small_filesystem / "filler"
    filler.write_bytes(b"\0" * (shutil.disk_usage(small_filesystem).free - 1024 * 1024))
    line = assert_refused_alike(model, out, "--link", "copy")
    assert str(out) in line and "GB free but has" in line, line


def test_hard_links_across_filesystems_are_refused_by_the_dry_run_too(model: Path, small_filesystem: Path) -> None:
    """link(2) failed with EXDEV only at the first source placed, after the journal was written."""
    out = small_filesystem / "out"
    line = assert_refused_alike(model, out, "--link", "hard")
    assert "--link hard cannot link across filesystems" in line and str(model) in line, line


@pytest.mark.parametrize("where", ["itself", "inside"])
def test_a_read_only_out_dir_is_refused_by_the_dry_run_too(model: Path, read_only_dir: Path, where: str) -> None:
    out = read_only_dir if where == "itself" else read_only_dir / "out"
    line = assert_refused_alike(model, out)
    assert str(read_only_dir) in line and "read-only file system" in line.lower(), line


def test_a_refused_run_removes_the_out_dir_it_created(model: Path, tmp_path: Path) -> None:
    """A refusal after OUT_DIR was made (here: the first source to place is gone since the plan)
    left the new directory and its journal behind. Nested: every folder it made goes again, and
    only those."""
    source = Path(shutil.copytree(model, tmp_path / "model"))
    (tmp_path / "a").mkdir()
    out = tmp_path / "a" / "b" / "out"
    run = convert_removing_after_the_plan(source / "config.json", ["convert", str(source), str(out), "-q"])
    assert "config.json: no longer exists" in one_error_line(run)
    assert (tmp_path / "a").is_dir() and not (tmp_path / "a" / "b").exists()


PLACEMENTS = [("auto", True), ("auto", False), ("copy", True), ("symlink", True)]


def test_an_out_dir_whose_files_would_not_fit_a_path_is_refused_by_the_dry_run_too(
    small_model: Path, tmp_path: Path
) -> None:
    """An OUT_DIR of 4,070 bytes passed the dry run; the run made its folders, then met
    ENAMETOOLONG writing its journal under OUT_DIR and left them (issue 46)."""
    out = tmp_path / "/".join(["y" * 250] * 16)
    out = out / ("z" * (4070 - len(str(out))))
    line = assert_refused_alike(small_model, out)
    assert "bytes (with the temporary name it is written under), longer than the 4095 the system takes" in line
    assert not (tmp_path / ("y" * 250)).exists()


def test_a_source_name_too_long_for_its_temporary_name_is_refused_by_the_dry_run_too(
    small_model: Path, tmp_path: Path
) -> None:
    """A source file name of 250 bytes fits MODEL_DIR, not as ``.<name>.foldckpt-tmp`` in OUT_DIR:
    the run met ENAMETOOLONG placing it, after the dry run had passed."""
    model = Path(shutil.copytree(small_model, tmp_path / "model"))
    (model / ("n" * 250)).write_text("notes\n")
    line = assert_refused_alike(model, tmp_path / "out")
    assert f"{tmp_path / 'out' / ('n' * 250)}: the name '.{'n' * 250}.foldckpt-tmp' (264 bytes" in line, line


def test_an_out_dir_a_thousand_folders_deep_is_made(small_model: Path, tmp_path: Path) -> None:
    """mkdir(parents=True) recursed once per missing folder: an OUT_DIR 1,000 folders deep (a
    legal path of 3,000 bytes) was an internal error, RecursionError."""
    out = tmp_path.joinpath(*["ab"] * 1000)
    try:
        run = run_foldckpt("convert", small_model, out, "-q")
        assert run.returncode == 0, run.stderr
        assert run_foldckpt("verify", out, "-q").returncode == 0
    finally:  # pytest's own clean-up (shutil.rmtree) recurses once per folder too
        for entry in out.iterdir() if out.is_dir() else ():
            entry.unlink()
        for folder in (out, *out.parents):
            if folder == tmp_path:
                break
            if folder.is_dir():
                folder.rmdir()


@pytest.mark.parametrize(("link", "same_filesystem"), PLACEMENTS)
def test_the_dry_run_says_how_each_source_will_be_placed_and_the_run_does_so(
    small_model: Path, tmp_path: Path, small_filesystem: Path, link: str, same_filesystem: bool
) -> None:
    """It said "placed unchanged" for every source, where --link auto across filesystems copies."""
    model = small_model
    out = (tmp_path if same_filesystem else small_filesystem) / "out"
    plan = json.loads(run_foldckpt("convert", model, out, "--dry-run", "--json", "--link", link).stdout)
    expected = {"auto": "hard" if same_filesystem else "copy", "copy": "copy", "symlink": "symlink"}[link]
    assert set(plan["placement"].values()) == {expected}
    assert sorted(plan["placement"]) == sorted(p.name for p in model.iterdir())
    text = run_foldckpt("convert", model, out, "--dry-run", "--link", link).stdout
    assert "placed unchanged" not in text
    result = json.loads(run_foldckpt("convert", model, out, "-q", "--json", "--link", link).stdout)
    assert result["placed"] == {expected: len(plan["placement"])}
    assert plan["bytes_to_copy"] == (sum(p.stat().st_size for p in model.iterdir()) if expected == "copy" else 0)


def test_a_refusal_names_the_parameter_that_differs(model: Path, tmp_path: Path) -> None:
    """ "holds a finished conversion of other inputs or parameters" did not say which."""
    out = tmp_path / "out"
    assert run_foldckpt("convert", model, out, "-q").returncode == 0
    line = assert_refused_alike(model, out, "--fold-dtype", "float32")
    assert "finished conversion of other inputs or parameters (fold_dtype: bfloat16 in OUT_DIR, float32 now)" in line
    assert read_manifest(out).fold_dtype == "bfloat16"


def test_an_unfinished_run_s_refusal_names_the_source_file_that_differs(model: Path, tmp_path: Path) -> None:
    source = Path(shutil.copytree(model, tmp_path / "model"))
    out = tmp_path / "out"
    assert kill_after_layers(source, out, 1, 0.0), "the run finished before it could be killed"
    (source / "notes.md").write_text("new\n")
    line = assert_refused_alike(source, out, *CONVERT_ARGS)
    assert "unfinished conversion of other inputs or parameters (source files new in the model: notes.md)" in line


def flip_last_byte(path: Path) -> None:
    """Change a file's last byte in place (the inode stays: a hard link sees it too)."""
    with open(path, "r+b") as handle:
        handle.seek(-1, os.SEEK_END)
        byte = handle.read(1)[0]
        handle.seek(-1, os.SEEK_END)
        handle.write(bytes([byte ^ 0xFF]))


def test_a_source_changed_after_a_finished_run_is_refused_by_the_dry_run_too(small_model: Path, tmp_path: Path) -> None:
    """After a finished --link copy conversion, an edit of MODEL_DIR/tokenizer_config.json made the
    dry run say "already converted ... nothing to fold" (exit 0) and the run refuse (exit 2):
    the dry run did not recheck the sources (issue 46)."""
    model = Path(shutil.copytree(small_model, tmp_path / "model"))
    out = tmp_path / "out"
    assert run_foldckpt("convert", model, out, "--link", "copy", "-q").returncode == 0
    (model / "tokenizer_config.json").write_text('{"edited": true}\n')
    line = assert_refused_alike(model, out, "--link", "copy")
    assert f"{model / 'tokenizer_config.json'}: changed since {out} was converted from it" in line, line
    assert "finished conversion of the earlier bytes" in line


def test_a_source_changed_after_an_interrupted_run_is_refused_by_the_dry_run_too(model: Path, tmp_path: Path) -> None:
    """After an interrupted run, a change of a source it had hashed made the dry run say
    "resumed" (exit 0) and the run refuse (exit 2)."""
    source = Path(shutil.copytree(model, tmp_path / "model"))
    out = tmp_path / "out"

    def hashed_shards() -> list[str]:
        try:
            hashes = json.loads((out / JOURNAL_NAME).read_text())["source_hashes"]
        except (FileNotFoundError, ValueError):
            return []
        return [name for name in hashes if name.endswith(".safetensors")]

    assert kill_when(spawn_convert(source, out), lambda: bool(hashed_shards())), "the run finished first"
    assert not (out / MANIFEST_NAME).exists()
    changed = hashed_shards()[0]
    flip_last_byte(source / changed)  # tensor data: the plan, from headers, still holds
    line = assert_refused_alike(source, out, *CONVERT_ARGS)
    assert f"{source / changed}: changed since {out} was converted from it" in line, line
    assert "unfinished conversion of the earlier bytes" in line


def test_the_dry_run_names_what_a_finished_run_repairs_and_the_run_repairs_it(
    small_model: Path, tmp_path: Path
) -> None:
    """A finished output with a file missing and a sidecar damaged: the dry run said "nothing to
    fold" where the run places and folds them again."""
    out = tmp_path / "out"
    assert run_foldckpt("convert", small_model, out, "-q").returncode == 0
    sidecar = next(out.glob("foldckpt-*.safetensors"))
    (out / "tokenizer.json").unlink()
    flip_last_byte(sidecar)
    plan = json.loads(run_foldckpt("convert", small_model, out, "--dry-run", "--json").stdout)
    assert plan["repair"] == ["tokenizer.json", sidecar.name]
    text = run_foldckpt("convert", small_model, out, "--dry-run").stdout.splitlines()
    assert f"repair     tokenizer.json, {sidecar.name}: missing or damaged in OUT_DIR, placed or folded again" in text
    assert not any("nothing to fold" in line for line in text), text
    result = json.loads(run_foldckpt("convert", small_model, out, "-q", "--json").stdout)
    assert result["repaired"] == plan["repair"]
    assert run_foldckpt("verify", out, "-q").returncode == 0


def test_inspect_of_an_interrupted_conversion_says_so_and_how_to_resume(model: Path, tmp_path: Path) -> None:
    """It said only "not converted (no foldckpt.json)"."""
    out = tmp_path / "out"
    assert kill_after_layers(model, out, 1, 0.0), "the run finished before it could be killed"
    done = journaled_layers(out)
    run = run_foldckpt("inspect", out)
    assert run.returncode == 0, run.stderr
    expected_line = f"conversion interrupted conversion: {done} of {LAYERS} layers done; resume with: foldckpt convert"
    assert f"{expected_line} {model} {out}" in run.stdout, run.stdout
    assert "not converted" not in run.stdout
    expected = {"state": "interrupted", "layers_done": done, "layers_total": LAYERS, "model": str(model)}
    assert json.loads(run_foldckpt("inspect", out, "--json").stdout)["conversion"] == expected


def test_verify_of_an_interrupted_conversion_says_how_to_resume_it_as_inspect_does(model: Path, tmp_path: Path) -> None:
    """verify said only "foldckpt.json: not found; ... not a finished foldckpt conversion" where
    inspect gives the command that finishes it (issue 46)."""
    out = tmp_path / "out"
    assert kill_after_layers(model, out, 1, 0.0), "the run finished before it could be killed"
    status = conversion_status(out)
    assert status is not None
    line = one_error_line(run_foldckpt("verify", out))
    assert line == f"foldckpt: error: {out}: {describe_conversion(out, status)}"
    assert f"resume with: foldckpt convert {model} {out} (the same options)" in line


def test_inspect_of_a_running_conversion_names_its_process(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    process = spawn_convert(model, out)
    try:
        deadline = time.monotonic() + 60
        while journaled_layers(out) < 1:
            assert process.poll() is None and time.monotonic() < deadline, "the run ended before it was inspected"
            time.sleep(0.001)
        status = conversion_status(out)
    finally:
        process.kill()
        process.wait()
    assert status == {"state": "running", "pid": process.pid}
    assert describe_conversion(out, status) == f"a conversion is running (pid {process.pid}); wait for it to finish"
