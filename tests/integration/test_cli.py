"""How the real ``python -m foldckpt`` ends and what it shows (issue 11): one-line usage errors with
exit 2, ``--json`` error objects, SIGINT/SIGTERM exits that resume, internal errors with exit 3,
no torch import on the cheap commands, summaries that say what happened, plain progress lines in
logs."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from foldckpt.defaults import JOURNAL_NAME
from foldckpt.format.manifest import MANIFEST_NAME, read_manifest
from foldckpt.model.synthetic import FAMILIES, make_checkpoint
from tests.conftest import REPO, run_foldckpt

Run = subprocess.CompletedProcess[str]


def error_line(run: Run, code: int = 2) -> str:
    """The one stderr line of a failed run (no traceback, no usage block)."""
    assert run.returncode == code, (run.returncode, run.stdout, run.stderr)
    lines = run.stderr.splitlines()
    assert len(lines) == 1, run.stderr
    assert "Traceback" not in run.stderr
    return lines[0]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("cli") / "kimi", "kimi_k3")


@pytest.fixture(scope="module")
def kimi_out(kimi: Path) -> tuple[Path, Run]:
    """The CLI's conversion of ``kimi`` and what it printed."""
    out = kimi.parent / "kimi-folded"
    run = run_foldckpt("convert", kimi, out, "-q")
    assert run.returncode == 0, run.stderr
    return out, run


# ---------------------------------------------------------------------------------------------
# usage errors: one line, exit 2


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["convert", "{model}", "{out}", "--tp", "abc"], "Invalid value for '--tp': 'abc' is not an integer"),
        (["convert", "{model}", "{out}", "--tp", "0"], "Invalid value for '--tp': 0 is not a tensor-parallel size"),
        (["convert", "{model}", "{out}", "--tp", "-1"], "Invalid value for '--tp': -1 is not a tensor-parallel size"),
        (["convert", "{model}", "{out}", "--tp", "1,,2"], "Invalid value for '--tp': '1,,2' has an empty entry"),
        (["convert", "{model}", "{out}", "--max-shard-size", "nonsense"], "'nonsense' is not a size like 5GB"),
        (["convert", "{model}", "{out}", "--fold-dtype", "int4"], "Invalid value for '--fold-dtype'"),
        (["convert", "{model}"], "Missing argument 'OUT_DIR'"),
        (["convert", "{model}", "{out}", "--no-such-flag"], "No such option '--no-such-flag'"),
        (["verify", "{out}", "--rank", "3"], "--rank and --tp go together"),
        (["verify", "{out}", "--tp", "8"], "--rank and --tp go together"),
        (["verify", "{out}", "--sample", "2"], "--sample applies to --deep"),
        (
            ["verify", "{out}", "--level", "structure", "--deep"],
            "--deep is --level deep: it contradicts --level structure",
        ),
        (["verify", "{out}", "--level", "everything"], "Invalid value for '--level'"),
        (["frobnicate"], "No such command 'frobnicate'"),
        ([], "no command given; choose one of convert, verify, inspect"),
    ],
)
def test_every_usage_error_is_one_line_with_exit_2(kimi: Path, tmp_path: Path, args: list[str], expected: str) -> None:
    argv = [a.format(model=kimi, out=tmp_path / "out") for a in args]
    line = error_line(run_foldckpt(*argv))
    assert line.startswith("foldckpt: error: ") and expected in line, line
    assert "does not divide" not in line
    assert not (tmp_path / "out").exists()


def test_tp_that_does_not_divide_the_heads_says_so(kimi: Path, tmp_path: Path) -> None:
    line = error_line(run_foldckpt("convert", kimi, tmp_path / "out", "--tp", "3", "--dry-run"))
    assert line == "foldckpt: error: --tp 3: does not divide the model's 8 attention heads"


@pytest.mark.parametrize(
    "command",
    [["convert", "{missing}", "{out}"], ["convert", "{missing}", "{out}", "--dry-run"], ["inspect", "{missing}"]],
)
def test_a_missing_model_dir_is_named_not_its_config(tmp_path: Path, command: list[str]) -> None:
    missing = tmp_path / "no-such-model"
    line = error_line(run_foldckpt(*[a.format(missing=missing, out=tmp_path / "out") for a in command]))
    assert line == f"foldckpt: error: {missing}: no such directory"
    assert "config.json" not in line


