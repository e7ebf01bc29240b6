#!/usr/bin/env python3
"""Write a synthetic MLA checkpoint (exact tensor names and layouts of the real models)."""

from __future__ import annotations

from pathlib import Path

import click
import torch

from foldckpt.synthetic import FAMILIES, make_checkpoint


@click.command()
@click.argument("out_dir", type=click.Path(file_okay=False, path_type=Path))
@click.option("--family", type=click.Choice(FAMILIES), default="kimi_k3", show_default=True)
@click.option("--layers", type=int, default=None, help="Main decoder layers (default: 6 for Kimi-K3, 2 otherwise).")
@click.option("--mtp-layers", type=int, default=None, help="MTP layers (default: 1 for Kimi-K3, 0 otherwise).")
@click.option("--shards", type=int, default=3, show_default=True, help="Number of safetensors shards.")
@click.option("--full-geometry", is_flag=True, help="Kimi-K3's real attention shapes, attention tensors only.")
@click.option("--dtype", type=click.Choice(["bfloat16", "float32"]), default="bfloat16", show_default=True)
@click.option("--seed", type=int, default=0, show_default=True)
def main(out_dir: Path, family: str, layers: int | None, mtp_layers: int | None, shards: int,
         full_geometry: bool, dtype: str, seed: int) -> None:  # fmt: skip
    path = make_checkpoint(
        out_dir, family, layers, mtp_layers, shards, full_geometry, seed, getattr(torch, dtype)
    )
    total = sum(p.stat().st_size for p in path.iterdir())
    click.echo(f"wrote {family} checkpoint to {path} ({total / 1e6:.1f} MB)")


if __name__ == "__main__":
    main()
