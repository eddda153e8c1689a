"""The accelerators ``foundryx plan --gpu`` knows: memory per device and the name the peak-FLOPs
table (foundryx/devices.py, the speed monitor's table) matches.

Memory is what torch reports as the device's total (``torch.cuda.get_device_properties(0)
.total_memory``), a little under the datasheet figure: the driver keeps some. An MI250X is two
devices of 64 GiB each to torch. ``--gpu-memory`` overrides it.
"""

from __future__ import annotations

from dataclasses import dataclass

from foundryx.errors import ConfigError, did_you_mean

GiB = 2**30
DEFAULT_GPU = "h100"
DEFAULT_MFU = 0.40  # the throughput estimate's model FLOPs utilisation


@dataclass(frozen=True)
class Gpu:
    key: str
    device_name: str  # as torch.cuda.get_device_name() gives it (matched by foundryx.devices)
    memory: int  # bytes
    kind: str  # cuda | rocm


GPUS = {g.key: g for g in (
    Gpu("a100-40gb", "NVIDIA A100-SXM4-40GB", int(39.4 * GiB), "cuda"),
    Gpu("a100-80gb", "NVIDIA A100-SXM4-80GB", int(79.2 * GiB), "cuda"),
    Gpu("h100", "NVIDIA H100 80GB HBM3", int(79.1 * GiB), "cuda"),
    Gpu("h100-pcie", "NVIDIA H100 PCIe", int(79.1 * GiB), "cuda"),
    Gpu("h200", "NVIDIA H200", int(139.8 * GiB), "cuda"),
    Gpu("b200", "NVIDIA B200", int(178.4 * GiB), "cuda"),
    Gpu("mi250x", "AMD Instinct MI250X", int(64.0 * GiB), "rocm"),
    Gpu("mi300x", "AMD Instinct MI300X", int(191.5 * GiB), "rocm"),
    Gpu("mi325x", "AMD Instinct MI325X", int(255.5 * GiB), "rocm"),
)}


def find_gpu(name: str) -> Gpu:
    key = name.lower().replace("_", "-")
    if key in GPUS:
        return GPUS[key]
    raise ConfigError([f"--gpu: unknown GPU {name!r}{did_you_mean(key, list(GPUS))}; known: "
                       f"{', '.join(GPUS)} (or give --gpu-memory, e.g. --gpu-memory 80GB)"])


UNITS = {"b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
         "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_memory(text: str) -> int:
    """``80GB``, ``80 GiB``, ``141gb``, ``1.5TB`` -> bytes (GB = 10^9, GiB = 2^30)."""
    t = text.strip().lower().replace(" ", "")
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):] or None
    try:
        value = float(num)
    except ValueError:
        value = -1.0
    if unit not in UNITS or value <= 0:
        raise ConfigError([f"--gpu-memory: cannot read {text!r}; write a number and a unit, e.g. "
                           "80GB or 79.1GiB (units: " + ", ".join(u.upper() if u == "b" else u
                                                                   for u in UNITS) + ")"])
    return int(value * UNITS[unit])