@pytest.mark.parametrize(
    "command",
    [
        ["convert", "{model}", "{out}", "--tp", "abc", "--json"],  # usage
        ["convert", "{missing}", "{out}", "--json"],  # bad input
        ["verify", "{missing}", "--json"],
        ["inspect", "{missing}", "--json"],
        ["verify", "{out}", "--rank", "3", "--json"],
    ],
)
def test_json_errors_print_an_error_object_on_stdout_too(kimi: Path, tmp_path: Path, command: list[str]) -> None:
    argv = [a.format(model=kimi, missing=tmp_path / "missing", out=tmp_path / "out") for a in command]
    run = run_foldckpt(*argv)
    line = error_line(run)
    error = json.loads(run.stdout)["error"]
    assert error["code"] == 2 and error["kind"] in ("usage", "input")
    assert line == f"foldckpt: error: {error['message']}"


# ---------------------------------------------------------------------------------------------
# SIGINT / SIGTERM during convert: 130 / 143, one line, and the rerun resumes

LAYERS = 8
MAX_SHARD_SIZE = "1300000"  # 2 folds per sidecar: a durable point after every layer


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """An 8-layer model and its uninterrupted conversion (the bytes a resumed run must reproduce)."""
    model = make_checkpoint(tmp_path_factory.mktemp("signals") / "model", "deepseek_v3", layers=LAYERS)
    reference = model.parent / "reference"
    run = run_foldckpt("convert", model, reference, "--max-shard-size", MAX_SHARD_SIZE, "-q")
    assert run.returncode == 0, run.stderr
    return model, reference


