#!/usr/bin/env python3
"""Where ``convert``'s peak host memory goes: the fixed part (torch, and on ``--device cuda`` the
CUDA runtime and cuBLAS) against the part a conversion adds, on the CPU and on a GPU.

Why: ``bench_convert.py`` measured ``convert --device cuda`` at a higher peak RSS than the CPU
fold on the same host (docs/benchmarks.md). A peak that grows with the checkpoint is a defect (the
target is flat memory); a fixed cost of loading the CUDA libraries is not ours to remove. Each run
here is a fresh process (``bench_convert``'s child: ``VmHWM`` is its peak, and what stays resident
at exit is listed per mapped file, so a shared library's pages show by name):

* ``runtime_only``: the imports convert makes, and on ``cuda`` a CUDA context with cuBLAS loaded (an
  fp64 GEMM, the fold's), nothing converted;
* ``tiny_convert``: a conversion of a tiny Kimi-K3 (the test suite's geometry: kilobytes of
  weights), which runs every kind of kernel a real one runs and so loads every CUDA module the
  fold needs, with no data to speak of;
* ``convert``: ``foldckpt convert --device cpu|cuda`` of full-geometry Kimi-K3 attention checkpoints
  with 2 and 8 MLA layers (``bench_convert``'s layout and filler shards).

``added_by_convert`` = convert's peak - the runtime's peak, and ``added_by_data`` = convert's peak
- the tiny conversion's, per device and layer count: what the CUDA path adds over the CPU path
beyond its runtime is either kernel modules (in the tiny conversion too) or data (grows with the
layers). Writes docs/bench/convert_memory_<machine>.json.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import click
import torch
from bench_convert import _CHILD, _add_filler_shards, _convert_in_child
from bench_machine import commit, machine

from foldckpt.model.synthetic import make_checkpoint

MIB = 2**20


def _runtime_only(device: str) -> dict[str, Any]:
    run = subprocess.run(
        [sys.executable, "-c", _CHILD, "", "--runtime-only", device], capture_output=True, text=True, check=True
    )
    return json.loads(run.stderr.strip().splitlines()[-1])


@click.command()
@click.option("--mla-layers", "mla_counts", multiple=True, type=int, default=(2, 8), show_default=True)
@click.option("--filler-per-layer", type=int, default=256 * MIB, show_default=True)
@click.option("--out", type=click.Path(path_type=Path), required=True, help="convert_memory_<machine>.json")
def main(mla_counts: tuple[int, ...], filler_per_layer: int, out: Path) -> None:
    devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    report: dict[str, Any] = {"machine": machine(), "commit": commit(), "method": __doc__, "devices": {}}
    scratch = Path(tempfile.mkdtemp(prefix="foldckpt-rss-"))
    try:
        tiny = make_checkpoint(scratch / "tiny", "kimi_k3", layers=8)
        for device in devices:
            base = _runtime_only(device)
            small = _convert_in_child(tiny, scratch / "tiny-out", device, "bfloat16")
            shutil.rmtree(scratch / "tiny-out")
            entry = report["devices"][device] = {"runtime_only": base, "tiny_convert": small, "convert": []}
            click.echo(
                f"{device}: runtime alone {base['peak_rss_bytes'] / MIB:.0f} MiB, a tiny conversion "
                f"{small['peak_rss_bytes'] / MIB:.0f} MiB"
            )
        for count in mla_counts:
            model_dir = make_checkpoint(
                scratch / f"k3-{count}",
                "kimi_k3",
                layers=4 * (count - 1),
                mtp_layers=1,
                shards=count,
                full_geometry=True,
            )
            _add_filler_shards(model_dir, filler_per_layer * count)
            for device in devices:
                entry = report["devices"][device]
                run = _convert_in_child(model_dir, scratch / "out", device, "bfloat16")
                shutil.rmtree(scratch / "out")
                run["added_by_convert_bytes"] = run["peak_rss_bytes"] - entry["runtime_only"]["peak_rss_bytes"]
                run["added_by_data_bytes"] = run["peak_rss_bytes"] - entry["tiny_convert"]["peak_rss_bytes"]
                entry["convert"].append(run)
                click.echo(
                    f"{device}: {run['layers']} MLA layers peak {run['peak_rss_bytes'] / MIB:.0f} MiB, "
                    f"{run['added_by_convert_bytes'] / MIB:+.0f} MiB over the runtime alone, "
                    f"{run['added_by_data_bytes'] / MIB:+.0f} over the tiny conversion"
                )
            shutil.rmtree(model_dir)
            out.write_text(json.dumps(report, indent=1))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    click.echo(f"wrote {out}")


if __name__ == "__main__":
    main()
