#!/usr/bin/env python3
"""Convert throughput and peak memory vs model size, on Kimi-K3's real attention shapes.

Builds full-geometry Kimi-K3 checkpoints (96 heads, Lq 1536, L 512, P 128, R 64; attention
tensors only) with a growing number of MLA layers, converts each in a fresh subprocess and records
wall time and the child's peak RSS. The claim under test: peak memory is a few layers' tensors,
flat in the number of layers (a converter that loads a shard set is broken for a 2.8T model).
Writes docs/bench/convert.json.
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click
import torch

from foldckpt import __version__
from foldckpt.synthetic import make_checkpoint

# Peak RSS is read from VmHWM, the high-water mark of this process's own address space: ru_maxrss
# would also count the bench parent's memory, which Linux carries across fork + exec.
_CHILD = """
import json, sys
from foldckpt.convert import ConvertOptions, convert
r = convert(sys.argv[1], sys.argv[2], ConvertOptions(progress=False))
hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
print(json.dumps({"layers": r.layers_total, "fold_bytes": r.fold_bytes, "peak_rss_bytes": hwm * 1024}))
"""


def _convert_in_child(model_dir: Path, out_dir: Path) -> dict[str, float]:
    started = time.perf_counter()
    run = subprocess.run([sys.executable, "-c", _CHILD, str(model_dir), str(out_dir)],
                         capture_output=True, text=True, check=True)  # fmt: skip
    result = json.loads(run.stdout.strip().splitlines()[-1])
    result["seconds"] = time.perf_counter() - started
    return result


@click.command()
@click.option("--mla-layers", "mla_counts", multiple=True, type=int, default=(2, 4, 8), show_default=True)
@click.option("--out", type=click.Path(path_type=Path), default=Path("docs/bench/convert.json"), show_default=True)
@click.option("--workdir", type=click.Path(path_type=Path), default=None, help="Scratch space (default: a temp dir).")
def main(mla_counts: tuple[int, ...], out: Path, workdir: Path | None) -> None:
    scratch = Path(tempfile.mkdtemp(prefix="foldckpt-bench-", dir=workdir))
    records = []
    try:
        for count in mla_counts:
            # Kimi-K3 layout: MLA every 4th layer; the last main layer is MLA too, plus one MTP layer.
            model_dir = make_checkpoint(scratch / f"k3-{count}", "kimi_k3", layers=4 * (count - 1),
                                        mtp_layers=1, shards=4, full_geometry=True)  # fmt: skip
            source_bytes = sum(p.stat().st_size for p in model_dir.iterdir())
            result = _convert_in_child(model_dir, scratch / f"k3-{count}-out")
            result["source_bytes"] = source_bytes
            result["layers_per_s"] = result["layers"] / result["seconds"]
            result["fold_mb_per_s"] = result["fold_bytes"] / result["seconds"] / 1e6
            records.append(result)
            click.echo(f"{result['layers']:>3} MLA layers  {source_bytes / 1e9:6.2f} GB source  "
                       f"{result['seconds']:6.1f} s  {result['layers_per_s']:.2f} layers/s  "
                       f"peak RSS {result['peak_rss_bytes'] / 1e6:7.0f} MB")  # fmt: skip
            shutil.rmtree(scratch / f"k3-{count}")
            shutil.rmtree(scratch / f"k3-{count}-out")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    peaks = [r["peak_rss_bytes"] for r in records]
    report = {
        "benchmark": "convert",
        "tool_version": __version__,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "torch": torch.__version__},
        "geometry": "Kimi-K3 attention shapes: H=96 Lq=1536 L=512 P=128 R=64 V=128 (attention tensors only)",
        "records": records,
        "peak_rss_growth_first_to_last": peaks[-1] / peaks[0] if peaks else None,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    click.echo(f"wrote {out}")


if __name__ == "__main__":
    main()
