"""The CPU serving recipe of docs/serving.md, run as it is written (issue 32: it failed on the demo's model).

The ``bash`` block that starts the server under "## On a CPU" is run by bash, unchanged but for its port (8000 may
be taken on a shared machine), in a folder where its names mean what they say: ``.venv`` is this
test's virtualenv and ``OUT_DIR`` a converted tiny DeepSeek-V3. Its last command's reply must be a
completion of the tokens it asked for, served with the fold (the stats file says so).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from foldckpt.convert import ConvertOptions, convert
from tests.conftest import REPO
from tests.e2e.harness import Progress, free_port, requires_vllm

pytestmark = [pytest.mark.e2e, pytest.mark.slow, requires_vllm]

HEADING = "## On a CPU"
RECIPE_TIMEOUT_S = 420


def recipe() -> str:
    """The serving block of the CPU recipe (the one that starts the server)."""
    section = (REPO / "docs/serving.md").read_text().split(HEADING, 1)[1].split("\n## ", 1)[0]
    blocks = [block.split("\n", 1)[1] for block in section.split("```")[1::2] if block.startswith("bash")]
    (block,) = [block for block in blocks if "api_server" in block]
    return block


def test_the_cpu_recipe_serves_a_converted_model(tiny_model: Path, tmp_path: Path) -> None:
    script = recipe()
    assert "--port 8000" in script and "127.0.0.1:8000" in script
    assert "VLLM_KIMI_K3_GEMM_AR=0" in script  # vLLM's Kimi-K3 imports cutlass on a CPU without it
    (tmp_path / ".venv").symlink_to(Path(sys.executable).parent.parent)
    convert(tiny_model, tmp_path / "OUT_DIR", ConvertOptions(progress=False))
    stats = tmp_path / "stats.json"
    env = {key: value for key, value in os.environ.items() if not key.startswith(("VLLM_", "FOLDCKPT_"))}
    env["FOLDCKPT_STATS_FILE"] = str(stats)
    port = str(free_port())
    output = tmp_path / "recipe.out"  # curl's replies, and the server's log (vLLM logs to stdout)
    with open(output, "wb") as out:
        run = subprocess.Popen(
            ["bash", "-euc", script.replace("8000", port)],
            cwd=tmp_path,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            with Progress("docs/serving.md's CPU recipe: a server, then curl") as step:
                code = run.wait(timeout=RECIPE_TIMEOUT_S)
                step.outcome = f"exit {code}"
            served = _stats_after(stats, lambda counts: counts["folded_decode_tokens"] >= 15)
        finally:
            os.killpg(run.pid, signal.SIGTERM)  # the server the recipe left in the background
    text = output.read_text(errors="replace")
    assert code == 0, text[-6000:]
    # curl prints the reply with no newline, and the server may log right after it
    completion, _ = json.JSONDecoder().raw_decode(text, text.index('{"id"'))
    assert completion["usage"]["completion_tokens"] == 16, completion
    assert served["folded_decode_tokens"] >= 15, (served, text[-6000:])


def _stats_after(path: Path, done: Callable[[dict[str, int]], bool]) -> dict[str, int]:
    """The worker's routing counters once ``done`` holds (it writes them at most every 50 ms)."""
    deadline = time.monotonic() + 10
    counts: dict[str, int] = {}
    while time.monotonic() < deadline and not (counts and done(counts)):
        if path.exists():
            counts = json.loads(path.read_text())
        time.sleep(0.1)
    return counts
