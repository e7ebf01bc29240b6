#!/usr/bin/env python3
"""``foldckpt verify --level content`` throughput vs ``sha256sum`` and a plain sequential read.

Builds a converted checkpoint of a few GB: Kimi-K3's real attention shapes (96 heads, Lq 1536,
L 512; ``make_checkpoint(full_geometry=True)``) for the MLA layers, plus expert-weight shards of
random bytes so that the folds are a small share of the bytes, as in a real model. Then, on the same
files and in the same run, interleaving the repeats (other work on the machine hits them alike):

* hashlib sha256, one thread, in memory (8 MiB updates, as verify does), and ``cores`` threads,
* a plain sequential read of the files (Python ``readinto``, 8 MiB, one file after another),
* ``sha256sum`` over the files (sequential, and ``cores`` processes in parallel),
* ``foldckpt verify --level content`` in-process (the content level's own time) and as the real
  command line (wall clock, interpreter and torch import included),

each cold (page cache dropped before every run: ``/proc/sys/vm/drop_caches`` when permitted, plus
``posix_fadvise(DONTNEED)`` on every file, checked with ``fincore`` when present) and warm (every
file in the page cache). Throughput is file bytes / second (GB = 1e9 bytes). The issue's target:
verify >= 90% of min(read speed, cores x single-thread hashlib sha256).
Writes ``docs/bench/verify.json``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import click
import torch
from bench_machine import machine
from safetensors.torch import save_file

from foldckpt import __version__
from foldckpt.convert import ConvertOptions, convert
from foldckpt.format.manifest import read_manifest
from foldckpt.io.files import HASH_CHUNK
from foldckpt.model.synthetic import make_checkpoint
from foldckpt.verify import VerifyOptions, default_workers, verify

_EXPERT_TENSOR_BYTES = 64 * 1024 * 1024


def _gb(count: float) -> float:
    return round(count / 1e9, 3)


# ------------------------------------------------------------------------------------------------
# the checkpoint


def build_checkpoint(root: Path, total_gb: float, expert_shards: int, layers: int, seed: int) -> tuple[Path, Path]:
    """Full-geometry Kimi-K3 attention + random expert shards; converted. Returns (model, out)."""
    model_dir = make_checkpoint(
        root / "model", "kimi_k3", layers=layers, mtp_layers=0, shards=1, full_geometry=True, seed=seed
    )
    index_path = model_dir / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    attention = sum(p.stat().st_size for p in model_dir.glob("*.safetensors"))
    per_shard = max(_EXPERT_TENSOR_BYTES, int((total_gb * 1e9 - attention) / expert_shards))
    generator = torch.Generator().manual_seed(seed)
    for shard in range(expert_shards):
        name = f"experts-{shard + 1:05d}-of-{expert_shards:05d}.safetensors"
        tensors = {}
        for t in range(max(1, per_shard // _EXPERT_TENSOR_BYTES)):
            key = f"language_model.model.layers.{shard}.block_sparse_moe.experts.{t}.w1.weight_packed"
            tensors[key] = torch.randint(
                0, 256, (_EXPERT_TENSOR_BYTES // 4096, 4096), generator=generator, dtype=torch.uint8
            )
        save_file(tensors, str(model_dir / name), metadata={"format": "pt"})
        index["weight_map"].update(dict.fromkeys(tensors, name))
        index["metadata"]["total_size"] += sum(t.nbytes for t in tensors.values())
    index_path.write_text(json.dumps(index, indent=2))
    out_dir = root / "out"
    convert(model_dir, out_dir, ConvertOptions(progress=False))
    return model_dir, out_dir


# ------------------------------------------------------------------------------------------------
# page cache


def _can_drop_caches() -> bool:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("1\n")
        return True
    except OSError:
        return False


def make_cold(files: list[Path], drop_caches: bool) -> None:
    os.sync()
    if drop_caches:
        with open("/proc/sys/vm/drop_caches", "w") as handle:
            handle.write("3\n")
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def make_warm(files: list[Path], drop_caches: bool) -> None:
    """Every file in the page cache, put there by plain sequential reads (after dropping what was
    cached: how pages were cached matters, see the note in the JSON)."""
    make_cold(files, drop_caches)
    sequential_read(files)
    sequential_read(files)


def cached_bytes(files: list[Path]) -> int | None:
    """Bytes of ``files`` in the page cache, per ``fincore`` (None when it is not installed)."""
    if not shutil.which("fincore"):
        return None
    run = subprocess.run(
        ["fincore", "--bytes", "--noheadings", "--output", "RES", *map(str, files)],
        capture_output=True,
        text=True,
        check=False,
    )
    try:
        return sum(int(line.split()[0]) for line in run.stdout.splitlines() if line.strip())
    except (ValueError, IndexError):
        return None


def _cpu_busy(seconds: float = 1.0) -> float:
    """Fraction of all CPUs busy over ``seconds`` (from /proc/stat): other work on the machine."""

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        return sum(fields), fields[3] + fields[4]  # total, idle + iowait

    total0, idle0 = sample()
    time.sleep(seconds)
    total1, idle1 = sample()
    return 1 - (idle1 - idle0) / max(1, total1 - total0)


def _disk_bytes() -> int:
    """Bytes read and written so far by every whole disk (from /proc/diskstats)."""
    total = 0
    for line in Path("/proc/diskstats").read_text().splitlines():
        fields = line.split()
        if len(fields) > 9 and Path(f"/sys/block/{fields[2]}").exists():
            total += (int(fields[5]) + int(fields[9])) * 512
    return total


def wait_for_quiet(max_wait: float, cpu_threshold: float = 0.1, disk_threshold: float = 20e6) -> tuple[float, float]:
    """Wait (up to ``max_wait`` s) until the CPUs and disks are idle (other sessions share this
    machine); returns the CPU busy fraction and the disk bytes/s seen last."""
    deadline = time.monotonic() + max_wait
    while True:
        disk = _disk_bytes()
        busy = _cpu_busy()
        io = _disk_bytes() - disk
        if (busy <= cpu_threshold and io <= disk_threshold) or time.monotonic() >= deadline:
            return busy, io
        time.sleep(2)


# ------------------------------------------------------------------------------------------------
# the measurements: each returns seconds (and may add details)


def sequential_read(files: list[Path]) -> float:
    buffer = bytearray(HASH_CHUNK)
    started = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as handle:
            while handle.readinto(buffer):
                pass
    return time.perf_counter() - started


def parallel_read(files: list[Path], threads: int) -> float:
    """The same files read by ``threads`` threads, largest first (verify's access pattern, no hashing)."""
    ordered = sorted(files, key=lambda p: p.stat().st_size, reverse=True)
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=threads) as pool:
        list(pool.map(lambda path: sequential_read([path]), ordered))
    return time.perf_counter() - started