def journaled_layers(out: Path) -> int:
    try:
        journal = json.loads((out / JOURNAL_NAME).read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return 0
    return sum(len(shard["tensors"]) for shard in journal["shards"].values())


@pytest.mark.parametrize(("signum", "code"), [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
@pytest.mark.parametrize("as_json", [False, True])
def test_a_signal_during_convert_exits_130_or_143_in_one_line_and_the_rerun_resumes(
    deepseek: tuple[Path, Path], tmp_path: Path, signum: int, code: int, as_json: bool
) -> None:
    model, reference = deepseek
    out = tmp_path / "out"
    args = [sys.executable, "-m", "foldckpt", "convert", str(model), str(out), "--max-shard-size", MAX_SHARD_SIZE, "-q"]
    args += ["--json"] if as_json else []
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while process.poll() is None and journaled_layers(out) < 1:
        assert time.monotonic() < deadline, "convert never journaled a layer"
        time.sleep(0.002)
    assert process.poll() is None, "convert finished before the signal could be sent"
    process.send_signal(signum)
    stdout, stderr = process.communicate(timeout=60)
    name = signal.Signals(signum).name
    assert process.returncode == code, (process.returncode, stdout, stderr)
    done = journaled_layers(out)
    assert stderr.splitlines() == [
        f"foldckpt: interrupted by {name}; {done} of {LAYERS} MLA layer(s) finished and kept: "
        "rerun the same command to resume"
    ], stderr
    if as_json:
        error = json.loads(stdout)["error"]
        assert (error["code"], error["kind"], error["signal"], error["resumable"]) == (code, "interrupted", name, True)
    else:
        assert stdout == ""
    assert not (out / MANIFEST_NAME).exists()
    done_before = journaled_layers(out)
    assert done_before >= 1

    rerun = run_foldckpt("convert", model, out, "--max-shard-size", MAX_SHARD_SIZE, "-q", "--json")
    assert rerun.returncode == 0, rerun.stderr
    summary = json.loads(rerun.stdout)
    assert summary["layers_resumed"] >= done_before and summary["layers_folded"] == LAYERS - summary["layers_resumed"]
    assert sorted(summary["resumed_layers"] + summary["folded_layers"]) == list(range(LAYERS))
    for path in reference.iterdir():
        assert (out / path.name).read_bytes() == path.read_bytes(), path.name
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in reference.iterdir())


def test_ctrl_c_before_any_layer_finished_does_not_say_layers_are_kept(
    deepseek: tuple[Path, Path], tmp_path: Path
) -> None:
    """A ^C while the sources were placed or torch imported said "the finished layers are kept"
    when none had finished (issue 46): what is kept is read from OUT_DIR's journal."""
    model, reference = deepseek
    out = tmp_path / "out"
    args = [sys.executable, "-m", "foldckpt", "convert", str(model), str(out), "--max-shard-size", MAX_SHARD_SIZE]
    process = subprocess.Popen([*args, "-q"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while process.poll() is None and not (out / JOURNAL_NAME).exists():  # its first durable step
        assert time.monotonic() < deadline, "convert never wrote its journal"
        time.sleep(0.001)
    process.send_signal(signal.SIGINT)
    _, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, stderr
    assert journaled_layers(out) == 0, "a layer finished before the signal: the premise failed"
    assert stderr.splitlines() == [
        "foldckpt: interrupted by SIGINT; no MLA layer had finished yet: rerun the same command to resume"
    ], stderr
    rerun = run_foldckpt(*args[3:], "-q")
    assert rerun.returncode == 0, rerun.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(p.name for p in reference.iterdir())


def test_ctrl_c_during_verify_deep_keeps_the_levels_it_has_shown(deepseek: tuple[Path, Path]) -> None:
    """Each level is printed as it ends: Ctrl-C in the deep level (torch's import alone takes
    seconds) still shows that manifest, structure and content passed, and no verdict. Before,
    the report was printed at the end only, so the minutes of hashing were lost."""
    _, reference = deepseek
    args = [sys.executable, "-m", "foldckpt", "verify", str(reference), "--deep", "-q"]
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert process.stdout is not None
    shown = []
    while not (shown and shown[-1].startswith("ok   content")):
        line = process.stdout.readline()
        assert line, f"verify ended before its content level: {shown}"
        shown.append(line.rstrip("\n"))
    assert process.poll() is None, "verify finished before the signal could be sent"
    process.send_signal(signal.SIGINT)
    rest, stderr = process.communicate(timeout=60)
    assert process.returncode == 130, (process.returncode, shown, rest, stderr)
    assert [line.split()[:2] for line in shown] == [
        ["sha256", read_manifest(reference).file_sha256],
        ["ok", "manifest"],
        ["ok", "structure"],
        ["ok", "content"],
    ]
    assert rest == ""
    assert stderr.splitlines() == ["foldckpt: interrupted by SIGINT"]


# ---------------------------------------------------------------------------------------------
# internal errors: exit 3, one line, the traceback in a file; no torch on the cheap commands


def fake_torch(root: Path, body: str) -> dict[str, str]:
    """An environment whose ``import torch`` runs ``body`` instead of the real torch."""
    (root / "torch").mkdir(parents=True)
    (root / "torch" / "__init__.py").write_text(body)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), str(REPO)])}


# A torch whose import takes a while and, as torch's own import does in places, swallows any
# exception raised meanwhile (bare except): what a signal handler raised there was lost.
SLOW_SWALLOWING_TORCH = """
import sys, time
print("torch import started", file=sys.stderr, flush=True)
deadline = time.monotonic() + 2
while time.monotonic() < deadline:
    try:
        time.sleep(0.01)
    except:  # noqa: E722
        pass
"""


def test_a_signal_during_torch_s_import_is_raised_once_the_import_is_done(
    deepseek: tuple[Path, Path], tmp_path: Path
) -> None:
    """SIGTERM while verify --deep imports torch: exit 143 with its one line once the import
    ends. Before, the handler's exception was raised inside the import and swallowed there (a
    convert then ran to the end, exit 0) or left torch half-imported (exit 3)."""
    _, reference = deepseek
    env = fake_torch(tmp_path / "site", SLOW_SWALLOWING_TORCH)
    args = [sys.executable, "-m", "foldckpt", "verify", str(reference), "--deep", "-q"]
    process = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    assert process.stderr is not None
    assert process.stderr.readline().strip() == "torch import started"
    process.send_signal(signal.SIGTERM)
    stdout, stderr = process.communicate(timeout=60)
    assert process.returncode == 143, (process.returncode, stdout, stderr)
    assert stderr.splitlines() == ["foldckpt: interrupted by SIGTERM"]
    assert "ok   content" in stdout and "verified" not in stdout


