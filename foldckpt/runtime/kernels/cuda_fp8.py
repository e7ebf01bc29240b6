"""The fp8 fold GEMM's Hopper kernel (``fp8_fold_sm90.cu``): built at first use with NVRTC, cached
per GPU and driver, launched through the CUDA driver API.

Why CUDA C++ here and Triton elsewhere: the fp8 fold streams e4m3 W with nearly no arithmetic, and
what decides its time is how many bytes every SM keeps in flight from its first cycle. The kernel
(its header says how) issues a CTA's whole slice of W as bulk copies before it waits for the
previous kernel, converts e4m3 to fp16 in registers and runs mma.sync; Triton 3.6 lowers the e4m3
operand through shared memory two bytes at a time and cannot issue the copies ahead of the wait.
The measured difference is in docs/bench/decode_<gpu>.json; the tuning tables (``backend = "cuda"``
in an [[fp8_shape]] bucket) decide per GPU and M bucket, and the Triton kernels stay the portable
path (ROCm, other GPUs) and the fallback wherever this one cannot be built or loaded.

Nothing here needs a package beyond torch's own CUDA wheels: NVRTC (``libnvrtc``, which those
wheels bring as ``nvidia-cuda-nvrtc``) and the driver (``libcuda``) are called through ctypes,
as ``torch.cuda._utils`` does. The cubin is cached (``foldckpt.runtime.cache``) under a key of
the source's digest, the build options, the NVRTC and driver versions and the GPU's compute
capability; an entry is loaded only if it carries that key and its cubin's sha256, so a corrupt or
stale entry is rebuilt, never trusted.

The first launch of each variant (token tiles x row groups) builds or reads and loads it, so
``foldckpt.runtime.kernels.warmup_fold_gemm`` launches each before CUDA graph capture; a launch
of a loaded variant does no allocation (given ``out``), no build and no host sync, and records
into a graph being captured.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import hashlib
import json
import logging
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

import foldckpt
from foldckpt.io.files import parse_json
from foldckpt.runtime.cache import CacheDefect, driver_version, entry_path, read_entry, write_entry

__all__ = [
    "CONVERSIONS",
    "FoldPlan",
    "KernelUnavailable",
    "MAX_M",
    "SOURCE",
    "build_cubin",
    "cubin_cache_path",
    "is_loaded",
    "launch",
    "launch_plan",
    "plan",
    "runs_on",
    "supports",
]

logger = logging.getLogger("vllm.foldckpt")

SOURCE = Path(__file__).resolve().with_name("fp8_fold_sm90.cu")
# The tokens one launch serves: token tiles of 8, at most 4 of them (a thread holds 4 fp32
# accumulators per tile and 16-row group: more would spill).
MAX_M = 32
_TILE_COUNTS = (1, 2, 4)
# The reduction length the kernel is compiled for: q_lora_rank, 1536 in every model of the family.
K = 1536
# e4m3 -> fp16 in the kernel: "cvt" (cvt.rn.f16x2.e4m3x2), "bits" (integer moves, the 2^-8 undone
# in the epilogue), "mixed" (one of each per MMA operand); which one the launches use is CONVERSION.
CONVERSIONS = {"cvt": 0, "bits": 1, "mixed": 2}
CONVERSION = "cvt"
_CONSUMER_WARPS = 8
_THREADS = 32 * (_CONSUMER_WARPS + 1)
_MAX_SLOTS = 16
_BARRIER_BYTES = 2 * _MAX_SLOTS * 8
# The largest 16-row group count per CTA (its accumulators stay in registers: ptxas reports no
# spill up to these), for 1-2 token tiles and for 4.
_MAX_GROUPS = 12
_MAX_GROUPS_4_TILES = 7
# A cubin of this kernel is ~30-60 KB; an entry much larger is not one.
_CUBIN_MAX_BYTES = 4 * 1024 * 1024


class KernelUnavailable(RuntimeError):
    """This kernel cannot run here (no NVRTC or driver, another GPU, a failed build or load)."""


@dataclass(frozen=True)
class FoldPlan:
    """How one launch covers an ``n``-row W for ``tiles`` token tiles on a GPU with ``sms`` SMs:
    one CTA per SM, ragged rows, the groups resident at once (``slots``) and the shared memory."""

    n: int
    tiles: int
    grid: int
    groups: int
    slots: int
    row_stride: int
    x_stride: int
    x_offset: int
    smem_bytes: int

    @property
    def variant(self) -> tuple[int, int]:
        """(token tiles, groups): the compile-time constants of the kernel this plan launches."""
        return self.tiles, self.groups


def _round_to_residue(value: int, residue: int, modulus: int = 128) -> int:
    """The smallest v >= value with v % modulus == residue."""
    return value + (residue - value) % modulus


@functools.lru_cache(maxsize=256)
def plan(n: int, m: int, sms: int, max_smem: int) -> FoldPlan | None:
    """The launch of an ``m``-token fold GEMM with an ``n``-row W, or None where this kernel does
    not serve it (more than MAX_M tokens, too many rows per SM for its registers or shared memory).

    Rows are padded in shared memory to 64 bytes past a multiple of 128 (row r and r + 1 of a warp's
    16-byte loads then fall in different banks), x's tokens to 16 past one."""
    if not 1 <= m <= MAX_M or n < 1:
        return None
    tiles = next(t for t in _TILE_COUNTS if m <= 8 * t)
    grid = min(sms, n)
    rows = -(-n // grid)
    groups = -(-rows // 16)
    if groups > (_MAX_GROUPS_4_TILES if tiles == 4 else _MAX_GROUPS):
        return None
    row_stride = _round_to_residue(K, 64)
    x_stride = _round_to_residue(2 * K, 16)
    group_bytes = 16 * row_stride
    partials = _CONSUMER_WARPS * 8 * tiles * (16 * groups + 4) * 4
    x_bytes = 8 * tiles * x_stride + _BARRIER_BYTES
    slots = min(groups, _MAX_SLOTS, (max_smem - x_bytes) // group_bytes)
    if slots < 1 or max(slots * group_bytes, partials) + x_bytes > max_smem:
        return None
    x_offset = max(slots * group_bytes, partials)
    return FoldPlan(n, tiles, grid, groups, slots, row_stride, x_stride, x_offset, x_offset + x_bytes)


# ---- NVRTC and the driver, through ctypes ----------------------------------------------------------


def _load_nvrtc() -> ctypes.CDLL:
    """libnvrtc: the one the process already has (torch's CUDA wheels load it), else the
    ``nvidia-cuda-nvrtc`` wheel's, else the system's. Its builtins library is loaded first from
    the same folder, where NVRTC looks for it by name."""
    major = (torch.version.cuda or "13").split(".")[0]
    folders = []
    try:
        import nvidia  # the namespace package of NVIDIA's CUDA wheels

        for root in nvidia.__path__:
            folders += sorted(Path(root).glob("*/lib"))
    except ImportError:
        pass
    for folder in folders:
        lib = folder / f"libnvrtc.so.{major}"
        if lib.is_file():
            for builtins in sorted(folder.glob("libnvrtc-builtins.so.*")):
                ctypes.CDLL(str(builtins), mode=ctypes.RTLD_GLOBAL)
            return ctypes.CDLL(str(lib))
    for name in (f"libnvrtc.so.{major}", ctypes.util.find_library("nvrtc")):
        if name:
            try:
                return ctypes.CDLL(name)
            except OSError:
                continue
    raise KernelUnavailable("NVRTC (libnvrtc) is not installed")


@functools.cache
def _nvrtc() -> ctypes.CDLL:
    lib = _load_nvrtc()
    lib.nvrtcGetErrorString.restype = ctypes.c_char_p
    return lib


def nvrtc_version() -> str:
    major, minor = ctypes.c_int(), ctypes.c_int()
    _nvrtc().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


def _build_options(variant: tuple[int, int], conversion: str, arch: str) -> list[str]:
    tiles, groups = variant
    return [
        f"--gpu-architecture={arch}",
        "-std=c++17",
        f"-DFOLD_NT={tiles}",
        f"-DFOLD_GROUPS={groups}",
        f"-DFOLD_K={K}",
        f"-DFOLD_CVT={CONVERSIONS[conversion]}",
    ]


def build_cubin(variant: tuple[int, int], conversion: str = CONVERSION, arch: str = "sm_90a") -> tuple[bytes, str]:
    """Compile ``fp8_fold_sm90.cu`` for ``arch`` with NVRTC: (cubin, ptxas's report). Needs no GPU."""
    lib = _nvrtc()
    prog = ctypes.c_void_p()

    def check(rc: int, what: str) -> None:
        if rc != 0:
            raise KernelUnavailable(f"NVRTC {what}: {lib.nvrtcGetErrorString(rc).decode()}")

    options = [o.encode() for o in (*_build_options(variant, conversion, arch), "--ptxas-options=-v")]
    check(lib.nvrtcCreateProgram(ctypes.byref(prog), SOURCE.read_bytes(), SOURCE.name.encode(), 0, None, None), "")
    try:
        rc = lib.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        report = log.value.decode(errors="replace")
        if rc != 0:
            raise KernelUnavailable(f"NVRTC could not compile {SOURCE.name}: {report.strip()}")
        check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
        cubin = ctypes.create_string_buffer(size.value)
        check(lib.nvrtcGetCUBIN(prog, cubin), "cubin")
        return cubin.raw, report
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


@functools.cache
def _driver() -> ctypes.CDLL:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        raise KernelUnavailable(f"the CUDA driver (libcuda.so.1) does not load: {exc}") from exc
    return lib


def _check(rc: int, what: str) -> None:
    if rc != 0:
        text = ctypes.c_char_p()
        _driver().cuGetErrorString(rc, ctypes.byref(text))
        raise KernelUnavailable(f"{what}: CUDA error {rc} ({(text.value or b'?').decode()})")


# ---- the cache ---------------------------------------------------------------------------------------


def _cache_key(variant: tuple[int, int], conversion: str, capability: tuple[int, int]) -> dict:
    """Everything a cached cubin depends on: an entry built under another key is stale."""
    return {
        "kernel": SOURCE.name,
        "source_sha256": hashlib.sha256(SOURCE.read_bytes()).hexdigest(),
        "options": _build_options(variant, conversion, "sm_90a"),
        "capability": list(capability),
        "nvrtc": nvrtc_version(),
        "driver": driver_version(),
        "foldckpt": foldckpt.__version__,
    }


def cubin_cache_path(key: dict) -> Path:
    return entry_path("kernel", key, ".cubin")


def _encode_entry(key: dict, cubin: bytes) -> bytes:
    """An entry: one JSON line (the key and the cubin's sha256), then the cubin."""
    header = {"key": key, "sha256": hashlib.sha256(cubin).hexdigest(), "bytes": len(cubin)}
    return json.dumps(header, sort_keys=True).encode() + b"\n" + cubin


def _decode_entry(raw: bytes, key: dict) -> bytes:
    """The cubin of an entry made under ``key``, or ValueError saying what is wrong with it."""
    line, sep, cubin = raw.partition(b"\n")
    header = parse_json(line.decode("utf-8")) if sep else None
    if not isinstance(header, dict) or header.get("key") != key:
        raise ValueError("built under another key")
    if header.get("bytes") != len(cubin) or header.get("sha256") != hashlib.sha256(cubin).hexdigest():
        raise ValueError("its cubin does not match its sha256")
    return cubin


def cached_cubin(variant: tuple[int, int], conversion: str, capability: tuple[int, int]) -> bytes:
    """The cubin of ``variant``: from the cache when a trusted, matching entry is there, else built
    with NVRTC and written to the cache (a cache that cannot be written only costs the next start
    another build)."""
    key = _cache_key(variant, conversion, capability)
    path = cubin_cache_path(key)
    try:
        raw = read_entry(path, _CUBIN_MAX_BYTES)
        if raw is not None:
            return _decode_entry(raw, key)
    except (CacheDefect, ValueError) as exc:
        logger.warning("foldckpt: ignoring the kernel cache %s (%s); building again", path, exc)
    cubin, _ = build_cubin(variant, conversion)
    try:
        write_entry(path, _encode_entry(key, cubin))
    except CacheDefect as exc:
        logger.warning("foldckpt: cannot write the kernel cache %s (%s); the next start builds again", path, exc)
    return cubin


# ---- loading and launching -----------------------------------------------------------------------------


class _FoldArgs(ctypes.Structure):
    """``FoldArgs`` of fp8_fold_sm90.cu, field for field."""

    _fields_ = [
        ("w", ctypes.c_void_p),
        ("scale", ctypes.c_void_p),
        ("x", ctypes.c_void_p),
        ("y", ctypes.c_void_p),
        ("m", ctypes.c_int),
        ("n", ctypes.c_int),
        ("ldx", ctypes.c_int),
        ("ldy", ctypes.c_int),
        ("row_stride", ctypes.c_int),
        ("x_stride", ctypes.c_int),
        ("slots", ctypes.c_int),
        ("x_offset", ctypes.c_int),
    ]


class _LaunchAttribute(ctypes.Structure):
    # CUlaunchAttribute: an id padded to 8 bytes, then a 64-byte value union.
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_int * 16)]


class _LaunchConfig(ctypes.Structure):
    _fields_ = [
        ("grid", ctypes.c_uint * 3),
        ("block", ctypes.c_uint * 3),
        ("shared_mem_bytes", ctypes.c_uint),
        ("stream", ctypes.c_void_p),
        ("attrs", ctypes.POINTER(_LaunchAttribute)),
        ("num_attrs", ctypes.c_uint),
    ]


_PDL_ATTRIBUTE = 6  # CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION
_MAX_DYNAMIC_SMEM = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES


@dataclass(frozen=True)
class _Device:
    index: int
    sms: int
    max_smem: int
    capability: tuple[int, int]


@functools.cache
def _device(index: int) -> _Device:
    props = torch.cuda.get_device_properties(index)
    optin = ctypes.c_int()
    # CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN = 97
    _check(_driver().cuDeviceGetAttribute(ctypes.byref(optin), 97, index), "cuDeviceGetAttribute")
    return _Device(index, props.multi_processor_count, optin.value, (props.major, props.minor))


_LOCK = threading.Lock()
_FUNCTIONS: dict[tuple[int, tuple[int, int], str], ctypes.c_void_p] = {}


def _function(device: _Device, variant: tuple[int, int], conversion: str) -> ctypes.c_void_p:
    """The loaded kernel of ``variant`` on ``device`` (built or read from the cache once per process)."""
    key = (device.index, variant, conversion)
    with _LOCK:
        if key in _FUNCTIONS:
            return _FUNCTIONS[key]
        cubin = cached_cubin(variant, conversion, device.capability)
        with torch.cuda.device(device.index):
            torch.cuda.current_stream()  # makes the device's primary context current on this thread
            module, func = ctypes.c_void_p(), ctypes.c_void_p()
            _check(_driver().cuModuleLoadData(ctypes.byref(module), cubin), "cuModuleLoadData")
            _check(
                _driver().cuModuleGetFunction(ctypes.byref(func), module, b"foldckpt_fp8_fold"), "cuModuleGetFunction"
            )
            _check(_driver().cuFuncSetAttribute(func, _MAX_DYNAMIC_SMEM, device.max_smem), "cuFuncSetAttribute")
        _FUNCTIONS[key] = func
        return func


def runs_on(device: torch.device) -> bool:
    """Whether this kernel can serve on ``device``: an sm_90 GPU (H100, H200, H800, H20, GH200)
    whose driver and NVRTC load. Building happens at the first launch of each variant."""
    if device.type != "cuda" or torch.version.hip is not None:
        return False
    return _runs_on_index(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _runs_on_index(index: int) -> bool:
    """``runs_on`` per device, asked once: the dispatcher asks on every fp8 decode call."""
    if torch.cuda.get_device_capability(index) != (9, 0):
        return False
    try:
        _driver()
        _nvrtc()
    except KernelUnavailable:
        return False
    return True


def _plan_for(x: torch.Tensor, weight: torch.Tensor) -> tuple[_Device, FoldPlan | None]:
    index = x.device.index if x.device.index is not None else torch.cuda.current_device()
    device = _device(index)
    return device, plan(weight.shape[0], x.shape[0], device.sms, device.max_smem)


def launch_plan(x: torch.Tensor, weight: torch.Tensor) -> FoldPlan | None:
    """The plan a launch with these operands on their GPU takes, or None where there is none."""
    return _plan_for(x, weight)[1]


def is_loaded(x: torch.Tensor, weight: torch.Tensor, conversion: str = CONVERSION) -> bool:
    """Whether the kernel a call with these operands launches is built and loaded (a launch during
    CUDA graph capture must not build: ``fold_gemm``'s warm-up loads every one it will use)."""
    device, fold_plan = _plan_for(x, weight)
    return fold_plan is not None and (device.index, fold_plan.variant, conversion) in _FUNCTIONS


def supports(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None, scale: torch.Tensor) -> bool:
    """Whether ``launch`` takes these operands: bf16 x [M <= MAX_M, K] with 16-byte aligned rows,
    contiguous e4m3 W [N, K] and fp32 scale [N] on the same GPU, out None or bf16 [M, N] with unit
    column stride. K must be the compiled one."""
    return (
        x.dtype == torch.bfloat16
        and 1 <= x.shape[0] <= MAX_M
        and x.shape[1] == K
        and x.stride(1) == 1
        and (x.shape[0] == 1 or x.stride(0) % 8 == 0)
        and x.data_ptr() % 16 == 0
        and weight.is_contiguous()
        and weight.data_ptr() % 16 == 0
        and scale.is_contiguous()
        and (out is None or (out.dtype == torch.bfloat16 and out.stride(1) == 1))
    )


def launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    scale: torch.Tensor,
    out: torch.Tensor | None = None,
    pdl: bool = True,
    conversion: str = CONVERSION,
) -> torch.Tensor:
    """``y = (x · weightᵀ) * scale`` in bf16 (fp32 accumulation, rounded once), written to ``out``
    (may be a strided row view) or a new tensor; operands as ``supports`` says (checked by the
    caller). With ``pdl`` the launch allows programmatic dependent launch: W streams while the
    previous kernel drains. Raises KernelUnavailable where no plan or no loaded kernel exists."""
    device, fold_plan = _plan_for(x, weight)
    if fold_plan is None:
        raise KernelUnavailable(f"no launch plan for M={x.shape[0]}, N={weight.shape[0]}")
    func = _function(device, fold_plan.variant, conversion)
    m, n = x.shape[0], weight.shape[0]
    y = out if out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    args = _FoldArgs(
        weight.data_ptr(),
        scale.data_ptr(),
        x.data_ptr(),
        y.data_ptr(),
        m,
        n,
        x.stride(0) if m > 1 else K,
        y.stride(0) if m > 1 else n,
        fold_plan.row_stride,
        fold_plan.x_stride,
        fold_plan.slots,
        fold_plan.x_offset,
    )
    params = (ctypes.c_void_p * 1)(ctypes.cast(ctypes.pointer(args), ctypes.c_void_p))
    attr = _LaunchAttribute(id=_PDL_ATTRIBUTE)
    attr.value[0] = 1
    config = _LaunchConfig(
        grid=(ctypes.c_uint * 3)(fold_plan.grid, 1, 1),
        block=(ctypes.c_uint * 3)(_THREADS, 1, 1),
        shared_mem_bytes=fold_plan.smem_bytes,
        stream=torch.cuda.current_stream(x.device).cuda_stream,
        attrs=ctypes.pointer(attr) if pdl else None,
        num_attrs=1 if pdl else 0,
    )
    _check(_driver().cuLaunchKernelEx(ctypes.byref(config), func, params, None), "cuLaunchKernelEx")
    return y