def sha256sum(files: list[Path], processes: int = 1) -> float:
    started = time.perf_counter()
    if processes == 1:
        subprocess.run(["sha256sum", *map(str, files)], check=True, stdout=subprocess.DEVNULL)
    else:  # as a user would: xargs -P, largest files first
        ordered = sorted(files, key=lambda p: p.stat().st_size, reverse=True)
        subprocess.run(
            ["xargs", "-0", "-n", "1", "-P", str(processes), "sha256sum"],
            input=b"\0".join(str(p).encode() for p in ordered),
            check=True,
            stdout=subprocess.DEVNULL,
        )
    return time.perf_counter() - started


def verify_in_process(out_dir: Path, details: dict[str, Any]) -> float:
    started = time.perf_counter()
    report = verify(out_dir, VerifyOptions(level="content", progress=False))
    wall = time.perf_counter() - started
    assert report.ok, report.to_dict()
    content = report.levels[-1]
    details.setdefault("wall_all_levels_s", []).append(round(wall, 4))
    return content.elapsed_s


def verify_cli(out_dir: Path, details: dict[str, Any]) -> float:
    started = time.perf_counter()
    run = subprocess.run(
        [sys.executable, "-m", "foldckpt", "verify", str(out_dir), "--level", "content", "-q", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    wall = time.perf_counter() - started
    assert run.returncode == 0, run.stdout + run.stderr
    details.setdefault("content_level_s", []).append(round(json.loads(run.stdout)["levels"][-1]["elapsed_s"], 4))
    return wall


def hashlib_rate(threads: int, seconds: float = 1.5) -> float:
    """sha256 bytes/s of ``threads`` threads hashing in-memory 8 MiB blocks (no I/O)."""
    block = memoryview(os.urandom(HASH_CHUNK))
    counts = [0] * threads
    deadline = time.perf_counter() + seconds

    def work(i: int) -> None:
        digest = hashlib.sha256()
        while time.perf_counter() < deadline:
            for _ in range(8):
                digest.update(block)
            counts[i] += 8 * len(block)

    started = time.perf_counter()
    workers = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return sum(counts) / (time.perf_counter() - started)


# ------------------------------------------------------------------------------------------------


def _summary(runs: list[float], nbytes: int) -> dict[str, Any]:
    rates = [nbytes / s for s in runs]
    return {
        "gb_per_s_median": _gb(statistics.median(rates)),
        "gb_per_s_best": _gb(max(rates)),
        "seconds": [round(s, 4) for s in runs],
    }


def _machine() -> dict[str, Any]:
    """:func:`bench_machine.machine`, and the ``sha256sum`` the comparison runs."""
    version = subprocess.run(["sha256sum", "--version"], capture_output=True, text=True, check=False).stdout
    return {**machine(), "sha256sum": version.splitlines()[0] if version else None}


@click.command()
@click.option("--gb", "total_gb", type=float, default=6.0, show_default=True, help="Approximate checkpoint size.")
@click.option("--expert-shards", type=int, default=8, show_default=True, help="Random expert-weight shards.")
@click.option("--layers", type=int, default=4, show_default=True, help="Kimi-K3 main layers (every 4th is MLA).")
@click.option("--repeats", type=int, default=3, show_default=True)
@click.option("--workdir", type=click.Path(path_type=Path), default=None, help="Scratch space (default: a temp dir).")
@click.option("--out", type=click.Path(path_type=Path), default=Path("docs/bench/verify.json"), show_default=True)
@click.option("--keep", is_flag=True, help="Keep the checkpoint.")
@click.option(
    "--quiet-wait",
    type=float,
    default=120.0,
    show_default=True,
    help="Before each run, wait up to this many seconds for other work on the machine to stop.",
)
def main(
    total_gb: float,
    expert_shards: int,
    layers: int,
    repeats: int,
    workdir: Path | None,
    out: Path,
    keep: bool,
    quiet_wait: float,
) -> None:
    cores = os.cpu_count() or 1
    scratch = Path(tempfile.mkdtemp(prefix="foldckpt-bench-verify-", dir=workdir))
    try:
        click.echo(f"building a ~{total_gb} GB checkpoint in {scratch} ...", err=True)
        _, out_dir = build_checkpoint(scratch, total_gb, expert_shards, layers, seed=0)
        manifest = read_manifest(out_dir)
        files = [out_dir / name for name in manifest.files]
        nbytes = sum(p.stat().st_size for p in files)
        fold_bytes = manifest.fold_bytes()
        drop = _can_drop_caches()
        workers = default_workers(cached=False)  # verify's thread count for files not in the page cache
        measures: dict[str, Callable[[dict[str, Any]], float]] = {
            "sequential_read": lambda d: sequential_read(files),
            f"parallel_read_x{workers}_threads": lambda d: parallel_read(files, workers),
            "sha256sum": lambda d: sha256sum(files),
            f"sha256sum_x{cores}_processes": lambda d: sha256sum(files, cores),
            "foldckpt_verify_content": lambda d: verify_in_process(out_dir, d),
            "foldckpt_verify_content_cli": lambda d: verify_cli(out_dir, d),
        }
        results: dict[str, dict[str, Any]] = {}
        target: dict[str, Any] = {
            "formula": "verify >= 0.9 * min(sequential read, cores * single-thread hashlib sha256)",
            "cores": cores,
        }
        for cache in ("cold", "warm"):
            runs: dict[str, list[float]] = {name: [] for name in measures}
            details: dict[str, dict[str, Any]] = {name: {} for name in measures}
            single: list[float] = []
            parallel: list[float] = []
            ratios: list[float] = []
            residency: list[float] = []
            busy: list[tuple[float, float]] = []
            for repeat in range(repeats):
                busy.append(wait_for_quiet(quiet_wait))
                single.append(hashlib_rate(1))  # in the same window as the runs it bounds
                busy.append(wait_for_quiet(quiet_wait))
                parallel.append(hashlib_rate(cores))
                for name, measure in measures.items():  # interleaved: background load hits all alike
                    make_cold(files, drop) if cache == "cold" else make_warm(files, drop)
                    resident = cached_bytes(files)
                    if resident is not None:
                        residency.append(resident / nbytes)
                    busy.append(wait_for_quiet(quiet_wait))
                    runs[name].append(measure(details[name]))
                    click.echo(f"{cache} #{repeat + 1} {name}: {nbytes / runs[name][-1] / 1e9:.2f} GB/s", err=True)
                read = nbytes / runs["sequential_read"][-1]
                verified = nbytes / runs["foldckpt_verify_content"][-1]
                ratios.append(verified / min(read, cores * single[-1]))
                click.echo(
                    f"{cache} #{repeat + 1} hashlib x1 {single[-1] / 1e9:.2f} x{cores} {parallel[-1] / 1e9:.2f} GB/s; "
                    f"verify / bound {ratios[-1]:.3f}",
                    err=True,
                )
            results[cache] = {
                name: {**_summary(runs[name], nbytes), **details[name]} for name in measures if runs[name]
            }
            results[cache]["hashlib_sha256_single_thread_in_memory"] = _rates(single)
            results[cache][f"hashlib_sha256_{cores}_threads_in_memory"] = _rates(parallel)
            results[cache]["page_cache_resident_fraction_before_runs"] = (
                [round(min(residency), 4), round(max(residency), 4)] if residency else "fincore not available"
            )
            results[cache]["other_activity_before_runs"] = {
                "cpu_busy_fraction_median": round(statistics.median(b for b, _ in busy), 3),
                "cpu_busy_fraction_max": round(max(b for b, _ in busy), 3),
                "disk_mb_per_s_median": round(statistics.median(io for _, io in busy) / 1e6, 1),
                "disk_mb_per_s_max": round(max(io for _, io in busy) / 1e6, 1),
                "note": f"CPU share and disk traffic of other processes in the second before each run "
                f"(each run waited up to {quiet_wait:.0f} s for <10% CPU and <20 MB/s disk)",
            }

            read = results[cache]["sequential_read"]["gb_per_s_median"]
            got = results[cache]["foldckpt_verify_content"]["gb_per_s_median"]
            h1, hn = _gb(statistics.median(single)), _gb(statistics.median(parallel))
            bound = min(read, cores * h1)
            parallel_read_rate = results[cache][f"parallel_read_x{workers}_threads"]["gb_per_s_median"]
            target[cache] = {
                "sequential_read_gb_per_s": read,
                "hashlib_single_thread_gb_per_s": h1,
                "cores_x_single_thread_gb_per_s": round(cores * h1, 3),
                "bound_gb_per_s": round(bound, 3),
                "bound_is": "sequential read" if read <= cores * h1 else "cores x single-thread sha256",
                "verify_gb_per_s": got,
                "ratio_to_bound": round(got / bound, 3),
                "ratio_to_bound_per_repeat": [round(r, 3) for r in ratios],
                "meets_90_percent": got >= 0.9 * bound,
                f"hashlib_{cores}_threads_measured_gb_per_s": hn,
                f"parallel_read_x{workers}_threads_gb_per_s": parallel_read_rate,
                "stricter_bound_gb_per_s": round(min(parallel_read_rate, hn), 3),
                "ratio_to_stricter_bound": round(got / min(parallel_read_rate, hn), 3),
                "stricter_bound_note": f"min(read with verify's {workers} threads, measured {cores}-thread hashlib): "
                "what this disk and these cores can do at best for verify's access pattern",
                "sha256sum_gb_per_s": results[cache]["sha256sum"]["gb_per_s_median"],
                "verify_over_sha256sum": round(got / results[cache]["sha256sum"]["gb_per_s_median"], 2),
            }
        record = {
            "benchmark": "foldckpt verify --level content vs sha256sum vs sequential read",
            "script": "scripts/bench_verify.py",
            "command": " ".join(["python", "scripts/bench_verify.py", *sys.argv[1:]]),
            "foldckpt_version": __version__,
            "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": _machine(),
            "checkpoint": {
                "kind": "Kimi-K3 full attention geometry (make_checkpoint full_geometry) + random expert shards",
                "files": len(files),
                "file_sizes_bytes": {p.name: p.stat().st_size for p in files},
                "bytes": nbytes,
                "mla_layers": len(manifest.tensors),
                "fold_bytes": fold_bytes,
                "fold_share": round(fold_bytes / nbytes, 4),
                "verify_sha256_work_bytes": nbytes + fold_bytes,
                "note": "content hashes every file once and each fold tensor a second time in the same read "
                "(fold share of a real model: ~2% DeepSeek-V3, ~0.2% Kimi-K3)",
            },
            "units": "GB/s = 1e9 bytes of files per second; throughput = total file bytes / seconds",
            "cache_method": (
                "cold: os.sync + echo 3 > /proc/sys/vm/drop_caches + posix_fadvise(DONTNEED) per file before each run"
                if drop
                else "cold: posix_fadvise(DONTNEED) per file before each run (drop_caches not permitted)"
            )
            + "; warm: the same, then every file read twice with plain sequential reads before each run; "
            "residency checked with fincore",
            "note_on_warm_cache_state": (
                "verify reads a cold file with direct I/O (past the page cache, the fastest cold read measured "
                "here), so its own pass leaves nothing cached; warm runs start from caches filled by plain reads"
            ),
            "repeats": repeats,
            "results": results,
            "target": target,
        }
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(record, indent=2) + "\n")
        click.echo(json.dumps(target, indent=2))
        click.echo(f"wrote {out}", err=True)
    finally:
        if not keep:
            shutil.rmtree(scratch, ignore_errors=True)


def _rates(rates: list[float]) -> dict[str, Any]:
    return {
        "gb_per_s_median": _gb(statistics.median(rates)),
        "gb_per_s_best": _gb(max(rates)),
        "runs": [_gb(r) for r in rates],
    }


if __name__ == "__main__":
    main()
