"""Strict safetensors headers, bounded tensor reads, and deterministic header encoding.

Why not just ``safetensors.safe_open``: checkpoints come from strangers and arrive truncated, and
the converter must turn every defect into a one-line error naming the file *before* it reads data
(a header that claims 10 GB, offsets that overlap or run past the end, a JSON header that is not an
object). This module validates the whole header against the file size, then reads exactly the
byte range of one tensor with ``pread`` so peak memory is one tensor, never a shard. The writer
header is encoded up front from the planned shapes so tensor bytes can be streamed after it
(see :mod:`foldckpt.format.sidecar`); a sidecar shard is never held in memory either. Files
written here are read back with the real ``safetensors`` library in tests.

No torch here: headers, hashing and byte reads are all ``inspect``, ``verify`` up to its content
level and ``convert --dry-run`` need, so they start without it. Tensors made from these bytes, and
bytes taken from tensors, are :mod:`foldckpt.tensors`.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foldckpt.errors import FoldckptError
from foldckpt.io.files import parse_json

# safetensors limits the JSON header to 100 MB; a real header of a 2.8T-parameter shard is far below.
MAX_HEADER_BYTES = 100 * 1024 * 1024
_HEADER_ALIGN = 8

# Bits per element of every dtype the safetensors format defines (sizes are needed to validate
# offsets even for tensors we never read, e.g. MXFP4 expert weights).
DTYPE_BITS: dict[str, int] = {
    "BOOL": 8,
    "U8": 8,
    "I8": 8,
    "F8_E5M2": 8,
    "F8_E4M3": 8,
    "F8_E8M0": 8,
    "F4": 4,
    "F6_E2M3": 6,
    "F6_E3M2": 6,
    "I16": 16,
    "U16": 16,
    "F16": 16,
    "BF16": 16,
    "I32": 32,
    "U32": 32,
    "F32": 32,
    "I64": 64,
    "U64": 64,
    "F64": 64,
    "C64": 64,
}

# safetensors dtype -> the name of the torch dtype that reads it (:data:`foldckpt.tensors.TORCH_DTYPES`).
TORCH_DTYPE_NAMES: dict[str, str] = {
    "BF16": "bfloat16",
    "F16": "float16",
    "F32": "float32",
    "F64": "float64",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "U8": "uint8",
    "I8": "int8",
    "I32": "int32",
    "I64": "int64",
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's entry in a safetensors header; offsets are absolute positions in the file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class SafetensorsHeader:
    path: Path
    file_size: int
    header_size: int
    tensors: dict[str, TensorInfo]
    metadata: dict[str, str]


def tensor_nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return (math.prod(shape) * DTYPE_BITS[dtype] + 7) // 8


def _bad(path: Path, what: str, tensor: str | None = None) -> FoldckptError:
    return FoldckptError.at(path, f"not a valid safetensors file: {what}", tensor)


def _parse_entry(path: Path, name: str, entry: Any, data_start: int) -> TensorInfo:
    if not isinstance(entry, dict):
        raise _bad(path, f"header entry for tensor '{name}' is not an object", name)
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BITS:
        raise _bad(path, f"tensor '{name}' has unknown dtype {dtype!r}", name)
    if not isinstance(shape, list) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise _bad(path, f"tensor '{name}' has an invalid shape {shape!r}", name)
    if (
        not isinstance(offsets, list)
        or len(offsets) != 2
        or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        or not 0 <= offsets[0] <= offsets[1]
    ):
        raise _bad(path, f"tensor '{name}' has invalid data_offsets {offsets!r}", name)
    expected = tensor_nbytes(dtype, tuple(shape))
    if offsets[1] - offsets[0] != expected:
        raise _bad(
            path,
            f"tensor '{name}' spans {offsets[1] - offsets[0]} bytes but {dtype}{shape} needs {expected}",
            name,
        )
    return TensorInfo(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def read_header(path: Path) -> SafetensorsHeader:
    """Parse and fully validate the header of a safetensors file without reading tensor data.

    Checks: the 8-byte length fits the file and the size limit, the header is a UTF-8 JSON object,
    every entry has a known dtype, a valid shape and offsets of exactly the right size, and the
    data regions tile the data section exactly (no overlap, no gap, nothing past the end).
    """
    path = Path(path)
    try:
        with open(path, "rb") as handle:
            file_size = os.fstat(handle.fileno()).st_size
            prefix = handle.read(8)
            if len(prefix) < 8:
                raise _bad(path, f"file is {file_size} bytes, too short for a header (truncated?)")
            (header_size,) = struct.unpack("<Q", prefix)
            if header_size > MAX_HEADER_BYTES:
                raise _bad(path, f"header length {header_size} exceeds the {MAX_HEADER_BYTES}-byte limit")
            if 8 + header_size > file_size:
                raise _bad(path, f"header length {header_size} runs past the end of the {file_size}-byte file")
            raw = handle.read(header_size)
    except FileNotFoundError:
        raise FoldckptError.at(path, "file not found") from None
    except PermissionError:
        raise FoldckptError.at(path, "permission denied; make the file readable") from None
    except IsADirectoryError:
        raise FoldckptError.at(path, "is a directory, expected a safetensors file") from None
    try:
        header = parse_json(raw.decode("utf-8"))
    except ValueError as exc:
        raise _bad(path, f"header is not valid JSON ({exc})") from None
    if not isinstance(header, dict):
        raise _bad(path, "header is not a JSON object")

    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise _bad(path, "__metadata__ must map strings to strings")
    data_start = 8 + header_size
    tensors = {name: _parse_entry(path, name, entry, data_start) for name, entry in header.items()}

    cursor = data_start
    for info in sorted(tensors.values(), key=lambda t: (t.start, t.end)):
        if info.start != cursor:
            what = "overlaps another tensor" if info.start < cursor else "leaves a gap before it"
            raise _bad(path, f"tensor '{info.name}' {what} (offset {info.start - data_start})", info.name)
        cursor = info.end
    if cursor != file_size:
        if cursor > file_size:
            raise _bad(path, f"tensor data needs {cursor} bytes but the file has {file_size} (truncated?)")
        raise _bad(path, f"{file_size - cursor} trailing bytes after the last tensor")
    return SafetensorsHeader(path, file_size, header_size, tensors, metadata)


def read_tensor_bytes(path: Path, info: TensorInfo, start: int = 0, stop: int | None = None) -> bytearray:
    """Read bytes ``[start, stop)`` of one tensor's data with ``pread`` (no mmap, no pickle)."""
    stop = info.nbytes if stop is None else stop
    buffer = bytearray(stop - start)
    view = memoryview(buffer)
    try:
        fd = os.open(path, os.O_RDONLY)
    except PermissionError:
        raise FoldckptError.at(path, "permission denied; make the file readable") from None
    except FileNotFoundError:
        raise FoldckptError.at(path, "file disappeared while converting") from None
    try:
        done = 0
        while done < len(buffer):
            got = os.preadv(fd, [view[done:]], info.start + start + done)
            if got == 0:
                raise FoldckptError.at(
                    path,
                    f"truncated while reading tensor '{info.name}' (file shrank after its header was checked)",
                    info.name,
                )
            done += got
    finally:
        os.close(fd)
    return buffer


