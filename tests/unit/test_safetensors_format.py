"""Our strict reader and deterministic header encoder agree with the real safetensors library."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from foldckpt.io.safetensors_format import TensorSpec, encode_header, read_header
from foldckpt.tensors import read_tensor, tensor_to_bytes


def test_reader_matches_safetensors_library(tmp_path: Path) -> None:
    tensors = {
        "a": torch.randn(3, 5, dtype=torch.bfloat16),
        "b": torch.arange(7, dtype=torch.int64),
        "c": torch.randn(4, 4).to(torch.float8_e4m3fn),
        "empty": torch.zeros(0, 3),
    }
    path = tmp_path / "x.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    header = read_header(path)
    assert header.metadata == {"format": "pt"}
    for name, tensor in tensors.items():
        got = read_tensor(path, header.tensors[name])
        assert got.dtype == tensor.dtype and torch.equal(got.view(torch.uint8), tensor.view(torch.uint8))


@pytest.mark.parametrize("align", [8, 4096])
def test_encoded_files_load_in_safetensors_and_are_deterministic(tmp_path: Path, align: int) -> None:
    """Padded to ``align`` (sidecars: 4096, so that their folds start on page boundaries), the
    header is still one the safetensors library reads."""
    tensors = {"w.q_fold.weight": torch.randn(6, 4, dtype=torch.bfloat16), "v": torch.randn(2, 2)}
    specs = [TensorSpec("w.q_fold.weight", "BF16", (6, 4)), TensorSpec("v", "F32", (2, 2))]
    header = encode_header(specs, {"format": "pt"}, align)
    assert header == encode_header(specs, {"format": "pt"}, align) and len(header) % align == 0
    assert read_header_bytes_padding(header) < align
    path = tmp_path / "out.safetensors"
    path.write_bytes(header + b"".join(bytes(tensor_to_bytes(t)) for t in tensors.values()))
    with safe_open(str(path), framework="pt") as handle:
        assert list(handle.keys()) == sorted(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(handle.get_tensor(name), tensor)
    assert set(read_header(path).tensors) == set(tensors)


def read_header_bytes_padding(header: bytes) -> int:
    """How many spaces pad the JSON of an encoded header (never a whole ``align`` more than needed)."""
    raw = header[8:]
    return len(raw) - len(raw.rstrip(b" "))
