"""Measure the fold GEMM on this GPU and write its tuning table (``configs/<gpu_key>.toml``).

    python -m foldckpt.tune --dtype bf16 --out DIR [--budget-s 330] [--heads 12,6,24]
    python -m foldckpt.tune --dtype fp8  --out DIR [--budget-s 120] [--base-json JSON]
    python -m foldckpt.tune --redecide --base TOML --base-json JSON --out DIR [--tolerance 0.97]

One loop for every dtype (``search``), over the dtype's search space (``bf16.BF16``: the fold and
vLLM's q_b_proj, [[shape]] / [[q_b_proj]]; ``fp8.FP8``: the fp8 fold, [[fp8_shape]], routed
against the base table's q_b_proj kernels): compile every candidate in parallel processes, search
the tiled kernel per deployment and bucket within ``--budget-s``, then per deployment the winners'
flags and RoPE epilogue, the skinny kernel, the grid and the decision. Writes ``<gpu>.toml`` (the
base table, default the shipped ``configs/<gpu>.toml``, with the tuned deployments' entries of
this dtype replaced and everything else kept) and ``tune_<gpu>.json`` (``--base-json``'s records
with this dtype's records of the tuned shapes replaced) into ``--out`` after every deployment, so
a run cut short leaves what it finished. Copy the TOML into ``configs/`` to ship it. Needs a CUDA
GPU and Triton, except ``--redecide`` (recompute the thresholds of ``--base`` from the grid in
``--base-json`` with another ``--tolerance``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import subprocess
import time
import tomllib
from dataclasses import asdict, replace
from pathlib import Path

import torch

from foldckpt.runtime.kernels.device import gpu_key
from foldckpt.runtime.kernels.dispatch import warmup_fold_gemm
from foldckpt.runtime.kernels.timing import measure_copy_bandwidth, settle_clocks
from foldckpt.runtime.kernels.tuning import (
    ROUTE_TOLERANCE,
    TRITON_MAX_M,
    GpuTable,
    KernelConfig,
    SkinnyConfig,
    config_dir,
    parse_table,
    q_b_proj_bucket,
    skinny_config,
)
from foldckpt.tune.bf16 import BF16
from foldckpt.tune.fp8 import FP8
from foldckpt.tune.search import (
    BUCKETS,
    FOLD_ROLES,
    GRID_M,
    GRID_ROUNDS,
    HEADS,
    SKINNY_BLOCK_MS,
    K,
    ShapeBench,
    bucket_block_ms,
    bucket_of,
    decide,
    finish_winners,
    grid_point,
    pdl_supported,
    precompile,
    search,
    search_skinny,
    skinny_block_m,
    table_buckets,
)
from foldckpt.tune.space import SearchSpace
from foldckpt.tune.table import base_seeds, merge, redecide, toml_text

SPACES = {space.name: space for space in (BF16, FP8)}
# The table section of each searched role's entries.
SECTIONS = {"fold": "shape", "q_b_proj": "q_b_proj", "fold_fp8": "fp8_shape"}


# The source tree this module runs from (a checkout or a device copy of one).
SOURCE_TREE = Path(__file__).resolve().parents[2]


def source_commit(tree: Path = SOURCE_TREE) -> str:
    """The commit of the source tree a table or benchmark figure came from (short): what the
    ``GPU_COMMIT`` file of a device copy names (written beside the tree that travels: a copy may
    carry a stale .git), else ``git rev-parse`` in a checkout, else "unknown". A figure is only
    worth the code it measured."""
    marker = tree / "GPU_COMMIT"
    if marker.exists():
        return marker.read_text().strip()
    run = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True)
    return run.stdout.strip() if run.returncode == 0 else "unknown"


def parse_heads(text: str) -> tuple[int, ...]:
    heads = tuple(int(h) for h in text.split(",") if h.strip())
    if not heads or any(h < 1 for h in heads) or len(set(heads)) != len(heads):
        raise argparse.ArgumentTypeError(f"--heads wants distinct positive counts, e.g. 12,6,24; got {text!r}")
    return heads


def _q_b_proj_kernels(
    finished: dict[str, dict[int, tuple[KernelConfig, float]]],
    skinny_best: dict[str, dict[int, tuple[SkinnyConfig, float]]],
    table: GpuTable | None,
    qn: int,
    m: int,
) -> tuple[KernelConfig | None, SkinnyConfig | None]:
    """The unfolded baseline's tiled and skinny q_b_proj kernels at ``m``: this search's where it
    searched q_b_proj (bf16), else the base table's."""
    bucket, tile = bucket_of(m), skinny_block_m(m)
    if "q_b_proj" in finished:
        cfg = finished["q_b_proj"][bucket][0] if bucket is not None else None
        sk = skinny_best["q_b_proj"].get(tile, (None, 0.0))[0] if tile is not None else None
        return cfg, sk
    qb_bucket = q_b_proj_bucket(table, qn, K, m) if m <= TRITON_MAX_M else None
    return (qb_bucket.config if qb_bucket is not None else None), skinny_config(table, "q_b_proj", qn, K, m)