@dataclass(frozen=True)
class TensorSpec:
    """A tensor to be written: known before its data exists, so headers can be written first."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return tensor_nbytes(self.dtype, self.shape)


def encode_header(specs: list[TensorSpec], metadata: dict[str, str], align: int = _HEADER_ALIGN) -> bytes:
    """The exact header bytes (length prefix included) for tensors laid out in ``specs`` order.

    Deterministic (fixed key order, no whitespace, space padding) so that a resumed conversion
    writes byte-identical files. The padding makes the header, prefix included, a multiple of
    ``align`` bytes (a multiple of 8), which is where the first tensor's bytes then start.
    """
    header: dict[str, Any] = {"__metadata__": dict(sorted(metadata.items()))}
    offset = 0
    for spec in specs:
        header[spec.name] = {
            "dtype": spec.dtype,
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    if align % _HEADER_ALIGN:
        raise ValueError(f"header alignment {align} is not a multiple of {_HEADER_ALIGN}")
    raw += b" " * (-(8 + len(raw)) % align)
    return struct.pack("<Q", len(raw)) + raw


def file_size_for(specs: list[TensorSpec], metadata: dict[str, str], align: int = _HEADER_ALIGN) -> int:
    return len(encode_header(specs, metadata, align)) + sum(spec.nbytes for spec in specs)
