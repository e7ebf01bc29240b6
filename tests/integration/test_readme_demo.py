"""The README's demo excerpt is what ``scripts/demo.sh`` really prints (issue 11).

The block under "What `scripts/demo.sh` prints" is parsed into ``$ command`` entries; each command
must be one that demo.sh runs, and running it, as the demo does, on the demo's checkpoint must
print exactly the lines shown, with timings and hash prefixes normalised. A trailing ``# after
flipping one sidecar byte`` on a command replays demo.sh's corruption first; ``# exit code N`` on
an output line is the exit status expected.

To refresh the README block from real output: ``python -m tests.integration.test_readme_demo``.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO

README = REPO / "README.md"
DEMO = REPO / "scripts" / "demo.sh"
MODEL = ".work/demo/kimi-k3-tiny"
OUT = ".work/demo/kimi-k3-tiny-folded"
FLIP = "after flipping one sidecar byte"
SIDECAR = "foldckpt-00001-of-00001.safetensors"


@dataclass
class Entry:
    command: str
    comment: str
    output: list[str]
    exit_code: int


def readme_block() -> list[str]:
    text = README.read_text()
    start = text.index("What `scripts/demo.sh` prints")
    block = text[start:].split("```", 2)[1].partition("\n")[2]  # the text after the language tag
    return block.strip("\n").splitlines()


def parse(lines: list[str]) -> list[Entry]:
    entries: list[Entry] = []
    for line in lines:
        if line.startswith("$ "):
            command, _, comment = line[2:].partition("#")
            entries.append(Entry(command.strip(), comment.strip(), [], 0))
        elif entries:
            match = re.fullmatch(r"(.*?)\s+# exit code (\d+)", line)
            if match:
                line = match.group(1)
                entries[-1].exit_code = int(match.group(2))
            entries[-1].output.append(line)
    for entry in entries:
        while entry.output and not entry.output[-1].strip():
            entry.output.pop()
    return entries


def demo_commands() -> set[str]:
    """The foldckpt commands demo.sh runs (as a user types them in the activated venv: demo.sh
    puts its bin/ first on PATH), with its variables replaced by their default values."""
    commands = set()
    for line in DEMO.read_text().splitlines():
        if not re.search(r"(^|\s)foldckpt\s", line):
            continue
        words = shlex.split(line, comments=True)
        if "foldckpt" not in words:
            continue
        words = [w.replace("$MODEL", MODEL).replace("$OUT", OUT) for w in words[words.index("foldckpt") :]]
        commands.add(" ".join(words))
    return commands


def normalise(lines: list[str]) -> list[str]:
    out = []
    for line in lines:
        line = re.sub(r"\b\d+\.\d+ s\b", "<t> s", line)
        out.append(line.rstrip())
    return out


def run_demo(work: Path, entries: list[Entry]) -> list[tuple[list[str], int]]:
    """Build the demo checkpoint in ``work`` as demo.sh does, then run each entry there: its output
    as a terminal shows it, stdout then stderr (where an error line goes)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make_tiny_checkpoint.py"), "--family", "kimi_k3", MODEL],
        cwd=work,
        env=env,
        check=True,
        capture_output=True,
    )
    results = []
    for entry in entries:
        if entry.comment == FLIP:  # demo.sh: printf '\xff' | dd of=SIDECAR bs=1 seek=4096 conv=notrunc
            with open(work / OUT / SIDECAR, "r+b") as handle:
                handle.seek(4096)
                handle.write(b"\xff")
        words = shlex.split(entry.command)
        assert words[0] == "foldckpt", entry.command
        run = subprocess.run(
            [sys.executable, "-m", "foldckpt", *words[1:]],
            cwd=work,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
        results.append(((run.stdout + run.stderr).rstrip("\n").splitlines(), run.returncode))
    return results


def test_the_readme_demo_excerpt_is_real_output(tmp_path: Path) -> None:
    entries = parse(readme_block())
    assert len(entries) >= 4
    known = demo_commands()
    for entry in entries:
        assert entry.command in known, f"README shows `{entry.command}`, which scripts/demo.sh does not run"
    assert any(entry.comment == FLIP and entry.exit_code == 1 for entry in entries)
    for entry, (printed, code) in zip(entries, run_demo(tmp_path, entries), strict=True):
        assert code == entry.exit_code, (entry.command, code, printed)
        assert normalise(printed) == normalise(entry.output), f"$ {entry.command}"


@pytest.mark.slow
def test_demo_sh_prints_plain_text_commands_a_user_can_type_and_how_to_activate(tmp_path: Path) -> None:
    """scripts/demo.sh end to end, its output a pipe (``demo.sh > demo.log``), in a copy of the
    repository's scripts whose venv is this test's interpreter (``setup_venv.sh`` a no-op): no
    escape codes (issue 46: bold titles went into the file), each command printed as it runs in
    the activated venv, and a last line saying how to activate it (foldckpt is not on PATH)."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    for script in ("demo.sh", "make_tiny_checkpoint.py"):
        shutil.copy(REPO / "scripts" / script, root / "scripts" / script)
    (root / "scripts" / "setup_venv.sh").write_text("exit 0\n")
    venv_bin = root / "venv" / "bin"
    venv_bin.mkdir(parents=True)
    for tool, command in (("python", ""), ("foldckpt", " -m foldckpt")):
        (venv_bin / tool).write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)}{command} "$@"\n')
        (venv_bin / tool).chmod(0o755)
    env = {**os.environ, "PYTHONPATH": str(REPO), "FOLDCKPT_VENV": "venv"}
    env.pop("DEMO_DIR", None)
    run = subprocess.run(["bash", "scripts/demo.sh"], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "\x1b" not in run.stdout + run.stderr
    printed = [line[2:] for line in run.stdout.splitlines() if line.startswith("$ ")]
    assert printed[0] == f"python scripts/make_tiny_checkpoint.py --family kimi_k3 {MODEL}"
    assert set(printed[1:]) == demo_commands() - {f"foldckpt verify {OUT} --quiet"}  # step 8 is not echoed
    assert run.stdout.splitlines()[-1] == (
        f"to type the commands above yourself: source {venv_bin}/activate (foldckpt is installed in venv only)"
    )


def print_block() -> None:
    """Print the README block as the demo prints it now (comments of the current block kept)."""
    import tempfile

    entries = parse(readme_block())
    with tempfile.TemporaryDirectory() as tmp:
        results = run_demo(Path(tmp), entries)
    width = 64
    for number, (entry, (printed, code)) in enumerate(zip(entries, results, strict=True)):
        if number:
            print()
        comment = f"      # {entry.comment}" if entry.comment else ""
        print(f"$ {entry.command}{comment}")
        for index, line in enumerate(printed):
            if code and index == len(printed) - 1:
                line = f"{line:<{width}} # exit code {code}"
            print(line)


if __name__ == "__main__":
    print_block()
