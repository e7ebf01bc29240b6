#!/usr/bin/env python3
"""Decode-query accuracy of the folded (bf16, fp8) and unfolded (bf16, MXFP4 W_UK) MLA paths.

Issue #15 asks whether an fp8 fold (half the extra memory of the bf16 fold) is accurate enough to
serve, which scale granularity it needs, and how it compares with what is served today: the
unfolded bf16 path, and the unfolded path with W_UK in MXFP4 (aiter's ``batched_gemm_a16wfp4``).
On full-geometry Kimi-K3 weights (H 96, Lq 1536, L 512, P 128, R 64, V 128) this measures, per
path, the relative Frobenius error and the max abs error of the decode query pieces

    ql_nope [T, H, L] = per head (x · W_qb_nope[h]ᵀ) · W_UK[h]        q_pe [T, H, R] = x · W_qb_pe[h]ᵀ

against an fp64 reference computed from the same bf16 weights and bf16 activations (plain einsum,
independent of foldckpt), so every error is the path's own compute error. GPU kernels are emulated
on the CPU: operands keep their stored values, products are accumulated in fp32, outputs are
rounded to bf16. Two weight sets: Gaussian (std 1/sqrt(fan_in)) and a heavy-tailed one (Student-t
entries, lognormal row scales, a few x10 outlier columns), since real checkpoints are not Gaussian.
The fp8 variants beyond the library's per-row fold (per 128-column block scales; e4m3 activations
per token) and the MXFP4 emulation are candidates, so they live here, not in foldckpt.
Writes docs/bench/accuracy.json.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import click
import torch
from bench_machine import machine

from foldckpt import __version__
from foldckpt.fold import fold_layer, fold_layer_fp8, quantize_fp8_rows
from foldckpt.model.geometry import Geometry, MLALayer

K3 = Geometry(
    "kimi_k3",
    "KimiK3ForConditionalGeneration",
    num_heads=96,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    layers=(MLALayer(0, "language_model.model.layers.0"),),
    uses_rope=False,
)

# OCP MX: 32 elements share one e8m0 (power of two) scale; e2m1's largest normal exponent is 2.
MX_BLOCK = 32
E2M1_EMAX = 2
# e2m1 magnitudes by code (3 bits: 2 exponent, 1 mantissa); an even code has mantissa bit 0.
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])

FP8_COLUMN_BLOCK = 128
# (ql_nope [T, H, L], q_pe [T, H, R])
Pieces = tuple[torch.Tensor, torch.Tensor]
# A finer granularity "pays" when it lowers the ql_nope error by at least this factor on some weight set.
PAYS_FACTOR = 0.8

WEIGHT_SETS = {
    "gaussian": "N(0, 1/fan_in) entries, rounded to bf16",
    "heavy_tailed": "Student-t (4 dof, unit variance) entries x lognormal(0, 0.5) per-row scale x10 on 8 random "
    "input columns (q_b_proj: Lq channels, kv_b_proj: L channels), / sqrt(fan_in), rounded to bf16",
}

PATHS = {
    "fold_bf16": "foldckpt.fold.fold_layer(bf16); y = x·W_foldᵀ, fp32 accumulation, bf16 output",
    "fold_fp8_row": "foldckpt.fold.fold_layer_fp8 (e4m3, fp32 scale per row); y = (x·valuesᵀ in fp32)·scale, "
    "bf16 output; activations bf16",
    "fold_fp8_block128": "e4m3 fold with an fp32 scale per (row, 128-column block), same rounding rule; "
    "activations bf16",
    "fold_fp8_row_w8a8": "per-row e4m3 fold and x quantized to e4m3 per token (same rule); "
    "y = (x_q·valuesᵀ in fp32)·s_x·s_w, bf16 output",
    "unfolded_bf16": "q = x·q_b_projᵀ (bf16 out); ql_nope = per-head bmm q_nope·W_UK (bf16 weights, fp32 acc, "
    "bf16 out); q_pe = rope part of q (what vLLM serves)",
    "unfolded_mxfp4_wuk": "as unfolded_bf16 with W_UK in MXFP4: 32-element blocks along P (the reduction), "
    "e8m0 scale 2^(floor(log2 amax) - 2), e2m1 elements (RNE, saturating); q_b_proj bf16",
}


def e2m1_round(v: torch.Tensor) -> torch.Tensor:
    """Nearest FP4 e2m1 value of each element (ties to the even code, |v| > 6 saturates to 6), fp32."""
    grid = E2M1_GRID.to(v.device)
    a = v.abs().to(torch.float32).clamp(max=6.0).contiguous()
    upper = torch.searchsorted(grid, a).clamp(1, grid.numel() - 1)  # grid[upper-1] < a <= grid[upper]
    lower = upper - 1
    to_lower = a - grid[lower]
    to_upper = grid[upper] - a
    pick_upper = (to_upper < to_lower) | ((to_upper == to_lower) & (upper % 2 == 0))
    return torch.copysign(grid[torch.where(pick_upper, upper, lower)], v.to(torch.float32))


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 along the last dim: e2m1 element values (as fp32) and one power-of-two fp32 scale per 32.

    ``scale = 2^(floor(log2(amax)) - 2)`` clamped to e8m0's range (an all-zero block gets 2^0).
    """
    *lead, k = w.shape
    blocks = w.to(torch.float32).reshape(*lead, k // MX_BLOCK, MX_BLOCK)
    amax = blocks.abs().amax(dim=-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - E2M1_EMAX, torch.zeros_like(amax))
    scale = torch.exp2(exponent.clamp(-127, 127))
    elements = e2m1_round(blocks / scale.unsqueeze(-1))
    return elements.reshape(*lead, k), scale


def dequantize_mxfp4(elements: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    *lead, k = elements.shape
    return (elements.reshape(*lead, k // MX_BLOCK, MX_BLOCK) * scale.unsqueeze(-1)).reshape(*lead, k)


def quantize_fp8_row_blocks(exact: torch.Tensor, block: int = FP8_COLUMN_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values ``[rows, cols]`` and an fp32 scale per (row, ``block`` columns) ``[rows, cols/block]``,
    each block quantized by :func:`foldckpt.fold.quantize_fp8_rows`'s rule (scale = amax/448)."""
    rows, cols = exact.shape
    values, scale = quantize_fp8_rows(exact.reshape(rows, cols // block, block))
    return values.reshape(rows, cols), scale


def dequantize_fp8_row_blocks(values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, cols = values.shape
    blocks = values.to(torch.float32).reshape(rows, scale.shape[1], -1) * scale.unsqueeze(-1)
    return blocks.reshape(rows, cols)


def fp8_w8a8_matmul(x: torch.Tensor, values: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x · Wᵀ`` with x quantized to e4m3 per token and W given as per-row e4m3 + scale; fp32 result."""
    x_values, x_scale = quantize_fp8_rows(x)
    acc = x_values.to(torch.float32) @ values.to(torch.float32).T
    return acc * x_scale.unsqueeze(1) * scale.unsqueeze(0)


def _check_emulations() -> None:
    """Hand-computed values: a wrong e2m1 grid, tie rule or e8m0 exponent fails here, before any number."""
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.25, -2.5, 0.3, 2.6])
    assert e2m1_round(ties).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -0.0, -2.0, 0.5, 3.0]
    blocks = torch.zeros(3, MX_BLOCK)
    blocks[0, :4] = torch.tensor([0.75, 0.1, -0.3, 0.05])  # amax 0.75: floor(log2) = -1, scale 2^-3
    blocks[1, :2] = torch.tensor([4.0, -1.2])  # amax a power of two: 2^(2-2) = 1
    blocks[2, :2] = torch.tensor([7.9, 0.9])  # floor(log2 7.9) = 2: scale 1, 7.9 saturates to 6
    elements, scale = quantize_mxfp4(blocks.reshape(-1))
    assert scale.tolist() == [0.125, 1.0, 1.0]
    # /scale: 6, 0.8 -> 1, -2.4 -> -2, 0.4 -> 0.5 | 4, -1.2 -> -1 | 7.9 -> 6, 0.9 -> 1
    assert elements.reshape(3, MX_BLOCK)[:, :4].tolist() == [
        [6.0, 1.0, -2.0, 0.5],
        [4.0, -1.0, 0.0, 0.0],
        [6.0, 1.0, 0.0, 0.0],
    ]
    assert dequantize_mxfp4(elements, scale)[:4].tolist() == [0.75, 0.125, -0.25, 0.0625]


def _weights(kind: str, g: Geometry, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)

    def draw(rows: int, cols: int) -> torch.Tensor:
        if kind == "gaussian":
            return torch.randn(rows, cols, generator=generator) / cols**0.5
        dof = 4
        chi2 = torch.randn(dof, rows, cols, generator=generator).square().sum(dim=0)
        t = torch.randn(rows, cols, generator=generator) / (chi2 / dof).sqrt() / (dof / (dof - 2)) ** 0.5
        row_scale = torch.exp(0.5 * torch.randn(rows, 1, generator=generator))
        column_scale = torch.ones(cols)
        column_scale[torch.randperm(cols, generator=generator)[:8]] = 10.0
        return t * row_scale * column_scale / cols**0.5

    return draw(*g.q_b_proj_shape).to(torch.bfloat16), draw(*g.kv_b_proj_shape).to(torch.bfloat16)


def _activations(g: Geometry, tokens: int, seed: int) -> torch.Tensor:
    """RMS-normalised q_c rows in bf16, as q_a_layernorm outputs them (unit gain)."""
    raw = torch.randn(tokens, g.q_lora_rank, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    return (raw / raw.square().mean(dim=1, keepdim=True).sqrt()).to(torch.bfloat16)


def _reference(x: torch.Tensor, q_b: torch.Tensor, kv_b: torch.Tensor, g: Geometry) -> Pieces:
    """fp64 ``(ql_nope [T, H, L], q_pe [T, H, R])`` straight from the per-head formula."""
    p, r, v = g.qk_nope_head_dim, g.qk_rope_head_dim, g.v_head_dim
    w_qb = q_b.to(torch.float64).reshape(g.num_heads, p + r, g.q_lora_rank)
    w_uk = kv_b.to(torch.float64).reshape(g.num_heads, p + v, g.kv_lora_rank)[:, :p]  # [H, P, L]
    q = torch.einsum("tk,hdk->thd", x.to(torch.float64), w_qb)
    return torch.einsum("thp,hpl->thl", q[..., :p], w_uk), q[..., p:]


def _split_fold_output(y: torch.Tensor, g: Geometry) -> Pieces:
    heads = y.to(torch.bfloat16).reshape(y.shape[0], g.num_heads, g.fold_head_dim)
    return heads[..., : g.kv_lora_rank], heads[..., g.kv_lora_rank :]


def _unfolded(x: torch.Tensor, q_b: torch.Tensor, w_uk: torch.Tensor, g: Geometry) -> Pieces:
    """vLLM's decode: q = x·q_b_projᵀ (bf16), then per head bmm of q_nope with ``w_uk`` [H, P, L] (fp32 values)."""
    p = g.qk_nope_head_dim
    q = (x.to(torch.float32) @ q_b.to(torch.float32).T).to(torch.bfloat16)
    q = q.reshape(x.shape[0], g.num_heads, -1)
    ql_nope = torch.bmm(q[..., :p].transpose(0, 1).to(torch.float32), w_uk).to(torch.bfloat16)
    return ql_nope.transpose(0, 1), q[..., p:]


def _paths(q_b: torch.Tensor, kv_b: torch.Tensor, g: Geometry) -> dict[str, Callable[[torch.Tensor], Pieces]]:
    """Each path's stored operands, prepared once per weight set; the callables compute the query pieces."""
    p, v = g.qk_nope_head_dim, g.v_head_dim
    w_fold = fold_layer(q_b, kv_b, g, torch.bfloat16).to(torch.float32)
    fp8_values, fp8_scale = fold_layer_fp8(q_b, kv_b, g)
    fp8_values_f32 = fp8_values.to(torch.float32)
    exact = fold_layer(q_b, kv_b, g, torch.float32)
    # values x block scale costs one fp32 rounding (2^-24 relative), so one fp32 GEMM on it matches a kernel
    # that scales each block's fp32 partial sum far below the e4m3 error being measured.
    w_block = dequantize_fp8_row_blocks(*quantize_fp8_row_blocks(exact))
    del exact
    w_uk = kv_b.reshape(g.num_heads, p + v, g.kv_lora_rank)[:, :p].to(torch.float32)  # [H, P, L]
    # aiter's weight is [B, N, K] = [H, L, P]: MX blocks run along K = P, the bmm's reduction.
    w_uk_mx = dequantize_mxfp4(*quantize_mxfp4(w_uk.transpose(1, 2))).transpose(1, 2).contiguous()

    def f32(x: torch.Tensor) -> torch.Tensor:
        return x.to(torch.float32)

    return {
        "fold_bf16": lambda x: _split_fold_output(f32(x) @ w_fold.T, g),
        "fold_fp8_row": lambda x: _split_fold_output((f32(x) @ fp8_values_f32.T) * fp8_scale, g),
        "fold_fp8_block128": lambda x: _split_fold_output(f32(x) @ w_block.T, g),
        "fold_fp8_row_w8a8": lambda x: _split_fold_output(fp8_w8a8_matmul(x, fp8_values, fp8_scale), g),
        "unfolded_bf16": lambda x: _unfolded(x, q_b, w_uk, g),
        "unfolded_mxfp4_wuk": lambda x: _unfolded(x, q_b, w_uk_mx, g),
    }


def _errors(got: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    diff = got.to(torch.float64) - ref
    return (diff.norm() / ref.norm()).item(), diff.abs().max().item()


def _summary(values: list[float]) -> dict[str, float]:
    return {"mean": sum(values) / len(values), "worst": max(values)}


def _measure(kind: str, g: Geometry, tokens: int, seeds: tuple[int, ...], weight_seed: int) -> dict[str, object]:
    q_b, kv_b = _weights(kind, g, weight_seed)
    paths = _paths(q_b, kv_b, g)
    samples: dict[str, dict[str, list[float]]] = {
        name: {"ql_nope_rel_err": [], "q_pe_rel_err": [], "ql_nope_max_abs": [], "q_pe_max_abs": []} for name in paths
    }
    ref_abs_max = {"ql_nope": 0.0, "q_pe": 0.0}
    for seed in seeds:
        x = _activations(g, tokens, seed)
        ref_nope, ref_pe = _reference(x, q_b, kv_b, g)
        ref_abs_max = {
            "ql_nope": max(ref_abs_max["ql_nope"], ref_nope.abs().max().item()),
            "q_pe": max(ref_abs_max["q_pe"], ref_pe.abs().max().item()),
        }
        for name, compute in paths.items():
            ql_nope, q_pe = compute(x)
            for piece, got, ref in (("ql_nope", ql_nope, ref_nope), ("q_pe", q_pe, ref_pe)):
                rel, max_abs = _errors(got, ref)
                samples[name][f"{piece}_rel_err"].append(rel)
                samples[name][f"{piece}_max_abs"].append(max_abs)
    return {
        "paths": {name: {k: _summary(v) for k, v in stats.items()} for name, stats in samples.items()},
        "reference_abs_max": ref_abs_max,
    }


def _bytes_per_layer(g: Geometry) -> dict[str, int]:
    rows, cols = g.fold_shape
    w_uk_elements = g.num_heads * g.qk_nope_head_dim * g.kv_lora_rank
    return {
        "fold_bf16": rows * cols * 2,
        "fold_fp8_row": rows * cols + rows * 4,
        "fold_fp8_block128": rows * cols + rows * (cols // FP8_COLUMN_BLOCK) * 4,
        "q_b_proj_bf16": g.q_b_proj_shape[0] * g.q_b_proj_shape[1] * 2,
        "w_uk_bf16": w_uk_elements * 2,
        "w_uk_mxfp4": w_uk_elements // 2 + w_uk_elements // MX_BLOCK,
    }


def _conclusion(results: dict[str, dict], sizes: dict[str, int]) -> dict[str, object]:
    def err(kind: str, path: str) -> float:
        return results[kind]["paths"][path]["ql_nope_rel_err"]["mean"]

    kinds = list(results)
    block_ratio = {k: err(k, "fold_fp8_block128") / err(k, "fold_fp8_row") for k in kinds}
    w8a8_ratio = {k: err(k, "fold_fp8_row_w8a8") / err(k, "fold_fp8_row") for k in kinds}
    fp8_vs_mx = {k: err(k, "fold_fp8_row") / err(k, "unfolded_mxfp4_wuk") for k in kinds}
    bf16_vs_unfolded = {k: err(k, "fold_bf16") / err(k, "unfolded_bf16") for k in kinds}
    fp8_vs_served = {k: err(k, "fold_fp8_row") / err(k, "unfolded_bf16") for k in kinds}
    fp8_beats_mx = all(r < 1 for r in fp8_vs_mx.values())
    block_pays = any(r <= PAYS_FACTOR for r in block_ratio.values())
    memory_ratio = sizes["fold_fp8_row"] / sizes["fold_bf16"]
    return {
        "rule": f"ratios of mean ql_nope relative error; a finer granularity pays if its ratio <= {PAYS_FACTOR} "
        "on some weight set",
        "fold_bf16_over_unfolded_bf16": bf16_vs_unfolded,
        "fold_fp8_row_over_unfolded_mxfp4_wuk": fp8_vs_mx,
        "fp8_row_beats_mxfp4_wuk": fp8_beats_mx,
        "fold_fp8_row_over_unfolded_bf16": fp8_vs_served,
        "fold_fp8_block128_over_fold_fp8_row": block_ratio,
        "fp8_block128_scales_pay": block_pays,
        "fold_fp8_row_w8a8_over_fold_fp8_row": w8a8_ratio,
        "fp8_fold_bytes_over_bf16_fold_bytes": memory_ratio,
        "summary": (
            f"fp8 per-row fold uses {memory_ratio:.3f}x the bf16 fold's bytes; its ql_nope error is "
            + ", ".join(f"{r:.1f}x ({k})" for k, r in fp8_vs_served.items())
            + " the served bf16 path's and "
            + ", ".join(f"{r:.2f}x ({k})" for k, r in fp8_vs_mx.items())
            + f" the MXFP4-W_UK path's, so it {'beats' if fp8_beats_mx else 'does not beat'} MXFP4; "
            + "per-128-block scales change the error by "
            + ", ".join(f"{r:.3f}x ({k})" for k, r in block_ratio.items())
            + f": they {'pay' if block_pays else 'do not pay'}; e4m3 activations (w8a8) cost "
            + ", ".join(f"{r:.2f}x ({k})" for k, r in w8a8_ratio.items())
            + " the weight-only error."
        ),
    }


@click.command()
@click.option("--tokens", type=int, default=64, show_default=True, help="Tokens per activation seed.")
@click.option("--seeds", type=int, default=4, show_default=True, help="Activation seeds per weight set.")
@click.option(
    "--heads",
    type=int,
    default=K3.num_heads,
    show_default=True,
    help="Heads to measure (96 = full Kimi-K3; 12 = one TP8 rank).",
)
@click.option("--out", type=click.Path(path_type=Path), default=Path("docs/bench/accuracy.json"), show_default=True)
def main(tokens: int, seeds: int, heads: int, out: Path) -> None:
    _check_emulations()
    g = replace(K3, num_heads=heads)
    started = time.perf_counter()
    seed_list = tuple(range(seeds))
    results = {}
    for weight_seed, kind in enumerate(WEIGHT_SETS):
        results[kind] = _measure(kind, g, tokens, seed_list, weight_seed)
        for name, stats in results[kind]["paths"].items():
            click.echo(
                f"{kind:>12}  {name:<20}  ql_nope {stats['ql_nope_rel_err']['mean']:.5f} "
                f"(worst {stats['ql_nope_rel_err']['worst']:.5f})  q_pe {stats['q_pe_rel_err']['mean']:.5f} "
                f"(worst {stats['q_pe_rel_err']['worst']:.5f})"
            )
    sizes = _bytes_per_layer(g)
    report = {
        "benchmark": "accuracy",
        "tool_version": __version__,
        "machine": machine(),
        "seconds": time.perf_counter() - started,
        "geometry": {
            "num_heads": g.num_heads,
            "q_lora_rank": g.q_lora_rank,
            "kv_lora_rank": g.kv_lora_rank,
            "qk_nope_head_dim": g.qk_nope_head_dim,
            "qk_rope_head_dim": g.qk_rope_head_dim,
            "v_head_dim": g.v_head_dim,
        },
        "tokens": tokens,
        "activation_seeds": list(seed_list),
        "activations": "N(0,1) rows RMS-normalised to 1 (q_a_layernorm with unit gain), rounded to bf16",
        "weight_sets": WEIGHT_SETS,
        "reference": "fp64 einsum on float64 copies of the bf16 weights and bf16 activations (not foldckpt)",
        "metrics": "rel_err = ||got - ref||_F / ||ref||_F, max_abs = max |got - ref|; mean and worst over seeds",
        "paths": PATHS,
        "results": results,
        "bytes_per_layer": sizes,
        "conclusion": _conclusion(results, sizes),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    click.echo(report["conclusion"]["summary"])
    click.echo(f"wrote {out}")


if __name__ == "__main__":
    main()
