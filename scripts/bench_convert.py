#!/usr/bin/env python3
"""Convert time against the I/O floor, and peak memory, on Kimi-K3's real attention shapes.

Why: a conversion must read its sources once (to hash them) and write its folds; the fold itself is
cheap (about 19 GFLOP per Kimi-K3 layer). So the claim under test is "wall time close to the time
the disk needs for exactly those bytes, memory flat in the number of layers". Both sides are
measured here, in the same run, on the same files, cold (each file's pages are dropped from the
page cache first, ``POSIX_FADV_DONTNEED``; the JSON says whether that worked), each on a settled
disk (``sync`` and a pause first, so that no phase shares the disk with the last one's writes):

* ``io_floor_s``: a read of every source byte convert hashes, concurrently with a write + fsync
  of as many bytes as convert writes (the sidecars, with hard-linked sources), on the same
  filesystems; measured with plain reads and writes and with direct I/O, the faster of the two;
* ``wall_s``: ``convert`` in a fresh process (``VmHWM`` is its peak RSS), with the bytes it read,
  hashed, wrote and copied and each stage's busy time, as ``ConvertResult.io`` reports them.

Checkpoints: full-geometry Kimi-K3 attention (96 heads, Lq 1536, L 512, P 128, R 64, hidden 7168),
one shard per MLA layer as real checkpoints are sharded, plus 1 GB non-attention shards (a stand-in
for the experts) so that linking and source hashing weigh what they weigh. A projection for a full
Kimi-K3 (24 MLA layers, about 1.4 TB of sources) comes from the measured rates.
Writes docs/bench/convert.json.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import click
from bench_machine import commit, machine

from foldckpt import __version__
from foldckpt.io.direct_io import DurableAppender, open_direct, read_direct
from foldckpt.io.hashing import default_workers, in_page_cache, tensor_hasher
from foldckpt.model.synthetic import make_checkpoint

FULL_K3_SOURCE_BYTES = 1.4e12
FULL_K3_MLA_LAYERS = 24
_READ_BUFFER = 8 * 1024 * 1024
_SETTLE_S = 5.0

# The command users run, `foldckpt convert ... --json` (its own exit included: the CLI freezes the
# collector before the interpreter's teardown, which a bare convert() call left to collect every
# object torch made, a visible share of a short run's wall). Peak RSS is
# VmHWM, the high-water mark of this process's own address space, read at exit: ru_maxrss would
# also count the bench parent's memory, which Linux carries across fork + exec.
# argv[1]: a folder to import foldckpt from ahead of everything else (--baseline), or "". At exit it
# also reports what stays resident, per mapped file (a shared library's pages) and anonymous memory:
# where a peak comes from. ``--runtime-only DEVICE`` instead of convert's arguments: the same
# imports, and on ``cuda`` a CUDA context with cuBLAS loaded, and nothing converted (the fixed part).
_CHILD = """
import atexit, json, resource, sys
_import_from = sys.argv.pop(1)
if _import_from:
    sys.path.insert(0, _import_from)
def _rss_by_mapping():
    rss, name = {}, "?"
    for line in open("/proc/self/smaps"):
        head = line.split()
        if "-" in head[0] and not head[0].endswith(":"):
            name = head[5].rsplit("/", 1)[-1] if len(head) > 5 else "[anonymous]"
        elif head[0] == "Rss:":
            rss[name] = rss.get(name, 0) + int(head[1]) * 1024
    return dict(sorted(rss.items(), key=lambda item: -item[1])[:12])
def _usage():
    usage = resource.getrusage(resource.RUSAGE_SELF)
    hwm = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmHWM:"))
    print(json.dumps({"peak_rss_bytes": hwm * 1024, "cpu_s": usage.ru_utime + usage.ru_stime,
                      "rss_at_exit_by_mapping": _rss_by_mapping()}), file=sys.stderr)
atexit.register(_usage)
if sys.argv[1] == "--runtime-only":
    import torch
    import foldckpt.cli
    if sys.argv[2] == "cuda":
        x = torch.ones(64, 64, dtype=torch.float64, device="cuda")
        (x @ x).sum().item()
    sys.exit(0)
