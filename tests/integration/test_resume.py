"""Crash safety and resumption of ``foldckpt convert``, proven with real SIGKILLs (issue 4).

A real ``foldckpt convert`` subprocess is killed with SIGKILL at seeded random points, chosen by
time (a delay after its journal appears) and by bytes written (the sidecar bytes in OUT_DIR passing
a threshold), then the same command is run again. The resumed OUT_DIR must be byte-identical to an
uninterrupted run's (every file, the manifest included), pass verify, and must have folded exactly
the layers the journal had not recorded (no journaled work redone). Until the manifest exists,
verify must refuse the directory. The rest checks when a previous OUT_DIR is refused, replaced or
reused.

Run with ``-s`` to see where each kill landed and how much work the resumed run did.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from foldckpt.convert import ConvertOptions, convert
from foldckpt.convert.plan import SIDECAR_PREFIX
from foldckpt.defaults import JOURNAL_NAME
from foldckpt.errors import FoldckptError
from foldckpt.format.manifest import MANIFEST_NAME, read_manifest
from foldckpt.io.files import TMP_SUFFIX, tmp_path_for
from foldckpt.model.synthetic import make_checkpoint
from foldckpt.verify import VerifyOptions, verify
from tests.conftest import run_foldckpt

LAYERS = 8
# 2 folds per sidecar: 4 sidecars, each resumable mid-shard, and a durable point after every layer.
MAX_SHARD_SIZE = 1_300_000
CONVERT_ARGS = ("--max-shard-size", str(MAX_SHARD_SIZE), "-q", "--json")
SEED = 20240604
TIME_KILLS = 3
BYTE_KILLS = 3
CHAINED_KILLS = 3
POLL_S = 0.0005
RUN_TIMEOUT_S = 120.0


def convert_args(model: Path, out: Path, *extra: str) -> list[str]:
    return ["convert", str(model), str(out), *CONVERT_ARGS, *extra]


def spawn_convert(model: Path, out: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        [sys.executable, "-m", "foldckpt", *convert_args(model, out)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def sidecar_bytes(out: Path) -> int:
    """Bytes of sidecar data in OUT_DIR so far: finished sidecars plus their temporary files."""
    total = 0
    try:
        entries = list(os.scandir(out))
    except FileNotFoundError:
        return 0
    for entry in entries:
        if entry.name.startswith(SIDECAR_PREFIX) or entry.name.startswith(f".{SIDECAR_PREFIX}"):
            try:
                total += entry.stat().st_size
            except FileNotFoundError:  # renamed between listing and stat
                continue
    return total


def kill_when(process: subprocess.Popen[bytes], condition: Callable[[], bool]) -> bool:
    """SIGKILL ``process`` as soon as ``condition`` holds; False if it finished first."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while process.poll() is None:
        if condition():
            process.send_signal(signal.SIGKILL)
            break
        if time.monotonic() > deadline:
            process.kill()
            process.wait()
            pytest.fail(f"foldckpt convert ran past {RUN_TIMEOUT_S} s without reaching its kill point")
        time.sleep(POLL_S)
    process.wait()
    return process.returncode == -signal.SIGKILL


def kill_by_time(model: Path, out: Path, delay: float) -> bool:
    """Kill ``delay`` seconds after the run's journal appears (its first durable step)."""
    process = spawn_convert(model, out)
    journal = out / JOURNAL_NAME
    started: list[float] = []

    def due() -> bool:
        if not started and journal.exists():
            started.append(time.monotonic())
        return bool(started) and time.monotonic() - started[0] >= delay

    return kill_when(process, due)


def kill_by_bytes(model: Path, out: Path, threshold: int) -> bool:
    """Kill once more than ``threshold`` sidecar bytes are in OUT_DIR."""
    return kill_when(spawn_convert(model, out), lambda: sidecar_bytes(out) > threshold)


def journaled_layers(out: Path) -> int:
    try:
        journal = json.loads((out / JOURNAL_NAME).read_text())
    except FileNotFoundError:
        return 0
    return sum(len(shard["tensors"]) for shard in journal["shards"].values())


def kill_after_layers(model: Path, out: Path, target: int, delay: float) -> bool:
    """Kill ``delay`` seconds after the journal records at least ``target`` folded layers."""
    process = spawn_convert(model, out)
    reached: list[float] = []

    def due() -> bool:
        if not reached and journaled_layers(out) >= target:
            reached.append(time.monotonic())
        return bool(reached) and time.monotonic() - reached[0] >= delay

    return kill_when(process, due)


