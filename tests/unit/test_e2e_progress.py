"""The e2e suite's progress lines (``tests/e2e/harness.py``: ``Progress``; ``tests/e2e/conftest.py``).

Issue 46: the e2e tests showed nothing for minutes while their engines started. Every engine run
(``run_job``), every OpenAI server start and the CPU recipe now report on the terminal when they
start and how they ended, past pytest's output capture. Checked here in a pytest of its own (no
vLLM): a test using the real fixture and ``Progress``, its output as a user's terminal gets it.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

STEPS = """
import pytest

from tests.e2e.harness import Progress


def test_a_step() -> None:
    print("the test's own output")
    with Progress("engine one") as step:
        step.outcome = "exit 0"


def test_a_step_that_raises() -> None:
    with pytest.raises(RuntimeError), Progress("engine two"):
        raise RuntimeError
"""


def run_pytest(folder: Path, *options: str) -> list[str]:
    (folder / "conftest.py").write_text(
        "from tests.e2e.conftest import engine_progress_on_the_terminal  # noqa: F401\n"
    )
    (folder / "test_steps.py").write_text(STEPS)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *options, "test_steps.py"],
        cwd=folder,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout.splitlines()


def test_each_step_reports_its_start_and_end_on_the_terminal_past_the_capture(tmp_path: Path) -> None:
    lines = run_pytest(tmp_path)
    progress = [line for line in lines if line.startswith("    e2e: ")]
    assert progress == [
        "    e2e: engine one ...",
        "    e2e: engine one: exit 0 after 0 s",
        "    e2e: engine two ...",
        "    e2e: engine two: failed after 0 s",
    ]
    assert "the test's own output" not in "\n".join(lines)  # still captured: only the progress passes


@pytest.mark.parametrize("quiet", ["-q", "-qq"])
def test_quiet_runs_stay_quiet(tmp_path: Path, quiet: str) -> None:
    assert not [line for line in run_pytest(tmp_path, quiet) if "e2e:" in line]
