"""Peak dense FLOP/s of accelerators: the one table foundryx reads (the speed monitor's MFU,
the planner).

    >>> peak_flops("NVIDIA H100 80GB HBM3", "bf16")
    989000000000000.0
    >>> peak_flops("NVIDIA GeForce RTX 4090", "bf16") is None   # unknown: a warning, no guess
    True

A device is matched from the name ``torch.cuda.get_device_name()`` returns (the same call
gives the marketing name on ROCm). Every number is the vendor datasheet's *dense* figure per
device as torch sees it: NVIDIA's datasheets print tensor-core numbers with 2:4 sparsity, so
those are halved here; an MI250X is two devices to torch (two GCDs), so its per-package figure
is halved too. A name this table does not know, or one that could be two parts with different
peaks (an "MI250X/MI250", an H100/H200 NVL), gets no number: :func:`peak_flops` logs one
warning naming the device and how to give the number (the speed monitor's ``peak_flops``
option) and returns None.

Imports nothing of foundryx: any part may use it.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

log = logging.getLogger(__name__)

DTYPES = ("bf16", "fp16", "fp8")
T = 1e12


@dataclass(frozen=True)
class Device:
    """One accelerator: its ``key``, a regular expression that matches its device names
    (lower case) and its peak dense FLOP/s per dtype (a dtype it lacks is absent)."""

    key: str
    pattern: str
    flops: dict[str, float]
    source: str


DEVICES: tuple[Device, ...] = (
    # NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf): BF16/FP16
    # tensor core 312 TFLOPS (624 with sparsity), the same for 40 GB/80 GB, SXM4 and PCIe.
    # No FP8 on Ampere. Names: "NVIDIA A100-SXM4-40GB", "NVIDIA A100 80GB PCIe".
    Device("a100", r"\ba100\b", {"bf16": 312 * T, "fp16": 312 * T}, "NVIDIA A100 datasheet"),
    # NVIDIA H100 datasheet (h100-datasheet, "H100 SXM" column): BF16/FP16 1,979 TFLOPS and FP8
    # 3,958 TFLOPS with sparsity -> 989 and 1,979 dense. Name: "NVIDIA H100 80GB HBM3".
    Device("h100-sxm", r"\bh100\b(?!.*\b(nvl|pcie)\b).*\b(hbm3|sxm\w*)\b",
           {"bf16": 989 * T, "fp16": 989 * T, "fp8": 1979 * T}, "NVIDIA H100 datasheet, SXM"),
    # The same datasheet, "H100 PCIe" column: BF16/FP16 1,513 and FP8 3,026 TFLOPS with sparsity -> 756 and 1,513 dense. Name: "NVIDIA H100 PCIe".
    Device("h100-pcie", r"\bh100\b.*\bpcie\b",
           {"bf16": 756 * T, "fp16": 756 * T, "fp8": 1513 * T}, "NVIDIA H100 datasheet, PCIe"),
    # NVIDIA H200 datasheet (hpc-datasheet-sc23-h200, "H200 SXM" column): BF16/FP16 1,979 and
    # FP8 3,958 TFLOPS with sparsity -> 989 and 1,979 dense (the H100 SXM's compute).
    # Name: "NVIDIA H200" (the H200 NVL, "NVIDIA H200 NVL", has lower peaks: not matched).
    Device("h200", r"\bh200\b(?!.*\bnvl\b)",
           {"bf16": 989 * T, "fp16": 989 * T, "fp8": 1979 * T}, "NVIDIA H200 datasheet, SXM"),
    # NVIDIA HGX B200 datasheet: 8 GPUs give FP16/BF16 36 PFLOPS and FP8 72 PFLOPS with
    # sparsity -> per GPU 2.25 and 4.5 PFLOPS dense. Name: "NVIDIA B200".
    Device("b200", r"\bb200\b", {"bf16": 2250 * T, "fp16": 2250 * T, "fp8": 4500 * T},
           "NVIDIA HGX B200 datasheet"),
    # AMD Instinct MI250X datasheet: peak FP16/BF16 383 TFLOPS per package (no sparsity, no
    # FP8); a package is two GCDs and torch sees each as a device -> 191.5 per device.
    # "AMD Instinct MI250X/MI250" (what ROCm often reports) could be an MI250 (362 TFLOPS):
    # not matched.
    Device("mi250x", r"\bmi250x\b(?!\s*/\s*mi250)", {"bf16": 191.5 * T, "fp16": 191.5 * T},
           "AMD Instinct MI250X datasheet (per GCD)"),
    # AMD Instinct MI300X datasheet: FP16/BF16 1,307.4 TFLOPS, FP8 2,614.9 TFLOPS dense (AMD
    # lists sparsity separately, at twice these). Name: "AMD Instinct MI300X".
    Device("mi300x", r"\bmi300x\b", {"bf16": 1307.4 * T, "fp16": 1307.4 * T, "fp8": 2614.9 * T},
           "AMD Instinct MI300X datasheet"),
    # AMD Instinct MI325X datasheet: the MI300X's compute (1,307.4 / 2,614.9 TFLOPS dense) with
    # more and faster memory. Name: "AMD Instinct MI325X".
    Device("mi325x", r"\bmi325x\b", {"bf16": 1307.4 * T, "fp16": 1307.4 * T, "fp8": 2614.9 * T},
           "AMD Instinct MI325X datasheet"),
)

# Composer's precision names -> the table's dtype (fp32 runs have no entry: see peak_flops).
PRECISION_DTYPE = {"amp_bf16": "bf16", "bf16": "bf16", "amp_fp16": "fp16", "fp16": "fp16",
                   "amp_fp8": "fp8", "fp8": "fp8"}

_warned: set[tuple[str, str]] = set()


def find_device(device_name: str) -> Device | None:
    """The table's entry for ``device_name`` (a ``torch.cuda.get_device_name()`` string), or
    None when no entry matches."""
    name = device_name.lower().replace("_", " ")
    for device in DEVICES:
        if re.search(device.pattern, name):
            return device
    return None


def peak_flops(device_name: str, dtype: str, *, warn: bool = True) -> float | None:
    """Peak dense FLOP/s of one ``device_name`` device at ``dtype`` (``bf16``, ``fp16``,
    ``fp8``, or a Composer precision such as ``amp_bf16``); None when the table has no number,
    after one warning per device and dtype saying why (unless ``warn`` is false)."""
    key = PRECISION_DTYPE.get(dtype, dtype)
    device = find_device(device_name)
    value = device.flops.get(key) if device is not None else None
    if value is None and warn and (device_name, key) not in _warned:
        _warned.add((device_name, key))
        log.warning("%s", why_no_peak(device_name, dtype))
    return value


def why_no_peak(device_name: str, dtype: str) -> str:
    """The sentence :func:`peak_flops` logs when it has no number."""
    key = PRECISION_DTYPE.get(dtype, dtype)
    fix = ("MFU is not reported; to report it, give the device's peak dense FLOP/s: "
           "callbacks.speed_monitor.peak_flops: <number>")
    device = find_device(device_name)
    if device is None:
        known = ", ".join(d.key for d in DEVICES)
        return (f"peak FLOP/s: {device_name!r} is not in foundryx's device table "
                f"(foundryx/devices.py: {known}); {fix}")
    if key not in DTYPES:
        return (f"peak FLOP/s of {device_name!r} ({device.key}): the table lists bf16, fp16 and "
                f"fp8 peaks only, not {dtype!r}; {fix}")
    return f"peak FLOP/s of {device_name!r}: {device.key} has no {key} peak in its datasheet; {fix}"