def journaled_state(out: Path, files_to_place: int) -> tuple[int, str]:
    """Layers the journal records as durable, and a description of where the run was killed."""
    if (out / MANIFEST_NAME).exists():
        return LAYERS, "after the manifest was written"
    if not (out / JOURNAL_NAME).exists():
        return 0, "before the first durable step"
    journal = json.loads((out / JOURNAL_NAME).read_text())
    layers = journaled_layers(out)
    done = sum(shard["done"] is not None for shard in journal["shards"].values())
    if len(journal["placed"]) < files_to_place:
        where = f"placing sources ({len(journal['placed'])}/{files_to_place})"
    elif layers < LAYERS:
        where = f"folding ({layers}/{LAYERS} layers, {done} sidecars done)"
    else:
        where = f"hashing sources ({len(journal['source_hashes'])}/{files_to_place})"
    return layers, where


def snapshot(out: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(out.iterdir())}


def assert_identical(out: Path, reference: Path) -> None:
    """Every file of ``out`` (manifest included) equals the uninterrupted run's, and no more."""
    got, want = snapshot(out), snapshot(reference)
    assert sorted(got) == sorted(want), "resumed OUT_DIR has other files than an uninterrupted run"
    different = [name for name in want if got[name] != want[name]]
    assert not different, f"differ from the uninterrupted run: {different}"


def assert_refused_by_verify(out: Path) -> None:
    """An unfinished OUT_DIR is never accepted: verify refuses it for lack of a manifest or, once
    its journal exists, as the interrupted conversion it is."""
    with pytest.raises(FoldckptError, match=f"{MANIFEST_NAME}: not found|: interrupted conversion: "):
        verify(out, VerifyOptions(progress=False))


def resume(model: Path, out: Path) -> dict[str, Any]:
    """The same command again, through the CLI (as a user reruns it)."""
    result = run_foldckpt(*convert_args(model, out))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


def resume_in_process(model: Path, out: Path, **options: Any) -> dict[str, Any]:
    """The same conversion through the library: same run key as the CLI's, no interpreter start."""
    return convert(model, out, ConvertOptions(max_shard_size=MAX_SHARD_SIZE, progress=False, **options)).to_dict()


def one_error_line(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 2, (result.stdout, result.stderr)
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("resume") / "model", "deepseek_v3", layers=LAYERS)


