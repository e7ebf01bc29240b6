"""The stats file is kept up to date while the worker runs and holds the final counts at exit.

No vLLM here: :mod:`foldckpt.runtime.stats` is plain Python, exercised in a subprocess so that
process exit (normal, and killed) is real.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from foldckpt.runtime.stats import FLUSH_INTERVAL_S, worker_stats_path

_SCRIPT = """
import sys, time
from pathlib import Path
from foldckpt.runtime.stats import StatsFile
stats = StatsFile(Path(sys.argv[1]))
for layer in ("model.layers.0", "model.layers.1", "model.layers.0"):  # a layer loaded twice counts once
    stats.add_layer_with_fold(layer)
for _ in range(1000):
    stats.record_step(3, 0, 5)
stats.record_step(0, 7, 0)
if sys.argv[2] == "wait":
    print("recorded", flush=True)
    time.sleep(60)
"""


def _run(path: Path, mode: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", _SCRIPT, str(path), mode], stdout=subprocess.PIPE, text=True)


FINAL = {
    "folded_decode_tokens": 3000,
    "unfolded_decode_tokens": 7,
    "prefill_tokens": 5000,
    "mixed_batches": 1000,
    "layers_with_fold": 2,
    "graph_captures_folded": 0,
    "graph_captures_unfolded": 0,
}


def test_final_counts_land_on_a_normal_exit(tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    assert _run(path, "exit").wait(timeout=60) == 0
    assert json.loads(path.read_text()) == FINAL
    assert [p.name for p in tmp_path.iterdir()] == ["stats.json"]  # no temporary file left


def test_counts_land_before_the_worker_is_killed(tmp_path: Path) -> None:
    path = tmp_path / "stats.json"
    process = _run(path, "wait")
    try:
        assert process.stdout is not None and process.stdout.readline() == "recorded\n"
        time.sleep(FLUSH_INTERVAL_S * 4)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait(timeout=30)
    assert json.loads(path.read_text()) == FINAL


def test_each_tensor_parallel_rank_has_its_own_file() -> None:
    assert worker_stats_path("/tmp/s.json", 0, 1) == Path("/tmp/s.json")
    assert worker_stats_path("/tmp/s.json", 0, 8) == Path("/tmp/s.json")
    assert worker_stats_path("/tmp/s.json", 3, 8) == Path("/tmp/s.rank3.json")