def test_an_internal_error_exits_3_in_one_line_naming_the_traceback_file(kimi: Path, tmp_path: Path) -> None:
    env = fake_torch(tmp_path / "site", "raise RuntimeError('this torch build is broken')\n")
    env["TMPDIR"] = str(tmp_path / "tmp")
    (tmp_path / "tmp").mkdir()
    run = run_foldckpt("convert", kimi, tmp_path / "out", "-q", env=env)
    line = error_line(run, code=3)
    match = re.fullmatch(
        r"foldckpt: internal error: RuntimeError: this torch build is broken; "
        r"traceback written to (\S+) \(please report it\)",
        line,
    )
    assert match, line
    trace = Path(match.group(1))
    assert trace.parent == tmp_path / "tmp"
    text = trace.read_text()
    assert "Traceback (most recent call last)" in text and "RuntimeError: this torch build is broken" in text
    as_json = run_foldckpt("convert", kimi, tmp_path / "out", "-q", "--json", env=env)
    error = json.loads(as_json.stdout)["error"]
    assert error["code"] == 3 and error["kind"] == "internal" and Path(error["traceback"]).is_file()


def test_the_suite_s_internal_errors_write_their_traceback_under_its_basetemp(
    kimi_out: tuple[Path, Run], tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A test that ends a command in an internal error on purpose, with the environment it runs
    everything with, left a foldckpt-traceback-*.txt in the machine's /tmp on every run of the
    suite (issue 46); tests/conftest.py points TMPDIR under the session's basetemp, pruned by pytest."""
    out, _ = kimi_out
    env = fake_torch(tmp_path / "site", "raise ImportError('torch was imported')\n")
    line = error_line(run_foldckpt("verify", out, "--deep", "-q", env=env), code=3)
    match = re.search(r"traceback written to (\S+) ", line)
    assert match, line
    assert Path(match.group(1)).is_file()
    assert Path(match.group(1)).is_relative_to(tmp_path_factory.getbasetemp()), line


def test_help_inspect_dry_run_and_verify_up_to_content_never_import_torch(
    kimi: Path, kimi_out: tuple[Path, Run], tmp_path: Path
) -> None:
    out, _ = kimi_out
    env = fake_torch(tmp_path / "site", "raise ImportError('torch was imported')\n")
    commands = [
        ["--help"],
        ["convert", "--help"],
        ["--version"],
        ["inspect", kimi],
        ["inspect", out, "--json"],
        ["convert", kimi, tmp_path / "plan", "--dry-run"],
        ["convert", kimi, out, "-q"],  # already converted: nothing to fold
        ["verify", out, "--level", "manifest", "-q"],
        ["verify", out, "--level", "structure", "-q"],
        ["verify", out, "-q"],
        ["verify", out, "--rank", "1", "--tp", "2", "-q", "--json"],
    ]
    for command in commands:
        run = run_foldckpt(*command, env=env)
        assert run.returncode == 0 and not run.stderr, (command, run.stdout, run.stderr)
    deep = run_foldckpt("verify", out, "--deep", "-q", env=env)  # the shadow is live: deep needs torch
    assert deep.returncode == 3 and "torch was imported" in deep.stderr


def test_every_ending_freezes_the_collector_before_the_interpreter_s_teardown(kimi_out: tuple[Path, Run]) -> None:
    """After a command that imported torch, the teardown's collections of its objects took most of a
    second; frozen, they are skipped. Checked from an atexit hook, which runs before them, for a
    command that succeeds and one that fails."""
    out, _ = kimi_out
    code = (
        "import atexit, gc, sys; atexit.register(lambda: print('frozen', gc.get_freeze_count(), file=sys.stderr)); "
        "from foldckpt.cli import main; main(sys.argv[1:])"
    )
    for args, expected in ((["verify", str(out), "--deep", "-q"], 0), (["verify", str(out / "nothing")], 2)):
        run = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=300, cwd=REPO)
        assert run.returncode == expected, run.stderr
        frozen = int(re.search(r"^frozen (\d+)$", run.stderr, re.M).group(1))
        assert frozen > (100_000 if expected == 0 else 0), run.stderr  # torch's objects among them


# ---------------------------------------------------------------------------------------------
# what happened


