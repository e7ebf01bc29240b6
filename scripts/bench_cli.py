#!/usr/bin/env python3
"""Start-up time of the ``foldckpt`` command line -> ``docs/bench/cli.json``.

Times, in fresh processes (wall clock, median of ``--runs`` after one warm-up run):

* ``python -c pass``: the interpreter's own floor on this machine;
* ``foldckpt --help``: target <= 0.5 s;
* ``foldckpt verify OUT --level content -q`` on the demo's output (the Kimi-K3-geometry tiny
  checkpoint of ``scripts/demo.sh``, converted once): start-up plus hashing ~12 MB;

and, with ``python -X importtime``, whether each command imports torch. ``--checkout DIR`` times
another checkout of foldckpt (e.g. ``git archive`` of an older commit) with this same interpreter
and demo output; results are stored under ``--label`` next to the others in the JSON file.

    python scripts/bench_cli.py --label after
    git archive e79a18f | tar -x -C /tmp/before && python scripts/bench_cli.py --checkout /tmp/before --label before
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def timed(command: list[str], cwd: Path, runs: int) -> dict[str, float | int]:
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    subprocess.run(command, cwd=cwd, env=env, capture_output=True, check=True)  # warm-up: page cache, .pyc
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        subprocess.run(command, cwd=cwd, env=env, capture_output=True, check=True)
        times.append(time.perf_counter() - started)
    return {
        "median_s": round(statistics.median(times), 4),
        "min_s": round(min(times), 4),
        "max_s": round(max(times), 4),
        "runs": runs,
    }


def imports_torch(command: list[str], cwd: Path) -> bool:
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    run = subprocess.run(
        [command[0], "-X", "importtime", *command[1:]], cwd=cwd, env=env, capture_output=True, text=True
    )
    return any(line.rsplit("|", 1)[-1].strip() == "torch" for line in run.stderr.splitlines())


def demo_output(work: Path) -> Path:
    """The demo's checkpoint, converted with this repository's foldckpt."""
    sys.path.insert(0, str(REPO))
    from foldckpt.convert import ConvertOptions, convert
    from foldckpt.model.synthetic import make_checkpoint

    model = make_checkpoint(work / "kimi-k3-tiny", "kimi_k3")
    out = work / "kimi-k3-tiny-folded"
    convert(model, out, ConvertOptions(progress=False))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkout", type=Path, default=REPO, help="foldckpt checkout to time (default: this one)")
    parser.add_argument("--label", default="after", help="key of these results in the JSON file")
    parser.add_argument("--runs", type=int, default=15)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "bench" / "cli.json")
    args = parser.parse_args()
    checkout = args.checkout.resolve()
    python = sys.executable
    with tempfile.TemporaryDirectory(prefix="foldckpt-bench-cli-") as tmp:
        out = demo_output(Path(tmp))
        commands = {
            "python -c pass": [python, "-c", "pass"],
            "foldckpt --help": [python, "-m", "foldckpt", "--help"],
            "foldckpt verify --level content (demo output)": [
                python,
                "-m",
                "foldckpt",
                "verify",
                str(out),
                "--level",
                "content",
                "-q",
            ],
        }
        results = {
            name: {**timed(command, checkout, args.runs), "imports_torch": imports_torch(command, checkout)}
            for name, command in commands.items()
        }
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True
    ).stdout.strip()
    entry = {
        "checkout": str(checkout) if checkout != REPO else f"this repository ({commit} + working tree)",
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "load_average_1min": round(os.getloadavg()[0], 2),
        "results": results,
    }
    data = json.loads(args.out.read_text()) if args.out.exists() else {}
    data.setdefault(
        "description",
        "Start-up time of the foldckpt CLI in fresh processes (wall clock, median of N runs after a "
        "warm-up); scripts/bench_cli.py. Target: foldckpt --help <= 0.5 s.",
    )
    data[args.label] = entry
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    for name, result in results.items():
        print(
            f"{args.label:>8}  {name:<48} median {result['median_s']:.3f} s  (min {result['min_s']:.3f})  "
            f"imports torch: {result['imports_torch']}"
        )


if __name__ == "__main__":
    main()
