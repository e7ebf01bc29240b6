"""Nothing outside OUT_DIR is ever written, truncated or deleted, whatever OUT_DIR holds (issue 32).

OUT_DIR is writable by whoever can plant entries in it between two runs: a symlink or a hard link
at a temporary name after a kill -9, a directory symlink as a path component, a journal or a
manifest naming such paths. Each case runs the real ``foldckpt convert`` on real files and real
links and compares a snapshot (path, type, inode, size, mtime, sha256) of a sibling "outside"
tree before and after: it must not change. Where convert cannot go on without deleting or writing
through such an entry it refuses in one line naming it (exit 2); where the entry is its own
temporary name it replaces it, never following it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from foldckpt.defaults import JOURNAL_NAME
from foldckpt.format.manifest import MANIFEST_NAME
from foldckpt.io.files import tmp_path_for
from foldckpt.model.synthetic import make_checkpoint
from foldckpt.verify import VerifyOptions, verify
from tests.conftest import REPO, run_foldckpt
from tests.integration.test_resume import CONVERT_ARGS, LAYERS, kill_after_layers, one_error_line

SHARD = "model-00002-of-00003.safetensors"

Snapshot = dict[str, tuple[Any, ...]]


def tree_snapshot(root: Path) -> Snapshot:
    """Every entry under ``root`` (itself included), links not followed: its type, inode, size,
    mtime and content (sha256 of a file, the target of a link)."""
    entries: Snapshot = {}
    for path in [root, *sorted(root.rglob("*"))]:
        st = path.lstat()
        if stat.S_ISREG(st.st_mode):
            content = hashlib.sha256(path.read_bytes()).hexdigest()
        elif stat.S_ISLNK(st.st_mode):
            content = os.readlink(path)
        else:
            content = None
        entries[str(path.relative_to(root))] = (stat.S_IFMT(st.st_mode), st.st_ino, st.st_size, st.st_mtime_ns, content)
    return entries


def assert_untouched(root: Path, before: Snapshot) -> None:
    after = tree_snapshot(root)
    changed = sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))
    assert not changed, f"changed outside OUT_DIR: {changed}"


def convert_args(model: Path, out: Path, *extra: str) -> list[str]:
    return ["convert", str(model), str(out), *CONVERT_ARGS, *extra]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("confinement") / "model", "deepseek_v3", layers=LAYERS)


@pytest.fixture
def outside(model: Path, tmp_path: Path) -> Path:
    """A tree beside OUT_DIR that holds a copy of the model (what a planted link points into)."""
    root = tmp_path / "outside"
    shutil.copytree(model, root / "model")
    (root / "notes.txt").write_text("precious\n")
    return root


@pytest.fixture
def finished(model: Path, tmp_path: Path) -> Path:
    """A finished conversion of ``model`` in ``tmp_path/out``."""
    out = tmp_path / "out"
    run = run_foldckpt(*convert_args(model, out))
    assert run.returncode == 0, run.stderr
    return out


# ----------------------------------------------------------------------------- D1: temporary names


@pytest.mark.parametrize("plant", ["symlink", "hardlink"])
def test_a_link_planted_at_a_sidecar_s_temporary_name_after_a_kill_is_never_written_through(
    model: Path, outside: Path, tmp_path: Path, plant: str
) -> None:
    """A resumed run opened the temporary sidecar it had left with O_RDWR (and a fresh one with
    O_CREAT | O_TRUNC), through whatever was at that name: a symlink planted there after a kill -9
    had the resume truncate and append to the file it points to, anywhere; a hard link, the same
    inode. The resume must start that sidecar over in a file of its own and finish verified."""
    out = tmp_path / "out"
    assert kill_after_layers(model, out, 1, 0.0), "the run finished before it could be killed"
    journal = json.loads((out / JOURNAL_NAME).read_text())
    unfinished = [name for name, shard in journal["shards"].items() if shard["done"] is None]
    assert unfinished, "killed with no sidecar in progress"
    for name in unfinished:
        tmp = tmp_path_for(out / name)
        victim = outside / f"victim-{name}"
        if tmp.exists():  # the victim starts as the real in-progress bytes, so the resume trusts it
            shutil.copyfile(tmp, victim)
        else:
            victim.write_bytes(b"precious\n" * 1000)
        tmp.unlink(missing_ok=True)
        if plant == "symlink":
            tmp.symlink_to(victim)
        else:
            os.link(victim, tmp)
    before = tree_snapshot(outside)
    run = run_foldckpt(*convert_args(model, out))
    assert run.returncode == 0, run.stderr
    assert_untouched(outside, before)
    assert verify(out, VerifyOptions(level="deep", progress=False)).ok


def test_a_link_planted_at_a_stale_temporary_name_in_a_sub_folder_is_removed_not_followed(
    model: Path, outside: Path, tmp_path: Path
) -> None:
    """Stale temporary files are removed anywhere in OUT_DIR: a directory symlink on the way must
    not lead the removal out of it."""
    out = tmp_path / "out"
    assert kill_after_layers(model, out, 1, 0.0), "the run finished before it could be killed"
    (outside / ".victim.foldckpt-tmp").write_text("precious\n")
    (out / "lnk").symlink_to(outside)
    before = tree_snapshot(outside)
    run = run_foldckpt(*convert_args(model, out, "--restart"))
    assert run.returncode == 0, run.stderr
    assert_untouched(outside, before)


# ----------------------------------------------------------------------------- D2: deletions


def _name_in_manifest(out: Path, name: str) -> None:
    manifest = json.loads((out / MANIFEST_NAME).read_text())
    manifest["source_files"][name] = {"size": 1, "sha256": "0" * 64}
    (out / MANIFEST_NAME).write_text(json.dumps(manifest))


def _name_in_journal(out: Path, name: str) -> None:
    (out / MANIFEST_NAME).unlink()
    journal = {"run_key": "another run", "placed": {name: "hard"}, "shards": {}, "source_hashes": {}}
    journal["fingerprints"] = {}
    (out / JOURNAL_NAME).write_text(json.dumps(journal))


@pytest.mark.parametrize("flag", ["--restart", "--overwrite"])
@pytest.mark.parametrize("record", [_name_in_manifest, _name_in_journal], ids=["manifest", "journal"])
def test_restart_never_deletes_through_a_directory_link_named_by_the_manifest_or_journal(
    model: Path, outside: Path, finished: Path, flag: str, record: Any
) -> None:
    """--restart and --overwrite remove the files an earlier run's manifest or journal names, as
    long as the name stays inside OUT_DIR as text: ``lnk/model-...`` with ``lnk`` a symlink to the
    model directory deleted the original shard. Refused in one line naming the entry; nothing of
    OUT_DIR is removed either (the check runs before the first removal)."""
    (finished / "lnk").symlink_to(outside / "model")
    record(finished, f"lnk/{SHARD}")
    before, inside = tree_snapshot(outside), sorted(p.name for p in finished.iterdir())
    line = one_error_line(run_foldckpt(*convert_args(model, finished, flag)))
    assert f"{finished / 'lnk'}" in line and "symlink" in line, line
    assert_untouched(outside, before)
    assert sorted(p.name for p in finished.iterdir()) == inside


@pytest.mark.parametrize("entry", ["directory", "fifo"])
def test_restart_refuses_a_named_entry_that_is_not_a_file_it_could_have_placed(
    model: Path, finished: Path, entry: str
) -> None:
    """A manifest-named entry that is a directory or a FIFO was never placed by convert: one line
    naming it (an unlink of a directory was an IsADirectoryError, exit 3)."""
    target = finished / "extra.bin"
    target.mkdir() if entry == "directory" else os.mkfifo(target)
    _name_in_manifest(finished, "extra.bin")
    line = one_error_line(run_foldckpt(*convert_args(model, finished, "--restart")))
    assert str(target) in line, line
    assert target.exists()


def test_overwrite_never_places_a_file_through_a_directory_link(model: Path, outside: Path, tmp_path: Path) -> None:
    """A model file in a sub-folder (``extra/notes.md``) is placed at ``OUT_DIR/extra/notes.md``:
    with ``extra`` a symlink in a non-empty OUT_DIR (--overwrite), the link went into the folder
    it points to. Refused in one line naming the link."""
    source = Path(shutil.copytree(model, tmp_path / "model-with-folder"))
    (source / "extra").mkdir()
    (source / "extra" / "notes.md").write_text("notes\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "extra").symlink_to(outside)
    before = tree_snapshot(outside)
    line = one_error_line(run_foldckpt(*convert_args(source, out, "--overwrite")))
    assert str(out / "extra") in line and "symlink" in line, line
    assert_untouched(outside, before)


# ----------------------------------------------------------------------------- D3: vanished sources


# The model file argv[1] is removed right after the plan read it: a real file gone between the
# plan and placing the sources (another process deleting it, a sync tool, a user).
REMOVED_AFTER_THE_PLAN = """
import os, sys
import foldckpt.convert
planned = foldckpt.convert.plan_conversion
def plan_then_remove(*args, **kwargs):
    plan = planned(*args, **kwargs)
    os.unlink(sys.argv[1])
    return plan
