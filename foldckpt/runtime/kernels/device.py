"""GPU identification: the key that picks a tuning table (``configs/<key>.toml``).

Tables are per chip, not per marketing string: "NVIDIA H100 80GB HBM3" and "NVIDIA H100" are the
same chip, while "H100 PCIe" and "H200 NVL" run at other clocks and power, so their form-factor
suffix is kept. Unknown names still get a stable key (vendor + slug) so a table can be added for
them without code changes.
"""

from __future__ import annotations

import functools
import re

import torch

__all__ = ["gpu_key", "gpu_key_from_name"]

_CHIPS = re.compile(
    r"\b(gh200|gb200|gb300|b200|b300|h100|h200|h800|h20|a100|a800|l40s|l40|l4|"
    r"mi300x|mi300a|mi308x|mi325x|mi350x|mi355x|mi250x|mi250|mi210)\b"
)
_FORM_FACTORS = ("nvl", "pcie", "sxm")
_VENDOR_WORDS = {"nvidia", "amd", "instinct", "radeon", "tesla", "geforce"}


def gpu_key_from_name(name: str, rocm: bool = False) -> str:
    """Table key of a device name, e.g. "NVIDIA H200" -> "nvidia_h200", "AMD Instinct MI355X" -> "amd_mi355x"."""
    lowered = name.lower()
    tokens = re.findall(r"[a-z0-9]+", lowered)
    vendor = "amd" if rocm or "amd" in tokens or "instinct" in tokens or "radeon" in tokens else "nvidia"
    chip = _CHIPS.search(" ".join(tokens))
    if chip is None:
        slug = "_".join(t for t in tokens if t not in _VENDOR_WORDS) or "unknown"
        return f"{vendor}_{slug}"
    # "sxm" is the default form factor of the chips that have one: it gets no suffix.
    suffix = [t for t in tokens if t in _FORM_FACTORS and t != "sxm"]
    return "_".join([vendor, chip.group(1), *suffix])


@functools.cache
def _cuda_key(index: int) -> str:
    return gpu_key_from_name(torch.cuda.get_device_name(index), rocm=torch.version.hip is not None)


def gpu_key(device: torch.device) -> str:
    """Table key of ``device``: "cpu" for the CPU, the chip's key for a CUDA/ROCm device."""
    if device.type != "cuda":
        return device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    return _cuda_key(index)