from foldckpt.cli import main
main(sys.argv[1:])
"""


def _add_filler_shards(model_dir: Path, nbytes: int, shard_bytes: int = 1 << 30) -> None:
    """Non-attention shards (listed in the index, as experts are) of ``nbytes`` random bytes in
    all, ``shard_bytes`` each: real checkpoints are many shards of a few GB, hashed in parallel."""
    cols = 7168
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    chunk = os.urandom(64 * 1024 * 1024)
    count = max(1, -(-nbytes // shard_bytes))
    for number in range(count):
        rows = max(1, min(shard_bytes, nbytes - number * shard_bytes) // (2 * cols))
        name = f"model.filler_experts.{number}.weight"
        header = json.dumps(
            {name: {"dtype": "BF16", "shape": [rows, cols], "data_offsets": [0, rows * cols * 2]}}
        ).encode()
        header += b" " * (-len(header) % 8)
        path = model_dir / f"model-filler-{number:05d}.safetensors"
        with open(path, "wb") as handle:
            handle.write(len(header).to_bytes(8, "little") + header)
            left = rows * cols * 2
            while left:
                left -= handle.write(chunk[: min(left, len(chunk))])
        index["weight_map"][name] = path.name
        index["metadata"]["total_size"] = index["metadata"].get("total_size", 0) + rows * cols * 2
    index_path.write_text(json.dumps(index, indent=2))


def _evict(paths: list[Path]) -> bool:
    """Drop the files' pages from the page cache; True when none of them is cached afterwards."""
    evicted = True
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            evicted = evicted and not in_page_cache(fd, os.fstat(fd).st_size)
        finally:
            os.close(fd)
    return evicted


def _settle() -> None:
    """Let the disk finish what earlier phases wrote before the next timed phase: on this project's
    VMs a virtual disk keeps writing back after fsync returns, and a phase timed right after the
    floor's writes (up to 4x the output bytes) shares the disk with them."""
    os.sync()
    time.sleep(_SETTLE_S)


def _read_file(path: Path, direct: bool) -> int:
    """Read every byte of ``path`` once and nothing else (plain reads, or direct I/O)."""
    total = 0
    fd = open_direct(path, os.O_RDONLY) if direct else None
    if fd is not None:
        try:
            for _, chunk in read_direct(fd, path.stat().st_size, [(0, path.stat().st_size)]):
                total += chunk.nbytes
        finally:
            os.close(fd)
        return total
    buffer = bytearray(_READ_BUFFER)
    with open(path, "rb", buffering=0) as handle:
        while count := handle.readinto(buffer):
            total += count
    return total


def _write_file(path: Path, nbytes: int, direct: bool) -> None:
    """Write ``nbytes`` and fsync once (plain writes, or direct I/O through the appender convert uses)."""
    chunk = memoryview(os.urandom(min(nbytes, 64 * 1024 * 1024)) if nbytes else b"")
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        if direct:
            appender = DurableAppender(path, fd, 0)
            appender.append(
                [chunk[: min(nbytes - start, chunk.nbytes)] for start in range(0, nbytes, max(1, chunk.nbytes))]
            )
            appender.close()
            return
        left = nbytes
        while left:
            left -= os.write(fd, chunk[: min(left, chunk.nbytes)])
        os.fsync(fd)
    finally:
        os.close(fd)


def _io_floor(sources: list[Path], write_bytes: int, scratch: Path) -> dict[str, Any]:
    """Read every source byte (as many threads as convert hashes with) while writing and fsyncing
    ``write_bytes``, both the plain way and with direct I/O; the floor is the faster of the two.
    Also each alone (the faster way), for the stage rates."""
    workers = default_workers()

    def read_all(direct: bool) -> float:
        started = time.perf_counter()
        with ThreadPoolExecutor(workers) as pool:
            list(pool.map(lambda path: _read_file(path, direct), sorted(sources, key=lambda p: -p.stat().st_size)))
        return time.perf_counter() - started

    def write_all(direct: bool) -> float:
        started = time.perf_counter()
        _write_file(scratch / "floor-write.bin", write_bytes, direct)
        return time.perf_counter() - started

    def both(direct: bool) -> float:
        _evict(sources)
        _settle()
        started = time.perf_counter()
        writer = threading.Thread(target=write_all, args=(direct,))
        writer.start()
        read_all(direct)
        writer.join()
        elapsed = time.perf_counter() - started
        (scratch / "floor-write.bin").unlink()
        return elapsed

    alone: dict[str, float] = {}
    for direct in (False, True):
        _evict(sources)
        _settle()
        alone[f"read_{'direct' if direct else 'plain'}_s"] = read_all(direct)
        _settle()
        alone[f"write_{'direct' if direct else 'plain'}_s"] = write_all(direct)
        (scratch / "floor-write.bin").unlink()
    plain, direct = both(False), both(True)
    return {
        "io_floor_s": min(plain, direct),
        "io_floor_plain_s": plain,
        "io_floor_direct_s": direct,
        "read_alone_s": min(alone["read_plain_s"], alone["read_direct_s"]),
        "write_alone_s": min(alone["write_plain_s"], alone["write_direct_s"]),
        **alone,
    }