@pytest.mark.parametrize(
    "args",
    [["inspect", "{out}"], ["inspect", "{out}", "--json"], ["verify", "{out}"], ["--help"]],
    ids=["inspect", "inspect-json", "verify", "help"],
)
def test_a_reader_that_leaves_ends_the_command_by_sigpipe(kimi_out: tuple[Path, Run], args: list[str]) -> None:
    """`foldckpt inspect DIR | head`: the command ends as any Unix tool does, killed by SIGPIPE (141
    in a shell), with nothing on stderr. It exited 1, which says "verification failed": click
    turns EPIPE into exit 1. The reader here is gone before the first write (its end of the pipe
    is closed before the interpreter has even started)."""
    out, _ = kimi_out
    process = subprocess.Popen(
        [sys.executable, "-m", "foldckpt", *(arg.format(out=out) for arg in args)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()
    stderr = process.stderr.read()
    assert process.wait(timeout=120) == -signal.SIGPIPE, stderr
    assert "error" not in stderr and "Traceback" not in stderr, stderr


def test_convert_summary_lists_the_folded_layers_and_the_worst_error(kimi_out: tuple[Path, Run]) -> None:
    out, run = kimi_out
    manifest = read_manifest(out)
    worst = max(manifest.tensors.values(), key=lambda t: t.error["rel_fro_error"])
    lines = run.stdout.splitlines()
    assert "folded     3 of 3 MLA layer(s): 3, 5, 6 (mtp)" in lines
    assert (
        f"accuracy   max relative error vs fp64 fold {worst.error['rel_fro_error']:.2e} (layer {worst.layer_index})"
        in lines
    )
    assert not any(line.startswith("resumed") for line in lines)


def test_a_finished_run_is_not_counted_as_resumed(kimi: Path, kimi_out: tuple[Path, Run]) -> None:
    out, _ = kimi_out
    again = run_foldckpt("convert", kimi, out, "-q", "--json")
    summary = json.loads(again.stdout)
    assert summary["up_to_date"] is True
    assert (summary["layers_folded"], summary["layers_resumed"], summary["resumed_layers"]) == (0, 0, [])
    assert [layer["status"] for layer in summary["layers"]] == ["up_to_date"] * 3
    text = run_foldckpt("convert", kimi, out, "-q").stdout.splitlines()
    assert text[0] == f"{out}: already converted with these inputs and parameters; nothing to do"
    assert text[1] == "layers     3 MLA layer(s) folded: 3, 5, 6 (mtp)"


def test_inspect_shows_each_layers_error_and_sidecar(kimi_out: tuple[Path, Run]) -> None:
    out, _ = kimi_out
    manifest = read_manifest(out)
    lines = run_foldckpt("inspect", out).stdout.splitlines()
    for tensor in manifest.tensors.values():
        label = f"{tensor.layer_index}{' (mtp)' if tensor.layer_index == 6 else ''}"
        expected = f"layer      {label:<7}  {tensor.file}  relative error vs fp64 {tensor.error['rel_fro_error']:.2e}"
        assert expected in lines, lines
    assert "sidecar    foldckpt-00001-of-00001.safetensors  3 layer(s)  1.8 MB" in lines
    info = json.loads(run_foldckpt("inspect", out, "--json").stdout)
    assert [(layer["index"], layer["sidecar"]) for layer in info["layers"]] == [
        (t.layer_index, t.file) for t in manifest.tensors.values()
    ]


def test_verify_prints_the_elapsed_time(kimi_out: tuple[Path, Run]) -> None:
    out, _ = kimi_out
    lines = run_foldckpt("verify", out, "-q").stdout.splitlines()
    assert re.fullmatch(r"verified in \d+\.\d\d s", lines[-1]), lines
    assert re.fullmatch(r"sha256     [0-9a-f]{64}  foldckpt\.json", lines[0]), lines
    assert all(re.search(r" \(\d+\.\d\d s\)$", line) for line in lines[1:-1]), lines
    report = json.loads(run_foldckpt("verify", out, "-q", "--json").stdout)
    assert report["elapsed_s"] >= sum(level["elapsed_s"] for level in report["levels"]) > 0


@pytest.mark.parametrize("too_long", ["x" * 300, "/".join(["abcdefg"] * 520)], ids=["name", "path"])
@pytest.mark.parametrize("command", ["verify", "inspect", "convert-out", "convert-model", "dry-run"])
def test_an_overlong_path_is_bad_input_in_one_line(
    kimi: Path, kimi_out: tuple[Path, Run], tmp_path: Path, too_long: str, command: str
) -> None:
    """A name of 300 bytes, or a path of more than 4096, was an internal error (exit 3, a
    traceback file) in convert, verify and inspect (issue 46): ENAMETOOLONG is bad input."""
    path = tmp_path / too_long
    argv = {
        "verify": ["verify", path],
        "inspect": ["inspect", path],
        "convert-out": ["convert", kimi, path],
        "convert-model": ["convert", path, tmp_path / "out"],
        "dry-run": ["convert", kimi, path, "--dry-run"],
    }[command]
    line = error_line(run_foldckpt(*argv))
    assert line.startswith(f"foldckpt: error: {tmp_path}/"), line
    assert "file name too long (a name longer than the filesystem allows" in line, line
    assert sorted(os.listdir(tmp_path)) == []  # nothing made


FORGED = "verified in 0.01 s"


def test_names_from_disk_are_escaped_in_the_text_output(kimi: Path, tmp_path: Path) -> None:
    """A file named ``a<newline>verified in 0.01 s`` in OUT_DIR made verify print a forged
    "verified" line under its failure (issue 46). Every name from disk, in convert's, inspect's and
    verify's text output and in a refusal on stderr, shows a newline as ``\\n`` (and a byte that
    is not UTF-8 as ``\\xff``)."""
    model = Path(shutil.copytree(kimi, tmp_path / f"model\n{FORGED}"))
    out = tmp_path / f"out\n{FORGED}"
    raw = {"errors": "surrogateescape"}  # a raw byte that is not UTF-8 is read, not an error of the test
    runs = [run_foldckpt("convert", model, out, "--dry-run", **raw), run_foldckpt("convert", model, out, "-q", **raw)]
    runs.append(run_foldckpt("inspect", out, **raw))
    (out / f"a\n{FORGED}").write_text("")
    (out / os.fsdecode(b"b\xff")).write_text("")
    runs.append(run_foldckpt("verify", out, "-q", **raw))
    assert [run.returncode for run in runs] == [0, 0, 0, 1], runs
    for run in runs:
        assert not any(line.startswith(FORGED) for line in run.stdout.splitlines()), run.stdout
        assert f"\\n{FORGED}" in run.stdout, run.stdout
    problems = [line for line in runs[-1].stdout.splitlines() if line.startswith("     - ")]
    assert problems == [
        f"     - a\\n{FORGED}: a stray file not listed in foldckpt.json; {ALLOW_HINT}",
        f"     - b\\xff: a stray file not listed in foldckpt.json; {ALLOW_HINT}",
    ]
    refused = error_line(run_foldckpt("convert", model, out, "--fold-dtype", "float32"))
    assert refused.startswith(f"foldckpt: error: {tmp_path}/out\\n{FORGED}: holds a finished conversion"), refused


ALLOW_HINT = "remove it, or allow it (verify --allow-extra PATTERN; FOLDCKPT_ALLOW_EXTRA when serving)"


def test_progress_without_a_tty_is_plain_lines(kimi: Path, tmp_path: Path) -> None:
    env = {**os.environ, "FOLDCKPT_PROGRESS_INTERVAL": "0"}
    run = run_foldckpt("convert", kimi, tmp_path / "out", env=env)
    assert run.returncode == 0, run.stderr
    assert "\r" not in run.stderr and "\x1b" not in run.stderr
    lines = run.stderr.splitlines()
    pattern = r"(placing sources|folding|hashing sources): [\d.]+( [KMG]?B)?/[\d.]+( [KMG]?B| layers?) \(\d+%\) in \d+\.\d s.*"
    assert lines and all(re.fullmatch(pattern, line) for line in lines), lines
    folding = [line for line in lines if line.startswith("folding: ")]
    assert [line.split()[1] for line in folding] == ["1/3", "2/3", "3/3"]
    verify = run_foldckpt("verify", tmp_path / "out")
    assert verify.returncode == 0 and "\r" not in verify.stderr
    assert re.fullmatch(r"hashing: [\d.]+ [KMG]?B/[\d.]+ [KMG]?B \(100%\) in \d+\.\d s.*\n", verify.stderr), (
        verify.stderr
    )


def test_progress_lines_are_periodic_not_per_update(kimi: Path, tmp_path: Path) -> None:
    """At the default interval (10 s) a run this short prints one closing line per stage."""
    run = run_foldckpt("convert", kimi, tmp_path / "out")
    assert run.returncode == 0, run.stderr
    assert [line.split(":")[0] for line in run.stderr.splitlines()] == ["placing sources", "hashing sources", "folding"]


def test_convert_and_verify_json_need_no_progress_flag(make_model: Callable[..., Path], tmp_path: Path) -> None:
    """--json implies no progress output: stderr stays empty for machines."""
    model = make_model("deepseek_v3")
    run = run_foldckpt("convert", model, tmp_path / "out", "--json")
    assert run.returncode == 0 and run.stderr == "", run.stderr
    assert json.loads(run.stdout)["folded_layers"] == [0, 1]


def test_the_cli_flags_are_generated_from_the_library_options() -> None:
    """Each flag field of ConvertOptions / VerifyOptions is a click option with the field's help,
    default and choices, and a command given no flags builds exactly the library's default options
    (a default or a choice written twice would drift apart)."""
    import dataclasses

    from foldckpt import cli, verify
    from foldckpt.convert.plan import FOLD_DTYPES
    from foldckpt.options import ConvertOptions, VerifyOptions

    for name, options, args in (("convert", ConvertOptions, ["model", "out"]), ("verify", VerifyOptions, ["out"])):
        command = cli.cli.commands[name]
        params = {param.name: param for param in command.params}
        for field in dataclasses.fields(options):
            if "help" not in field.metadata:
                assert field.name not in params
                continue
            param = params[field.name]
            assert param.help == field.metadata["help"]
            if field.metadata["choices"] is not None:
                assert tuple(param.type.choices) == field.metadata["choices"]
        parsed = command.make_context(name, list(args)).params
        assert cli.options_from(options, parsed, progress=True) == options()
    assert ConvertOptions.__dataclass_fields__["fold_dtype"].metadata["choices"] == tuple(FOLD_DTYPES)
    assert verify.LEVELS == VerifyOptions.__dataclass_fields__["level"].metadata["choices"]


@pytest.mark.parametrize("missing", ["safetensors", "numpy"])
def test_make_tiny_checkpoint_without_the_synthetic_extra_says_what_to_install(tmp_path: Path, missing: str) -> None:
    """Without the [synthetic] extra the script died in a traceback (ModuleNotFoundError). Python's
    own "not importable" (None in sys.modules) stands for the package not being installed."""
    script = REPO / "scripts" / "make_tiny_checkpoint.py"
    code = (
        f"import runpy, sys; sys.modules[{missing!r}] = None; sys.argv[1:] = [{str(tmp_path / 'm')!r}]; "
        f"runpy.run_path({str(script)!r}, run_name='__main__')"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        f"make_tiny_checkpoint.py: needs {missing} (not installed): pip install 'foldckpt[synthetic]'"
    ]
    assert not (tmp_path / "m").exists()


@pytest.mark.slow
def test_make_tiny_checkpoint_help_gives_the_size_of_what_it_writes(tmp_path: Path) -> None:
    """``--help`` said nothing of how big a checkpoint is (issue 46): a user about to write a
    full-geometry one could not know it is hundreds of MB. Each size its table gives is what the
    defaults write, as the script's last line prints it (decimal MB, one decimal)."""
    script = REPO / "scripts" / "make_tiny_checkpoint.py"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    shown = subprocess.run([sys.executable, script, "--help"], capture_output=True, text=True, env=env, check=True)
    sizes = re.findall(r"^ {4}(\w+)( --full-geometry)?\s+(\d+\.\d) MB ", shown.stdout, re.M)
    assert {family for family, _, _ in sizes} == set(FAMILIES), shown.stdout
    for family, full, megabytes in sizes:
        out = make_checkpoint(tmp_path / f"{family}{full.strip()}", family, full_geometry=bool(full))
        total = sum(path.stat().st_size for path in out.iterdir())
        assert f"{total / 1e6:.1f}" == megabytes, (family, full, total)