def run(args: argparse.Namespace, space: SearchSpace) -> int:
    """Tune ``space`` on this GPU: see the module docstring."""
    import triton

    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    key = gpu_key(dev)
    start = time.monotonic()
    base_path = args.base if args.base is not None else config_dir() / f"{key}.toml"
    base = tomllib.loads(base_path.read_text(encoding="utf-8")) if base_path.is_file() else None
    if space.fp8 and base is None:
        raise SystemExit(f"tune --dtype fp8: no base table {base_path}: tune --dtype bf16 first")
    table = parse_table(base, str(base_path)) if base is not None else None
    bandwidth = measure_copy_bandwidth(dev)
    print(
        f"{torch.cuda.get_device_name(dev)} ({key}): copy bandwidth {bandwidth / 1e12:.3f} TB/s; {space.name} "
        f"search of heads {args.heads}; base {base_path if base is not None else 'none'}",
        flush=True,
    )
    benches = {h: ShapeBench(h, fp8=space.fp8) for h in args.heads}

    # 1. Compile every candidate in parallel processes (Triton's on-disk cache keeps them).
    configs = sorted(
        {c for m_max in BUCKETS for bm in bucket_block_ms(m_max) for c in space.candidates(bm)},
        key=lambda c: (c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages, c.use_tma),
    )
    ns = sorted({b.weights(role).n for b in benches.values() for role in space.roles})
    pdls = (False, True) if pdl_supported() else (False,)
    skinny = [replace(c, pdl=p) for b in SKINNY_BLOCK_MS for c in space.skinny_candidates(b) for p in pdls]
    jobs = space.compile_jobs(configs, ns) + [(c, ns[0], space.fp8, False) for c in skinny]
    print(f"compiling {len(jobs)} kernels ({len(configs)} tiled, {len(skinny)} skinny configs)", flush=True)
    failed = precompile(jobs, args.workers)
    print(f"compiled in {time.monotonic() - start:.0f} s, {len(failed)} failed", flush=True)

    # 2. The tiled search, every deployment and role sharing the budget; then the winners' variants.
    log: list[dict] = []
    best: dict[tuple[int, str], dict[int, tuple[KernelConfig, float]]] = {}
    searches = [(h, role) for h in args.heads for role in space.roles]
    search_deadline = time.monotonic() + args.budget_s
    for i, (heads, role) in enumerate(searches):
        bench = benches[heads]
        settle_clocks(dev)
        # Each search may use an equal share of what is left; what one does not use rolls on.
        deadline = time.monotonic() + (search_deadline - time.monotonic()) / (len(searches) - i)
        seeds = base_seeds(base, SECTIONS[role], bench.weights(role).n)
        best[(heads, role)] = search(space, bench, role, failed, deadline, log, seeds)
    winner_jobs = [
        (variant, benches[h].weights(role).n, role == "fold_fp8", rope)
        for (h, role), by_m in best.items()
        for cfg, _us in by_m.values()
        for variant in space.flag_variants(cfg)
        for rope in ((False, True) if role in FOLD_ROLES else (False,))
    ]
    precompile(winner_jobs, args.workers)
    print(f"winners' variants compiled at {time.monotonic() - start:.0f} s", flush=True)

    # 3. Per deployment: flags and RoPE, the skinny tiles, the grid, the decision; written each time.
    fold_role = space.roles[0]
    entries: dict[str, list[dict]] = {SECTIONS[role]: [] for role in space.roles}
    skinny_entries: list[dict] = []
    grid_rows: list[dict] = []
    for heads in args.heads:
        bench = benches[heads]
        if space.fp8:
            warmup_fold_gemm(bench.fold.copies[0], GRID_M[-1])  # the informative bf16 fold in the grid
        settle_clocks(dev)
        finished = {role: finish_winners(space, bench, role, best[(heads, role)], log) for role in space.roles}
        skinny_best = {role: search_skinny(bench, role, failed, log, space.skinny_candidates) for role in space.roles}
        rows = []
        for m in GRID_M:
            settle_clocks(dev)
            bucket, tile = bucket_of(m), skinny_block_m(m)
            cfg = finished[fold_role][bucket][0] if bucket is not None else None
            sk = skinny_best[fold_role].get(tile, (None, 0.0))[0] if tile is not None else None
            row = grid_point(
                bench, fold_role, m, cfg, sk, *_q_b_proj_kernels(finished, skinny_best, table, bench.qb.n, m)
            )
            rows.append(row)
            print(
                f"  {fold_role} N={bench.n} M={m}: "
                + " ".join(f"{k}={v:.2f}" for k, v in row.items() if k.endswith("_us") and v)
                + f" (q_b_proj: {row['q_b_proj_kernel']})",
                flush=True,
            )
        grid_rows += rows
        backends, qb_backends, crossover = decide(rows, args.tolerance)
        at = {r["m"]: r for r in rows}
        tiled = {
            m_max: {"m_max": m_max, **asdict(cfg), "triton_us": us, "torch_us": at[m_max]["torch_us"]}
            for m_max, (cfg, us) in finished[fold_role].items()
        }
        entries[space.section].append(
            {
                "n": bench.n,
                "k": K,
                "fold_max_tokens": crossover,
                "heads": heads,
                "bucket": table_buckets(backends, tiled, rows),
            }
        )
        if "q_b_proj" in finished:
            qb_buckets = [
                {
                    "m_max": m_max,
                    "backend": qb_backends[m_max],
                    **asdict(cfg),
                    "triton_us": us,
                    "unfolded_triton_us": at[m_max]["unfolded_triton_us"],
                    "unfolded_cublas_us": at[m_max]["unfolded_cublas_us"],
                }
                for m_max, (cfg, us) in finished["q_b_proj"].items()
            ]
            entries["q_b_proj"].append({"n": bench.qb.n, "k": K, "heads": heads, "bucket": qb_buckets})
        for role, by_m in skinny_best.items():
            for block_m, (cfg, us) in by_m.items():
                skinny_entries.append(
                    {
                        "role": role,
                        "n": bench.weights(role).n,
                        "k": K,
                        "m_max": block_m,
                        "rows": cfg.rows,
                        "block_k": cfg.block_k,
                        "num_warps": cfg.num_warps,
                        "pdl": cfg.pdl,
                        "us": us,
                    }
                )
        print(f"  {fold_role} N={bench.n}: fold_max_tokens={crossover} backends={backends}", flush=True)
        meta = {
            "gpu": key,
            "device_name": torch.cuda.get_device_name(dev),
            f"{space.prefix}commit": source_commit(),
            f"{space.prefix}date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
            f"{space.prefix}torch": torch.__version__,
            f"{space.prefix}triton": triton.__version__,
            f"{space.prefix}python": platform.python_version(),
            f"{space.prefix}copy_bandwidth_tb_s": round(bandwidth / 1e12, 4),
            f"{space.prefix}tuned_heads": ",".join(str(h) for h in args.heads[: args.heads.index(heads) + 1]),
            f"{space.prefix}baseline": "unfolded = fastest of cuBLAS, the tiled and the skinny Triton q_b_proj "
            "kernel, + W_UK bmm, no RoPE",
            f"{space.prefix}route_tolerance": args.tolerance,
            f"{space.prefix}grid_rounds": GRID_ROUNDS,
            "triton_max_m": TRITON_MAX_M,
        }
        write(args, key, base, meta, entries, skinny_entries, log, grid_rows, space)
    print(f"done in {time.monotonic() - start:.0f} s; {len(log)} configs timed", flush=True)
    return 0


