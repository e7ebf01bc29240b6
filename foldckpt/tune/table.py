"""Reading a base table for the tuner and writing the tuned one (``tuning.parse_table``'s layout,
``runtime/kernels/configs/README.md``): merging a search's entries into the base, and re-deciding
thresholds from recorded measurements (``--redecide``, no GPU)."""

from __future__ import annotations

import datetime
import json
import tomllib
from collections.abc import Iterable
from pathlib import Path

from foldckpt.runtime.kernels.tuning import KernelConfig
from foldckpt.tune.search import BUCKETS, K, decide, table_buckets

__all__ = ["base_seeds", "merge", "redecide", "toml_text"]


def base_seeds(base: dict | None, section: str, n: int) -> dict[int, KernelConfig]:
    """The base table's config per bucket for weight rows ``n`` in ``section`` (the search's first candidate)."""
    fields = set(KernelConfig.__dataclass_fields__)
    for entry in (base or {}).get(section, []):
        if entry["n"] == n and entry.get("k") == K:
            return {b["m_max"]: KernelConfig(**{k: v for k, v in b.items() if k in fields}) for b in entry["bucket"]}
    return {}


def merge(kept: Iterable[dict], tuned: list[dict], key: str = "n") -> list[dict]:
    """``kept`` entries whose ``key`` no ``tuned`` entry has, plus ``tuned``, ascending ``key``."""
    replaced = {e[key] for e in tuned}
    return sorted([e for e in kept if e[key] not in replaced] + tuned, key=lambda e: e[key])


def redecide(base_path: Path, json_path: Path, out: Path, tolerance: float) -> int:
    """Recompute ``fold_max_tokens`` and the bucket backends of a table from the grid measurements
    in its tune JSON (no GPU): to apply another ``--tolerance`` to measurements already taken.
    Shapes whose grid rows predate the q_b_proj baseline (no ``unfolded_us`` per kernel) stay."""
    base = tomllib.loads(base_path.read_text(encoding="utf-8"))
    doc = json.loads(json_path.read_text(encoding="utf-8"))
    meta = dict(base["meta"])
    shapes = [dict(sh) for sh in base["shape"]]
    q_b_projs = [dict(q) for q in base.get("q_b_proj", [])]
    for shape in shapes:
        rows = sorted((r for r in doc["grid"] if r["n"] == shape["n"] and "q_b_proj_kernel" in r), key=lambda r: r["m"])
        if not rows:
            continue
        backends, qb_backends, crossover = decide(rows, tolerance)
        print(
            f"N={shape['n']}: fold_max_tokens {shape['fold_max_tokens']} -> {crossover} (tolerance {tolerance}); "
            f"fold backends {backends}"
        )
        shape["fold_max_tokens"] = crossover
        # Sub-buckets of an earlier decision are rebuilt from the BUCKETS buckets they split.
        tiled = {b["m_max"]: b for b in shape["bucket"] if b["m_max"] in BUCKETS}
        shape["bucket"] = table_buckets(backends, tiled, rows)
        for q in q_b_projs:
            if q.get("heads") == shape.get("heads"):
                q["bucket"] = [{**b, "backend": qb_backends[b["m_max"]]} for b in q["bucket"]]
    fp8_shapes = [dict(sh) for sh in base.get("fp8_shape", [])]
    for shape in fp8_shapes:
        rows = sorted((r for r in doc.get("fp8_grid", []) if r["n"] == shape["n"]), key=lambda r: r["m"])
        if rows:
            backends, _, crossover = decide(rows, tolerance)
            print(f"fp8 N={shape['n']}: fold_max_tokens {shape['fold_max_tokens']} -> {crossover}; backends {backends}")
            shape["fold_max_tokens"] = crossover
            tiled = {b["m_max"]: b for b in shape["bucket"] if b["m_max"] in BUCKETS}
            shape["bucket"] = table_buckets(backends, tiled, rows)
    meta["route_tolerance"] = tolerance
    meta["redecided"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    out.mkdir(parents=True, exist_ok=True)
    (out / base_path.name).write_text(
        toml_text(meta, shapes, q_b_projs, base.get("skinny", []), fp8_shapes), encoding="utf-8"
    )
    doc["meta"]["route_tolerance"] = tolerance
    (out / json_path.name).write_text(json.dumps(doc, indent=1), encoding="utf-8")
    return 0


def toml_text(
    meta: dict,
    shapes: list[dict],
    q_b_projs: list[dict],
    skinny: list[dict] | None = None,
    fp8_shapes: list[dict] | None = None,
) -> str:
    """The table in the layout ``tuning.parse_table`` reads (tomllib cannot write)."""

    def value(v: object) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, float):
            return f"{v:.3f}"
        return json.dumps(v)

    lines = [
        f"# Written by `python -m foldckpt.tune` on {meta['device_name']}; do not edit by hand.",
        "",
        "[meta]",
    ]
    lines += [f"{k} = {value(v)}" for k, v in meta.items()]
    for section, entries, keys in (
        ("shape", shapes, ("n", "k", "fold_max_tokens", "heads")),
        ("q_b_proj", q_b_projs, ("n", "k", "heads")),
        ("fp8_shape", fp8_shapes or [], ("n", "k", "fold_max_tokens", "heads")),
    ):
        for entry in entries:
            lines += ["", f"[[{section}]]"] + [f"{k} = {value(entry[k])}" for k in keys if k in entry]
            for bucket in entry["bucket"]:
                lines += ["", f"[[{section}.bucket]]"] + [f"{k} = {value(v)}" for k, v in bucket.items()]
    for entry in skinny or []:
        lines += ["", "[[skinny]]"] + [f"{k} = {value(v)}" for k, v in entry.items()]
    return "\n".join(lines) + "\n"
