"""What differs between the tuner's searches: one ``SearchSpace`` per weight dtype (``bf16.BF16``,
``fp8.FP8``); the loop that walks any of them is ``search`` / ``cli``."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

from foldckpt.runtime.kernels.tuning import KernelConfig, SkinnyConfig


@dataclass(frozen=True)
class SearchSpace:
    """The configs worth timing for one fold weight dtype, and the table entries its search owns."""

    # ``--dtype`` name.
    name: str
    # The weights searched per deployment, the fold's first: "fold" (bf16) and "q_b_proj" (the
    # unfolded baseline's tiled kernel), or "fold_fp8" alone (its baseline reads the bf16 table's).
    roles: tuple[str, ...]
    # The table section of the fold's entries ("shape" or "fp8_shape") and the [[skinny]] roles owned.
    section: str
    # Compile-time tiled configs at a tile height.
    candidates: Callable[[int], Iterator[KernelConfig]]
    # Run-time variants of a compiled config (base, n, m, role): rows per program and splits of K.
    launch_variants: Callable[[KernelConfig, int, int, str], list[KernelConfig]]
    # Skinny-kernel configs at a token tile.
    skinny_candidates: Callable[[int], Iterator[SkinnyConfig]]
    # A bucket winner's flag variants timed against each other (its own flags first).
    flag_variants: Callable[[KernelConfig], list[KernelConfig]]
    # A base table's config as the search's first candidate: flags reset to the search's defaults.
    plain: Callable[[KernelConfig], KernelConfig]
    # Compile jobs for the tiled candidates of the shapes' row counts (``search.precompile``).
    compile_jobs: Callable[[list[KernelConfig], list[int]], list[tuple]]
    # Share of the search budget per bucket.
    bucket_shares: Mapping[int, float]
    # Prefix of this search's keys in the table's [meta] and the tune JSON ("" or "fp8_").
    prefix: str

    @property
    def fp8(self) -> bool:
        return self.name == "fp8"
