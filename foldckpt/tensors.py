"""Torch tensors from safetensors bytes and back: the one place where :mod:`foldckpt.io` meets torch.

:mod:`foldckpt.io` reads and writes bytes without torch (so the CLI, ``inspect`` and the structure
checks start without it); whatever turns those bytes into tensors, or tensors into bytes, is here.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from foldckpt.errors import FoldckptError
from foldckpt.io.safetensors_format import TORCH_DTYPE_NAMES, TensorInfo, read_tensor_bytes

# safetensors dtype name -> torch dtype, and back.
TORCH_DTYPES: dict[str, torch.dtype] = {name: getattr(torch, attr) for name, attr in TORCH_DTYPE_NAMES.items()}
SAFETENSORS_DTYPES: dict[torch.dtype, str] = {dtype: name for name, dtype in TORCH_DTYPES.items()}


def read_tensor(path: Path, info: TensorInfo) -> torch.Tensor:
    """Load one tensor (only its bytes) as a CPU torch tensor of its stored dtype."""
    if info.dtype not in TORCH_DTYPES:
        raise FoldckptError.at(
            path, f"tensor '{info.name}' has dtype {info.dtype}, which foldckpt cannot read", info.name
        )
    return tensor_from_bytes(read_tensor_bytes(path, info), info)


def tensor_from_bytes(data: bytes | bytearray | memoryview, info: TensorInfo) -> torch.Tensor:
    """The tensor ``info`` describes, over ``data`` (its bytes, as read): no copy."""
    dtype = TORCH_DTYPES[info.dtype]
    if not data:
        return torch.empty(info.shape, dtype=dtype)
    return torch.frombuffer(data, dtype=dtype).reshape(info.shape)


def tensor_to_bytes(tensor: torch.Tensor) -> memoryview:
    """The little-endian bytes of a contiguous CPU tensor, without copying (and without numpy,
    which foldckpt does not depend on: a ctypes array over the tensor's memory, which keeps the
    tensor alive for as long as the view lives)."""
    tensor = tensor.detach().contiguous().cpu()
    nbytes = tensor.numel() * tensor.element_size()
    if not nbytes:
        return memoryview(b"")
    array = (ctypes.c_ubyte * nbytes).from_address(tensor.data_ptr())
    array._owner = tensor  # type: ignore[attr-defined]
    return memoryview(array).cast("B")
