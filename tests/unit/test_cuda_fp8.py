"""The fp8 fold's Hopper kernel on a machine without a GPU: NVRTC builds every variant the launch
plans pick (the real compiler, from the ``nvidia-cuda-nvrtc`` wheel the test extra installs), ptxas
reports no spill, the cache keeps and refuses entries as it should, the plans cover every row once
within the shared memory, and the host's argument struct is the kernel's. Launches need an sm_90
GPU: tests/gpu/test_fp8_cuda_kernel.py."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from foldckpt.runtime.kernels import cuda_fp8
from foldckpt.runtime.kernels.reference import MlaDims

# H100 and H200: 132 SMs, 227 KB of shared memory per block.
SMS, MAX_SMEM = 132, 232448
SHAPES = (*(MlaDims(h).fold_rows for h in (6, 12, 16, 24, 32)), 1001, 7)
CAPABILITY = (9, 0)


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "foldckpt"


def _variants() -> set[tuple[int, int]]:
    plans = (cuda_fp8.plan(n, m, SMS, MAX_SMEM) for n in SHAPES for m in range(1, cuda_fp8.MAX_M + 1))
    return {p.variant for p in plans if p is not None}


def test_every_planned_variant_builds_without_spills() -> None:
    variants = _variants()
    assert {t for t, _ in variants} == {1, 2, 4}
    for variant in sorted(variants):
        cubin, report = cuda_fp8.build_cubin(variant)
        assert cubin[:4] == b"\x7fELF", variant
        assert "sm_90a" in report and "0 bytes spill stores" in report, (variant, report)


def test_the_host_struct_is_the_kernels() -> None:
    """``_FoldArgs`` is passed by value as ``FoldArgs``: the same fields, in order, of the same sizes."""
    source = cuda_fp8.SOURCE.read_text()
    body = re.search(r"struct FoldArgs \{(.*?)\};", source, re.S).group(1)
    fields = []
    for line in body.splitlines():
        decl = line.split("//")[0].strip().rstrip(";")
        if decl:
            kind, names = re.match(r"(.*?[\s*])(\w+(?:,\s*\w+)*)$", decl).groups()
            fields += [(name.strip(), "*" in kind) for name in names.split(",")]
    host = [(name, kind.__name__ == "c_void_p") for name, kind in cuda_fp8._FoldArgs._fields_]
    assert host == fields


@pytest.mark.parametrize("n", SHAPES)
def test_plans_cover_every_row_once_within_shared_memory(n: int) -> None:
    for m in range(1, cuda_fp8.MAX_M + 1):
        p = cuda_fp8.plan(n, m, SMS, MAX_SMEM)
        if p is None:
            continue
        assert m <= 8 * p.tiles and (p.tiles == 1 or m > 4 * p.tiles), "not the fewest token tiles"
        rows = [n // p.grid + (i < n % p.grid) for i in range(p.grid)]
        assert sum(rows) == n and max(rows) <= 16 * p.groups < max(rows) + 16
        assert p.grid <= SMS and p.smem_bytes <= MAX_SMEM
        assert 1 <= p.slots <= p.groups
        assert p.row_stride % 128 == 64 and p.x_stride % 128 == 16 and p.x_offset % 16 == 0
    assert cuda_fp8.plan(n, cuda_fp8.MAX_M + 1, SMS, MAX_SMEM) is None


def test_the_served_shapes_have_plans_up_to_16_tokens() -> None:
    """Kimi-K3 TP16/8/4 and DeepSeek-V3 TP8: every decode batch up to 16 tokens has a launch."""
    for heads in (6, 12, 24, 16):
        n = MlaDims(heads).fold_rows
        assert all(cuda_fp8.plan(n, m, SMS, MAX_SMEM) for m in range(1, 17)), n


def test_a_cached_cubin_is_reused_and_a_corrupt_one_rebuilt(
    cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    variant = (1, 4)
    first = cuda_fp8.cached_cubin(variant, "cvt", CAPABILITY)
    [entry] = cache.iterdir()
    built = []
    real_build = cuda_fp8.build_cubin
    monkeypatch.setattr(cuda_fp8, "build_cubin", lambda *a, **kw: built.append(a) or real_build(*a, **kw))
    assert cuda_fp8.cached_cubin(variant, "cvt", CAPABILITY) == first and built == [], "not read from the cache"
    raw = bytearray(entry.read_bytes())
    raw[-7] ^= 0x01
    entry.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="vllm.foldckpt"):
        assert cuda_fp8.cached_cubin(variant, "cvt", CAPABILITY) == first
    assert built == [(variant, "cvt")] and "does not match its sha256" in caplog.text
    assert entry.read_bytes() != bytes(raw)


@pytest.mark.parametrize(
    "tamper",
    [
        lambda raw: raw.replace(b'"capability": [9, 0]', b'"capability": [8, 9]'),
        lambda raw: raw.replace(b"\n", b"", 1),
        lambda raw: raw[: raw.index(b"\n") + 1] + raw[raw.index(b"\n") + 1 :][:-1],
        lambda raw: b"\xff" + raw,
        lambda raw: b"[" * 100_000 + b"\n" + raw,
    ],
    ids=["other-key", "no-header", "truncated", "not-utf8", "nested"],
)
def test_an_entry_that_does_not_hold_its_key_and_cubin_is_rebuilt(
    cache: Path, tamper, caplog: pytest.LogCaptureFixture
) -> None:
    good = cuda_fp8.cached_cubin((1, 2), "cvt", CAPABILITY)
    [entry] = cache.iterdir()
    entry.write_bytes(tamper(entry.read_bytes()))
    with caplog.at_level(logging.WARNING, logger="vllm.foldckpt"):
        assert cuda_fp8.cached_cubin((1, 2), "cvt", CAPABILITY) == good
    assert "ignoring the kernel cache" in caplog.text


def test_a_linked_entry_is_never_loaded(cache: Path, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    good = cuda_fp8.cached_cubin((1, 2), "cvt", CAPABILITY)
    [entry] = cache.iterdir()
    elsewhere = tmp_path / "planted"
    elsewhere.write_bytes(entry.read_bytes())
    entry.unlink()
    entry.symlink_to(elsewhere)
    with caplog.at_level(logging.WARNING, logger="vllm.foldckpt"):
        assert cuda_fp8.cached_cubin((1, 2), "cvt", CAPABILITY) == good
    assert "symbolic link" in caplog.text and not entry.is_symlink()