def write(
    args: argparse.Namespace,
    key: str,
    base: dict | None,
    meta: dict,
    entries: dict[str, list[dict]],
    skinny_entries: list[dict],
    log: list[dict],
    grid_rows: list[dict],
    space: SearchSpace,
) -> None:
    """``<key>.toml``: the base with the tuned entries merged in; ``tune_<key>.json``: ``--base-json``
    with this dtype's records of the tuned shapes replaced. Never a table the dispatcher rejects."""
    doc_base = base or {}
    sections = {s: merge(doc_base.get(s, []), entries.get(s, [])) for s in ("shape", "q_b_proj", "fp8_shape")}
    tuned = {(e["role"], e["n"]) for e in skinny_entries}
    skinny = [s for s in doc_base.get("skinny", []) if (s["role"], s["n"]) not in tuned] + skinny_entries
    skinny.sort(key=lambda s: (s["role"], s["n"], s["m_max"]))
    full_meta = {**doc_base.get("meta", {}), **meta}
    text = toml_text(full_meta, sections["shape"], sections["q_b_proj"], skinny, sections["fp8_shape"])
    parse_table(tomllib.loads(text), "the written table")
    (args.out / f"{key}.toml").write_text(text, encoding="utf-8")
    doc = json.loads(args.base_json.read_text(encoding="utf-8")) if args.base_json is not None else {"meta": {}}
    doc.setdefault("meta", {}).update(meta)
    tuned_ns = {r["n"] for r in log} | {r["n"] for r in grid_rows}
    for name, records in (("search", log), ("grid", grid_rows)):
        kept = [r for r in doc.get(f"{space.prefix}{name}", []) if r["n"] not in tuned_ns]
        doc[f"{space.prefix}{name}"] = kept + records
    (args.out / f"tune_{key}.json").write_text(json.dumps(doc, indent=1), encoding="utf-8")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=sorted(SPACES), default="bf16", help="the fold weight dtype to tune")
    parser.add_argument("--out", type=Path, required=True, help="folder for tune_<gpu>.json and <gpu>.toml")
    parser.add_argument("--budget-s", type=float, default=330.0, help="time for the tiled search, all shapes")
    parser.add_argument("--workers", type=int, default=14, help="parallel compile processes")
    parser.add_argument(
        "--heads",
        type=parse_heads,
        default=HEADS,
        help="heads per rank of the deployments to tune, comma-separated (default: all); others kept from --base",
    )
    parser.add_argument(
        "--base",
        type=Path,
        help="table to keep untuned entries from and seed the search with "
        "(default: the shipped configs/<gpu>.toml, if any)",
    )
    parser.add_argument("--base-json", type=Path, help="tune_<gpu>.json whose records of the kept shapes to carry over")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=ROUTE_TOLERANCE,
        help="the fold may be this much slower (unfolded/fold ratio) at a point below the crossover; 1.0: never",
    )
    parser.add_argument(
        "--redecide",
        action="store_true",
        help="no GPU: recompute the thresholds of --base from the grid in --base-json and write both to --out",
    )
    args = parser.parse_args(argv)
    if not 0 < args.tolerance <= 1:
        parser.error("--tolerance must be in (0, 1]")
    if args.redecide:
        if args.base is None or args.base_json is None:
            parser.error("--redecide needs --base and --base-json")
        return redecide(args.base, args.base_json, args.out, args.tolerance)
    return run(args, SPACES[args.dtype])