foldckpt.convert.plan_conversion = plan_then_remove
from foldckpt.cli import main
main(sys.argv[2:])
"""


def convert_removing_after_the_plan(removed: Path, args: list[str]) -> subprocess.CompletedProcess[str]:
    """``foldckpt *args`` in a subprocess that removes the file ``removed`` right after the plan."""
    return subprocess.run(
        [sys.executable, "-c", REMOVED_AFTER_THE_PLAN, str(removed), *args], capture_output=True, text=True
    )


@pytest.mark.parametrize("link", ["auto", "copy", "symlink"])
@pytest.mark.parametrize("name", [SHARD, "tokenizer.json"])
def test_a_source_removed_after_the_plan_is_one_line_naming_it(
    model: Path, tmp_path: Path, link: str, name: str
) -> None:
    """A FileNotFoundError escaped from placing the sources: exit 3 and a traceback file."""
    source = Path(shutil.copytree(model, tmp_path / "model"))
    out = tmp_path / "out"
    line = one_error_line(convert_removing_after_the_plan(source / name, convert_args(source, out, "--link", link)))
    assert str(source / name) in line and "no longer exists" in line, line


# ----------------------------------------------------------------------------- scripts/demo.sh


@pytest.fixture
def demo(tmp_path: Path) -> Path:
    """scripts/demo.sh in a copy of the repository's scripts/ whose venv set-up is a no-op and
    whose venv's python fails: what the demo does to DEMO_DIR happens before its first step ends."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "demo.sh", root / "scripts" / "demo.sh")
    (root / "scripts" / "setup_venv.sh").write_text("exit 0\n")
    (root / "venv" / "bin").mkdir(parents=True)
    for tool in ("python", "foldckpt"):
        (root / "venv" / "bin" / tool).write_text("#!/bin/sh\nexit 1\n")
        (root / "venv" / "bin" / tool).chmod(0o755)
    return root