@pytest.fixture(scope="module")
def reference(model: Path) -> tuple[Path, dict[str, Any]]:
    """An uninterrupted conversion: the bytes every resumed run must reproduce. Its summary gains
    ``work_s``, the time from the journal's appearance to the manifest's (where time kills land)."""
    out = model.parent / "reference"
    process = subprocess.Popen(
        [sys.executable, "-m", "foldckpt", *convert_args(model, out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    seen: dict[str, float] = {}
    while process.poll() is None:
        for name in (JOURNAL_NAME, MANIFEST_NAME):
            if name not in seen and (out / name).exists():
                seen[name] = time.monotonic()
        time.sleep(POLL_S)
    stdout, stderr = process.communicate()
    assert process.returncode == 0, stderr
    summary = json.loads(stdout)
    summary["work_s"] = seen[MANIFEST_NAME] - seen[JOURNAL_NAME]
    assert summary["layers_folded"] == LAYERS and len(summary["sidecars"]) == 4
    assert verify(out, VerifyOptions(level="deep", progress=False)).ok
    return out, summary


def test_killed_at_random_points_then_resumed_is_byte_identical_and_redoes_no_journaled_layer(
    model: Path, reference: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    reference_dir, summary = reference
    files = sum(summary["placed"].values())
    total_bytes = sum(summary["sidecars"].values())
    rng = random.Random(SEED)
    points = [("time", rng.uniform(0.0, summary["work_s"])) for _ in range(TIME_KILLS)]
    points += [("bytes", rng.randrange(total_bytes)) for _ in range(BYTE_KILLS)]
    killed = 0
    folded_on_resume = left_at_kill = 0
    for number, (how, at) in enumerate(points):
        out = tmp_path / f"out-{number}"
        was_killed = kill_by_time(model, out, at) if how == "time" else kill_by_bytes(model, out, at)
        killed += was_killed
        journaled, where = journaled_state(out, files)
        if not (out / MANIFEST_NAME).exists():
            assert_refused_by_verify(out)
        result = resume_in_process(model, out)
        print(
            f"kill {number} by {how} at {at:.4g}: {'killed' if was_killed else 'finished first'} "
            f"{where}; resumed run folded {result['layers_folded']} of {LAYERS - journaled} left"
        )
        # The resumed run folds exactly what the journal had not recorded: nothing durable is redone.
        assert result["layers_folded"] == LAYERS - journaled
        # A finished run is up to date, not resumed: nothing of it counts as resumed.
        assert result["layers_folded"] + result["layers_resumed"] == (0 if result["up_to_date"] else LAYERS)
        folded_on_resume += result["layers_folded"]
        left_at_kill += LAYERS - journaled
        assert_identical(out, reference_dir)
        assert verify(out, VerifyOptions(progress=False)).ok
    print(
        f"{killed}/{len(points)} runs killed; resumed runs folded {folded_on_resume} layers, "
        f"{left_at_kill} were left: {folded_on_resume - left_at_kill} journaled layers redone"
    )
    assert killed >= len(points) - 2, "most kill points must land before the run finishes"


def test_killed_repeatedly_in_the_same_out_dir_then_resumed_is_byte_identical(
    model: Path, reference: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """Kill, rerun, kill the rerun... each rerun killed a seeded delay after it journals more layers."""
    reference_dir, summary = reference
    rng = random.Random(SEED + 1)
    out = tmp_path / "out"
    journaled = kills = 0
    while kills < CHAINED_KILLS and journaled < LAYERS - 2:
        target = journaled + rng.randint(1, 2)
        kills += kill_after_layers(model, out, target, rng.uniform(0.0, summary["work_s"] / LAYERS))
        journaled, where = journaled_state(out, sum(summary["placed"].values()))
        print(f"chained kill once {target} layers were journaled: {where}")
        assert journaled >= target
    assert kills >= 2
    result = resume(model, out)
    print(f"resumed through the CLI: folded {result['layers_folded']}, resumed {result['layers_resumed']}")
    assert result["layers_folded"] == LAYERS - journaled
    assert_identical(out, reference_dir)
    assert verify(out, VerifyOptions(level="deep", progress=False)).ok


def test_killed_between_journaling_a_finished_sidecar_and_renaming_it_resumes_without_refolding(
    model: Path, reference: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """The shard record is journaled before the rename, so this window costs a rehash, not a shard."""
    out = tmp_path / "out"
    assert kill_after_layers(model, out, 3, 0.0)
    journal = json.loads((out / JOURNAL_NAME).read_text())
    first = min(journal["shards"])
    assert journal["shards"][first]["done"] is not None
    (out / first).rename(out / f".{first}{TMP_SUFFIX}")  # the state just before the rename
    journaled, _ = journaled_state(out, sum(reference[1]["placed"].values()))
    assert resume_in_process(model, out)["layers_folded"] == LAYERS - journaled
    assert_identical(out, reference[0])


def test_out_dir_left_with_only_temporary_files_resumes(
    model: Path, reference: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """A run killed while writing its very first file leaves only a hidden temporary file."""
    out = tmp_path / "out"
    out.mkdir()
    (out / f".{JOURNAL_NAME}{TMP_SUFFIX}").write_text('{"run_key": "half-writ')
    assert resume_in_process(model, out)["layers_folded"] == LAYERS
    assert_identical(out, reference[0])


def test_half_done_out_dir_is_refused_by_verify_and_refuses_other_parameters_unless_restart(
    model: Path, reference: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    assert kill_by_bytes(model, out, sum(reference[1]["sidecars"].values()) // 2)
    line = one_error_line(run_foldckpt("convert", model, out, "--max-shard-size", "3MB", "-q"))
    assert str(out) in line and "refusing to mix" in line and "--restart" in line
    line = one_error_line(run_foldckpt("verify", out))
    assert str(out) in line and "interrupted conversion" in line and "resume with: foldckpt convert" in line
    for other in ({"fold_dtype": "float32"}, {"fold_dtype": "float16"}):
        with pytest.raises(FoldckptError, match="refusing to mix"):
            resume_in_process(model, out, **other)
    result = convert(model, out, ConvertOptions(max_shard_size=3_000_000, restart=True, progress=False))
    assert result.layers_folded == LAYERS
    assert (
        sorted(result.sidecars)
        == sorted(p.name for p in out.glob(f"{SIDECAR_PREFIX}*"))
        == ["foldckpt-00001-of-00002.safetensors", "foldckpt-00002-of-00002.safetensors"]
    )
    assert not list(out.glob(f".*{TMP_SUFFIX}")) and not (out / JOURNAL_NAME).exists()
    assert verify(out, VerifyOptions(progress=False)).ok


def test_half_done_out_dir_refuses_other_inputs_unless_restart(
    model: Path, reference: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    """Another checkpoint with the same file names and sizes (other weights) must not mix."""
    out = tmp_path / "out"
    assert kill_by_bytes(model, out, sum(reference[1]["sidecars"].values()) // 2)
    other_model = make_checkpoint(tmp_path / "other", "deepseek_v3", layers=LAYERS, seed=1)
    line = one_error_line(run_foldckpt(*convert_args(other_model, out)))
    assert str(out) in line and "refusing to mix" in line
    assert resume_in_process(other_model, out, restart=True)["layers_folded"] == LAYERS
    assert verify(out, VerifyOptions(level="deep", progress=False)).ok


def test_finished_out_dir_is_up_to_date_and_refuses_other_parameters(
    model: Path, reference: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    shutil.copytree(reference[0], out)
    again = resume_in_process(model, out)
    assert again["up_to_date"] and again["layers_folded"] == 0
    assert_identical(out, reference[0])
    line = one_error_line(run_foldckpt("convert", model, out, "--fold-dtype", "float32", "-q"))
    assert str(out) in line and "finished conversion of other inputs or parameters" in line and "--restart" in line
    assert_identical(out, reference[0])


@pytest.mark.parametrize("link", ["hard", "symlink"])
def test_restart_onto_another_model_leaves_nothing_of_the_old_one(link: str, tmp_path: Path) -> None:
    """Files the first run placed but the second does not are removed, from OUT_DIR only (a
    placed symlink itself, not what it points to)."""
    first = make_checkpoint(tmp_path / "k3", "kimi_k3", shards=4)
    second = make_checkpoint(tmp_path / "v3", "deepseek_v3", layers=LAYERS)
    first_files = sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file())
    out = tmp_path / "out"
    convert(first, out, ConvertOptions(link=link, progress=False))
    convert(second, out, ConvertOptions(link=link, restart=True, progress=False))
    manifest = read_manifest(out)
    expected = {*manifest.source_files, *manifest.sidecars, MANIFEST_NAME}
    assert {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() or p.is_symlink()} == expected
    assert set(map(str, first_files)) - expected, "the two models should differ in file names"
    assert sorted(p.relative_to(first) for p in first.rglob("*") if p.is_file()) == first_files
    assert verify(out, VerifyOptions(progress=False)).ok


@pytest.mark.parametrize("where", ["same", "inside", "inside-nested", "parent"])
def test_out_dir_overlapping_the_model_dir_is_refused_even_with_overwrite(where: str, tmp_path: Path) -> None:
    model = make_checkpoint(tmp_path / "model", "deepseek_v3")
    before = sorted(p.relative_to(model) for p in model.rglob("*"))
    out = {"same": model, "inside": model / "folded", "inside-nested": model / "a" / "b", "parent": tmp_path}[where]
    with pytest.raises(FoldckptError, match="model directory"):
        convert(model, out, ConvertOptions(overwrite=True, progress=False))
    if where == "inside":
        line = one_error_line(run_foldckpt("convert", model, out, "-q"))
        assert str(out) in line and "must not be, contain, or lie inside the model directory" in line
    assert sorted(p.relative_to(model) for p in model.rglob("*")) == before


def test_non_empty_foreign_out_dir_is_refused_unless_overwrite(
    model: Path, reference: tuple[Path, dict[str, Any]], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("someone else's work\n")
    line = one_error_line(run_foldckpt(*convert_args(model, out)))
    assert str(out) in line and "not a foldckpt output" in line and "--overwrite" in line
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert resume_in_process(model, out, overwrite=True)["layers_folded"] == LAYERS
    assert (out / "notes.txt").read_text() == "someone else's work\n"
    # kept, but not vouched for: verify names it, and passes once told to let it through
    (manifest_level,) = verify(out, VerifyOptions(progress=False)).levels
    assert [problem.file for problem in manifest_level.problems] == ["notes.txt"]
    assert verify(out, VerifyOptions(progress=False, allow_extra=("notes.txt",))).ok
    (out / "notes.txt").unlink()
    assert_identical(out, reference[0])


def test_out_dir_that_is_a_file_is_refused(model: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.write_text("not a directory\n")
    for overwrite in (False, True):
        with pytest.raises(FoldckptError, match=str(out)):
            convert(model, out, ConvertOptions(overwrite=overwrite, progress=False))
    assert out.read_text() == "not a directory\n"


def _kept_fold_in_unfinished_sidecar(out: Path) -> tuple[str, int] | None:
    """(temporary sidecar, byte inside its first journaled fold) when the journal keeps a fold of a
    sidecar that is not finished yet."""
    try:
        journal = json.loads((out / JOURNAL_NAME).read_text())
    except (FileNotFoundError, ValueError):
        return None
    for name, shard in journal["shards"].items():
        if shard["tensors"] and shard["done"] is None:
            return tmp_path_for(out / name).name, shard["offset"] - 1
    return None


@pytest.mark.parametrize("where", ["fold", "header", "journal"])
def test_a_kept_fold_damaged_between_two_runs_is_folded_again_on_resume(
    model: Path, reference: tuple[Path, dict[str, Any]], tmp_path: Path, where: str
) -> None:
    """The temporary sidecar of a killed run keeps its journaled folds; if one of their bytes, or
    of the header in front of them, is damaged before the rerun, the resumed run must not carry it
    into the output (a damaged header used to be kept: only the folds were checked). Nor may a
    journal whose folds no longer end at its offset (a fold's entry removed by hand, the offset
    kept): the rerun appended after the offset, and every rerun ended in exit 3."""
    for attempt in range(20):
        out = tmp_path / f"out-{attempt}"
        killed = kill_when(spawn_convert(model, out), lambda out=out: _kept_fold_in_unfinished_sidecar(out) is not None)
        if killed and (found := _kept_fold_in_unfinished_sidecar(out)) is not None:  # as it stood once killed
            break
    else:
        pytest.skip("no kill landed between two layers of one sidecar in 20 runs")
    tmp_name, offset = found
    if where == "journal":
        journal = json.loads((out / JOURNAL_NAME).read_text())
        shard = next(s for s in journal["shards"].values() if s["tensors"] and s["done"] is None)
        shard["tensors"].pop(next(iter(shard["tensors"])))
        (out / JOURNAL_NAME).write_text(json.dumps(journal))
        resume_in_process(model, out)
        assert_identical(out, reference[0])
        return
    offset = offset if where == "fold" else 20  # inside the header's JSON
    with open(out / tmp_name, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0x10]))
    resume_in_process(model, out)
    assert_identical(out, reference[0])


def _journaled_shard(out: Path, finished: bool) -> str | None:
    """A sidecar whose folds the journal keeps, finished and in place (``finished``) or unfinished.
    A finished sidecar must be in place: killed between journaling it and renaming it, a resume
    writes its record afresh from the bytes (never reading the journaled one), as it should."""
    try:
        journal = json.loads((out / JOURNAL_NAME).read_text())
    except (FileNotFoundError, ValueError):
        return None
    return next(
        (
            name
            for name, s in journal["shards"].items()
            if s["tensors"] and (s["done"] is not None) == finished and (out / name).exists() == finished
        ),
        None,
    )


@pytest.mark.parametrize(
    ("finished", "record", "field"),
    [
        (False, "fold", "head_blake3"),
        (True, "fold", "head_blake3"),
        (True, "sidecar", "size"),
    ],
    ids=["kept-fold", "finished-sidecar-fold", "finished-sidecar"],
)
def test_a_journaled_record_edited_by_hand_is_one_line_naming_the_journal(
    model: Path, reference: tuple[Path, dict[str, Any]], tmp_path: Path, finished: bool, record: str, field: str
) -> None:
    """The journal's records of folds and finished sidecars were checked field by field only by the
    manifest's readers: a record edited by hand (a fold's head digests or a sidecar's size made a
    number or text) was a ValueError, exit 3, where a kept fold is checked against its bytes and
    where the manifest is assembled from a finished sidecar's records."""
    for attempt in range(20):
        out = tmp_path / f"out-{attempt}"
        killed = kill_when(spawn_convert(model, out), lambda out=out: _journaled_shard(out, finished) is not None)
        if killed and (name := _journaled_shard(out, finished)) is not None:  # as it stood once killed
            break
    else:
        pytest.skip(f"no kill landed while the journal kept a fold ({finished=}) in 20 runs")
    journal = json.loads((out / JOURNAL_NAME).read_text())
    shard = journal["shards"][name]
    if record == "fold":
        next(iter(shard["tensors"].values()))[field] = 5
    else:
        shard["done"][field] = "large"
    (out / JOURNAL_NAME).write_text(json.dumps(journal))
    line = one_error_line(run_foldckpt(*convert_args(model, out)))
    assert f"{out / JOURNAL_NAME}: unreadable resume journal" in line and field in line, line
    assert "--restart" in line, line
    assert not (out / MANIFEST_NAME).exists()
    assert run_foldckpt(*convert_args(model, out, "--restart")).returncode == 0
    assert_identical(out, reference[0])


# SIGKILL at the Nth file removal: a real kill -9 at an exact point of --restart's clearing.
_KILLED_AT_UNLINK = """
import os, signal, sys
left = int(sys.argv[1])
real_unlink = os.unlink
def unlink(path, *, dir_fd=None):
    global left
    real_unlink(path, dir_fd=dir_fd)
    left -= 1
    if left == 0:
        os.kill(os.getpid(), signal.SIGKILL)
os.unlink = unlink
from foldckpt.cli import main
main(sys.argv[2:])
"""


@pytest.mark.parametrize("removals", [1, 2, 5])
def test_a_restart_killed_while_clearing_the_old_output_is_finished_by_the_same_command(
    model: Path, reference: tuple[Path, dict[str, Any]], tmp_path: Path, removals: int
) -> None:
    """--restart removed the manifest and journal first: killed right after, OUT_DIR held sidecars
    and sources and nothing that said whose, and the same --restart refused it as foreign files."""
    out = tmp_path / "out"
    shutil.copytree(reference[0], out)
    args = [*convert_args(model, out), "--fold-dtype", "float32", "--restart"]
    killed = subprocess.run([sys.executable, "-c", _KILLED_AT_UNLINK, str(removals), *args], capture_output=True)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    rerun = run_foldckpt(*args)
    assert rerun.returncode == 0, rerun.stderr
    assert read_manifest(out).fold_dtype == "float32"
    assert verify(out, VerifyOptions(progress=False)).ok


def test_a_layer_refused_after_its_first_chunks_were_written_is_folded_again_by_the_rerun(
    model: Path, reference: tuple[Path, dict[str, Any]], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A layer's fold goes to its sidecar head chunk by head chunk and is checked once whole, so a
    refused layer has bytes in the temporary sidecar past the journaled offset. They must not
    count as written: the rerun folds that layer again and the output is byte-identical to an
    uninterrupted run's. The 4th layer (the second of the second sidecar) is spoiled in its last
    chunk, after its first chunk is on disk."""
    import foldckpt.convert.layer
    from foldckpt.fold import fold_layer_chunks

    out = tmp_path / "out"
    calls = []

    def in_progress_size() -> int:
        return sum(p.stat().st_size for p in out.glob(f".{SIDECAR_PREFIX}*{TMP_SUFFIX}"))

    def wait_for(condition: Callable[[], bool], what: str) -> None:
        deadline = time.monotonic() + 10
        while not condition():
            assert time.monotonic() < deadline, what
            time.sleep(0.001)

    def spoiled(*args: Any, **kwargs: Any) -> Any:
        calls.append(None)
        if len(calls) == 4:
            wait_for(lambda: journaled_layers(out) == 3, "layer 3 was never journaled")  # its bytes are in
            start = in_progress_size()
        for heads, values in fold_layer_chunks(*args, **kwargs):
            if len(calls) == 4 and heads.stop == 8:  # the last chunk of 8 heads
                wait_for(lambda: in_progress_size() > start, "the spoiled layer's first chunk was never written")
                values.mul_(1.5)
            yield heads, values

    monkeypatch.setattr(foldckpt.convert.layer, "fold_layer_chunks", spoiled)
    with pytest.raises(FoldckptError, match="MLA layer 3 .*relative error vs fp64"):
        resume_in_process(model, out)
    assert journaled_layers(out) == 3
    monkeypatch.undo()
    result = resume_in_process(model, out)
    assert result["layers_folded"] == LAYERS - 3
    assert_identical(out, reference[0])