def _torch_start_s(device: str) -> float:
    """Seconds a fresh process takes to import torch (and, for ``cuda``, to start CUDA): a fixed
    cost inside every ``wall_s`` (convert imports torch once it has something to fold), the same
    for a 4-layer checkpoint as for a terabyte one, which the floor does not have."""
    code = (
        "import time; t = time.perf_counter(); import torch; "
        + ("torch.zeros(1, device='cuda'); " if device == "cuda" else "")
        + "print(time.perf_counter() - t)"
    )
    return float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def _convert_in_child(
    model_dir: Path, out_dir: Path, device: str, fold_dtype: str, import_from: Path | None = None
) -> dict[str, Any]:
    """One ``foldckpt convert --json`` in a fresh process, with foldckpt from ``import_from`` when
    given (a baseline build), else this checkout's."""
    started = time.perf_counter()
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            _CHILD,
            str(import_from or ""),
            "convert",
            str(model_dir),
            str(out_dir),
            "--device",
            device,
            "--fold-dtype",
            fold_dtype,
            "--json",
            "-q",
        ],
        capture_output=True,
        text=True,
    )
    wall = time.perf_counter() - started
    if run.returncode:
        raise click.ClickException(f"convert failed:\n{run.stderr[-3000:]}")
    summary = json.loads(run.stdout)
    return {
        "layers": summary["layers_total"],
        "fold_bytes": summary["fold_bytes"],
        "convert_s": summary["elapsed_s"],
        "placed": summary["placed"],
        "fold_device": summary["fold_device"],
        **summary["io"],
        **json.loads(run.stderr.strip().splitlines()[-1]),
        "wall_s": wall,
    }


def _hash_rates() -> dict[str, float]:
    """Bytes per second one thread digests (1 MiB updates, as convert feeds them): sha256, which
    covers whole files, and the tensor digest (BLAKE3), which covers the folds and their inputs."""
    block = memoryview(os.urandom(1 << 20))
    rates = {}
    for name, digest in (("sha256", hashlib.sha256()), ("tensor_digest", tensor_hasher())):
        started = time.perf_counter()
        for _ in range(512):
            digest.update(block)
        rates[name] = 512 * len(block) / (time.perf_counter() - started)
    return rates


def _cached_read_rate(path: Path) -> float:
    """Bytes per second one thread reads of a file in the page cache (the kernel's copy, which
    costs a core as much as a read from the disk does)."""
    _read_file(path, direct=False)
    started = time.perf_counter()
    return _read_file(path, direct=False) / (time.perf_counter() - started)


def _hash_core_s(source_bytes: float, tensor_bytes: float, rates: dict[str, float], copy_rate: float) -> float:
    """Core-seconds of hashing: each source byte costs the read's copy plus sha256, each byte of
    the folds and of their inputs (``tensor_bytes``, already read) a tensor digest."""
    return source_bytes * (1 / rates["sha256"] + 1 / copy_rate) + tensor_bytes / rates["tensor_digest"]