def run_demo(demo: Path, work: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DEMO_DIR": str(work), "FOLDCKPT_VENV": str(demo / "venv")}
    return subprocess.run(["bash", str(demo / "scripts" / "demo.sh")], capture_output=True, text=True, env=env)


@pytest.mark.parametrize("kind", ["directory", "symlink"])
def test_demo_never_deletes_a_demo_dir_it_did_not_make(demo: Path, outside: Path, tmp_path: Path, kind: str) -> None:
    """demo.sh ran ``rm -rf "$DEMO_DIR"``: DEMO_DIR=~ deleted a home directory."""
    work = outside if kind == "directory" else tmp_path / "link"
    if kind == "symlink":
        work.symlink_to(outside)
    before = tree_snapshot(outside)
    run = run_demo(demo, work)
    assert run.returncode == 2 and str(work) in run.stderr, run.stderr
    assert_untouched(outside, before)


def test_demo_replaces_a_demo_dir_it_made(demo: Path, tmp_path: Path) -> None:
    work = tmp_path / "work"
    run_demo(demo, work)
    (work / "old-run.txt").write_text("left by the last demo\n")
    run = run_demo(demo, work)
    assert run.returncode == 1, run.stderr  # the stub python fails the first step
    assert sorted(p.name for p in work.iterdir()) == [".foldckpt-demo"]