def _projection(records: list[dict[str, Any]], rates: dict[str, float], copy_rate: float) -> dict[str, Any]:
    """A full Kimi-K3 from the largest run's measured rates. Every stage overlaps the others, so the
    conversion takes its slowest stage plus one layer's fold (the pipeline's fill): reading the
    sources (the floor's read rate), hashing on every core (:func:`_hash_core_s`), folding (the
    measured fold busy time per layer) and writing the folds (the floor's write rate)."""
    last = records[-1]
    cores = os.cpu_count() or 1
    per_layer = FULL_K3_MLA_LAYERS / last["layers"]
    fold_per_layer = last["stage_busy_s"].get("fold", 0.0) / last["layers"]
    fold_bytes = last["fold_bytes"] * per_layer
    tensor_bytes = (last["bytes_hashed"] - last["source_bytes"]) * per_layer  # the folds and their inputs
    stages = {
        "read_s": FULL_K3_SOURCE_BYTES / (last["source_bytes"] / last["read_alone_s"]),
        "hash_s": _hash_core_s(FULL_K3_SOURCE_BYTES, tensor_bytes, rates, copy_rate) / cores,
        "fold_s": fold_per_layer * FULL_K3_MLA_LAYERS,
        "write_s": fold_bytes / (last["bytes_written"] / last["write_alone_s"]),
    }
    floor = max(stages["read_s"], stages["write_s"])
    wall = max(stages.values()) + fold_per_layer
    # The same rule applied to the largest run itself, against what it measured (how far to trust it).
    own_hash = _hash_core_s(last["source_bytes"], last["bytes_hashed"] - last["source_bytes"], rates, copy_rate)
    own = max(last["read_alone_s"], last["write_alone_s"], last["stage_busy_s"].get("fold", 0.0), own_hash / cores)
    return {
        "mla_layers": FULL_K3_MLA_LAYERS,
        "source_bytes": FULL_K3_SOURCE_BYTES,
        "fold_bytes": fold_bytes,
        "cores": cores,
        "sha256_bytes_per_s_per_core": rates["sha256"],
        "tensor_digest_bytes_per_s_per_core": rates["tensor_digest"],
        "cached_read_bytes_per_s_per_core": copy_rate,
        "stages": stages,
        "io_floor_s": floor,
        "wall_s": wall,
        "wall_over_floor": wall / floor,
        "basis": "largest run's rates; stages overlap: wall = slowest stage + one layer's fold",
        "rule_on_largest_run": {"predicted_wall_s": own + fold_per_layer, "measured_wall_s": last["wall_s"]},
    }


@click.command()
@click.option("--mla-layers", "mla_counts", multiple=True, type=int, default=(4, 8, 16), show_default=True)
@click.option(
    "--filler-per-layer",
    type=int,
    default=256 * 1024**2,
    show_default=True,
    help="Bytes of non-attention shard per MLA layer.",
)
@click.option("--device", type=click.Choice(["cpu", "cuda"]), default="cpu", show_default=True)
@click.option("--fold-dtype", default="bfloat16", show_default=True)
@click.option(
    "--repeat", type=int, default=3, show_default=True, help="Runs of convert and of the floor; the best of each."
)
@click.option("--out", type=click.Path(path_type=Path), default=Path("docs/bench/convert.json"), show_default=True)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Scratch space, made if missing (default: the system temp dir).",
)
@click.option(
    "--baseline",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    default=None,
    help="A folder holding another foldckpt build (pip install --target, or a checkout) to convert "
    "with too, alternated with this one on the same files: a change's cost measured in one run.",
)
@click.option("--baseline-label", default=None, help="What the baseline is (a commit), for the JSON.")
def main(
    mla_counts: tuple[int, ...],
    filler_per_layer: int,
    device: str,
    fold_dtype: str,
    repeat: int,
    out: Path,
    workdir: Path | None,
    baseline: Path | None,
    baseline_label: str | None,
) -> None:
    if workdir is not None:
        workdir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="foldckpt-bench-", dir=workdir))
    records: list[dict[str, Any]] = []
    try:
        _write_file(scratch / "rate.bin", 1 << 30, direct=False)
        copy_rate = _cached_read_rate(scratch / "rate.bin")
        (scratch / "rate.bin").unlink()
        rates = _hash_rates()
        for count in mla_counts:
            records.append(
                _measure(scratch, count, filler_per_layer, device, fold_dtype, repeat, baseline, baseline_label)
            )
            # after each count, so that a run cut short (a device's time limit) keeps what it measured
            _write_report(out, records, device, fold_dtype, filler_per_layer, rates, copy_rate)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    click.echo(f"wrote {out}")


def _baseline_record(
    runs: list[dict[str, Any]], baseline_runs: list[dict[str, Any]], baseline: Path, label: str | None
) -> dict[str, Any]:
    """The baseline build's runs next to this checkout's: the best of each, their ratio, and each
    run against the baseline run right after it (neighbours saw the same machine)."""
    best = min(baseline_runs, key=lambda run: run["wall_s"])
    return {
        "label": label or str(baseline),
        "wall_s": best["wall_s"],
        "convert_s": best["convert_s"],
        "cpu_s": best["cpu_s"],
        "stage_busy_s": best["stage_busy_s"],
        "peak_rss_bytes": best["peak_rss_bytes"],
        "all_wall_s": [run["wall_s"] for run in baseline_runs],
        "wall_over_baseline": min(run["wall_s"] for run in runs) / best["wall_s"],
        "paired_wall_over_baseline": [
            run["wall_s"] / base["wall_s"] for run, base in zip(runs, baseline_runs, strict=True)
        ],
    }


def _measure(
    scratch: Path,
    count: int,
    filler_per_layer: int,
    device: str,
    fold_dtype: str,
    repeat: int,
    baseline: Path | None = None,
    baseline_label: str | None = None,
) -> dict[str, Any]:
    """Convert a ``count``-layer checkpoint and measure the floor on its files, alternated (with the
    ``baseline`` build's conversions too, when given)."""
    # Kimi-K3 layout: MLA every 4th layer; the last main layer is MLA too, plus one MTP layer.
    model_dir = make_checkpoint(
        scratch / f"k3-{count}", "kimi_k3", layers=4 * (count - 1), mtp_layers=1, shards=count, full_geometry=True
    )
    _add_filler_shards(model_dir, filler_per_layer * count)
    sources = [p for p in model_dir.iterdir() if p.is_file()]
    source_bytes = sum(p.stat().st_size for p in sources)
    out_dir = scratch / f"k3-{count}-out"
    runs, floors, baseline_runs = [], [], []

    def cold_convert(import_from: Path | None) -> dict[str, Any]:
        cold = _evict(sources)
        _settle()
        run = {**_convert_in_child(model_dir, out_dir, device, fold_dtype, import_from), "cold": cold}
        shutil.rmtree(out_dir)
        return run

    for _ in range(repeat):  # alternated, so that all see the same machine; the best of each
        runs.append(cold_convert(None))
        if baseline is not None:
            baseline_runs.append(cold_convert(baseline))
        floors.append(_io_floor(sources, runs[-1]["bytes_written"], scratch))
    result = dict(min(runs, key=lambda run: run["wall_s"]))
    if baseline_runs:
        result["baseline"] = _baseline_record(runs, baseline_runs, baseline, baseline_label)
    result["torch_start_s"] = _torch_start_s(device)
    written = result["bytes_written"]
    result.update(min(floors, key=lambda floor: floor["io_floor_s"]), source_bytes=source_bytes)
    result["all_wall_s"] = [run["wall_s"] for run in runs]
    result["all_io_floor_s"] = [floor["io_floor_s"] for floor in floors]
    result["wall_over_floor"] = result["wall_s"] / result["io_floor_s"]
    # each conversion against the floor measured right after it: on a VM whose speed drifts
    # over minutes, neighbours saw the same machine
    result["paired_wall_over_floor"] = [
        run["wall_s"] / floor["io_floor_s"] for run, floor in zip(runs, floors, strict=True)
    ]
    click.echo(
        f"{result['layers']:>3} MLA layers  {source_bytes / 1e9:6.2f} GB read  "
        f"{written / 1e9:5.2f} GB written  wall {result['wall_s']:6.1f} s  floor "
        f"{result['io_floor_s']:6.1f} s ({result['wall_over_floor']:.2f}x)  peak RSS "
        f"{result['peak_rss_bytes'] / 2**20:6.0f} MiB  copied {result['bytes_copied']} B"
    )
    if "baseline" in result:
        base = result["baseline"]
        click.echo(f"    baseline {base['label']}: wall {base['wall_s']:6.1f} s ({base['wall_over_baseline']:.2f}x)")
    shutil.rmtree(model_dir)
    return result


def _write_report(
    out: Path,
    records: list[dict[str, Any]],
    device: str,
    fold_dtype: str,
    filler_per_layer: int,
    rates: dict[str, float],
    copy_rate: float,
) -> None:
    peaks = [r["peak_rss_bytes"] for r in records]
    report = {
        "benchmark": "convert",
        "tool_version": __version__,
        "commit": commit(),
        "machine": machine(),
        "device": device,
        "fold_dtype": fold_dtype,
        "geometry": "Kimi-K3: H=96 Lq=1536 L=512 P=128 R=64 V=128, hidden 7168; one shard per MLA layer + 1 GB filler (expert) shards",
        "filler_bytes_per_mla_layer": filler_per_layer,
        "records": records,
        "peak_rss_growth_first_to_last": peaks[-1] / peaks[0] - 1,
        "targets": {"wall_over_floor_at_16": 1.25, "peak_rss_bytes": 2**30, "peak_rss_growth": 0.10, "bytes_copied": 0},
        "projection_full_kimi_k3": _projection(records, rates, copy_rate),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
