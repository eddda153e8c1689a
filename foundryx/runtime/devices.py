"""What a device can do: peak dense FLOP/s of accelerators (the one table foundryx reads: the
speed monitor's MFU, the planner), this machine's GPUs and what they can do (:class:`Machine`:
bf16, FP8 tensor cores, TransformerEngine), and which float8 dtype a GPU multiplies
(:func:`fp8_gemm_dtype`). Capability only: which config settings a machine can run (``device``,
``precision``, ``float8``) are config rules, :mod:`foundryx.config.hardware`, which the entry
points hand a :class:`Machine`; the device a run uses is picked in
:mod:`foundryx.runtime.device_choice`.

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

Whether this machine has a GPU is known without torch in the common cases (no NVIDIA or AMD
device files, every GPU hidden by ``CUDA_VISIBLE_DEVICES``, a CPU-only torch build): the
command line checks a config before it imports torch (seconds), and again with torch, which
also knows the GPU's model, before a run starts.

Imports nothing of foundryx: any part may use it.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import logging
import os
import re
import sys
from dataclasses import dataclass
from typing import Any

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
                f"(foundryx/runtime/devices.py: {known}); {fix}")
    if key not in DTYPES:
        return (f"peak FLOP/s of {device_name!r} ({device.key}): the table lists bf16, fp16 and "
                f"fp8 peaks only, not {dtype!r}; {fix}")
    return f"peak FLOP/s of {device_name!r}: {device.key} has no {key} peak in its datasheet; {fix}"


# -- this machine's GPUs and what they can do ------------------------------------------------
@dataclass(frozen=True)
class Machine:
    """This machine's GPUs as far as they are known: ``gpus`` 0 (none, ``why_none`` says how
    that is known), None (not known without torch), or the count torch sees; ``name`` and
    ``capability`` (NVIDIA compute capability; None on ROCm) of the first GPU, from torch;
    on ROCm its ``arch`` (``gcnArchName``, e.g. "gfx942:sramecc+:xnack-") and ``hip`` version."""

    gpus: int | None
    why_none: str = ""
    name: str | None = None
    capability: tuple[int, int] | None = None
    arch: str | None = None
    hip: str | None = None

    def bf16(self) -> bool | None:
        """Whether the GPU multiplies bf16 on tensor cores (NVIDIA compute capability 8.0,
        Ampere, or newer); None when not known (no torch yet, or ROCm: torch decides)."""
        return None if self.capability is None else tuple(self.capability) >= (8, 0)

    def fp8_tensor_cores(self) -> bool | None:
        """Whether the GPU has FP8 tensor cores (:func:`fp8_gemm_dtype`, the one rule); None
        when not known (no torch yet)."""
        if self.capability is None and self.arch is None:
            return None
        return fp8_gemm_dtype(self.capability, self.arch, self.hip) is not None

    def transformer_engine(self) -> bool:
        """Whether NVIDIA TransformerEngine (Composer's ``amp_fp8``) is installed."""
        return importlib.util.find_spec("transformer_engine") is not None

    def words(self) -> str:
        """The GPU's generation in words: "compute capability 8.0", "gfx90a, ROCm 6.4.1"."""
        if self.capability is not None:
            return f"compute capability {self.capability[0]}.{self.capability[1]}"
        if self.arch is not None:
            return f"{self.arch.split(':')[0]}, ROCm {self.hip}"
        return "not known without torch"


def machine_without_torch() -> Machine:
    """What is known of this machine's GPUs without importing torch (a fraction of a second)."""
    for var in ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"):
        value = os.environ.get(var)
        if value is not None and value.strip() in ("", "-1"):
            return Machine(0, f"{var}={value!r} hides every GPU")
    try:
        torch_version = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        torch_version = None
    if torch_version is not None and "+cpu" in torch_version:
        return Machine(0, f"torch {torch_version} is a CPU-only build")
    if sys.platform == "darwin":
        return Machine(0, "macOS: torch has no CUDA or ROCm there")
    if sys.platform.startswith("linux") and not (
            glob.glob("/dev/nvidia[0-9]*") or os.path.exists("/dev/kfd") or os.path.exists("/dev/dxg")):
        return Machine(0, "no NVIDIA or AMD GPU device: no /dev/nvidia*, no /dev/kfd")
    return Machine(None)


def machine_from_torch() -> Machine:
    """This machine's GPUs as torch sees them (imports torch: seconds)."""
    import torch  # heavy: only where a run or a dry run loads it anyway

    if not torch.cuda.is_available():
        if torch.version.cuda is None and torch.version.hip is None:
            return Machine(0, f"torch {torch.__version__} is a CPU-only build")
        light = machine_without_torch()
        return Machine(0, light.why_none or "torch sees no GPU (check nvidia-smi or rocm-smi, "
                       "and CUDA_VISIBLE_DEVICES)")
    capability = None if torch.version.hip else tuple(torch.cuda.get_device_capability(0))
    arch = (getattr(torch.cuda.get_device_properties(0), "gcnArchName", None)
            if torch.version.hip else None)
    return Machine(torch.cuda.device_count(), name=torch.cuda.get_device_name(0),
                   capability=capability, arch=arch, hip=torch.version.hip)


def this_machine() -> Machine:
    """With torch when it is already imported (it then knows the GPU), else without."""
    return machine_from_torch() if "torch" in sys.modules else machine_without_torch()


# -- FP8 tensor cores: the one rule -------------------------------------------------------------
# NVIDIA: compute capability 8.9 (Ada) and newer (Hopper 9.0, Blackwell 10.x/12.x) multiply
# float8 e4m3 (OCP); Ampere (A100, 8.0) has no FP8. AMD: gfx942 (MI300X/MI325X, CDNA3) multiplies
# its own float8 e4m3 *fnuz* (exponent bias 8, no negative zero, max 240); gfx950 (MI350,
# ROCm >= 6.5) and gfx12 (RDNA4, ROCm >= 6.3) the OCP e4m3; gfx90a (MI250) has no FP8. These are
# the devices torch's own FP8 tests run ``_scaled_mm`` on (torch.testing._internal.common_cuda).
FP8_MIN_CAPABILITY = (8, 9)
FP8_AMD_ARCHS = (("gfx94", "float8_e4m3fnuz", (0, 0)), ("gfx95", "float8_e4m3fn", (6, 5)),
                 ("gfx120", "float8_e4m3fn", (6, 3)))


def fp8_gemm_dtype(capability: tuple[int, int] | None = None, arch: str | None = None,
                   hip: str | None = None) -> str | None:
    """The float8 dtype (torch's name) the FP8 tensor cores of a GPU multiply, or None when it
    has none: an NVIDIA GPU of compute ``capability`` (major, minor), or an AMD GPU whose
    ``gcnArchName`` is ``arch`` under ROCm version ``hip`` ("6.4.1"). The one rule for FP8
    GEMMs (``frozen_base: fp8``'s, ``float8``'s and ``amp_fp8``'s capability checks).

        >>> fp8_gemm_dtype((9, 0)), fp8_gemm_dtype((8, 0))
        ('float8_e4m3fn', None)
        >>> fp8_gemm_dtype(arch="gfx942:sramecc+:xnack-", hip="6.4"), fp8_gemm_dtype(arch="gfx90a", hip="6.4")
        ('float8_e4m3fnuz', None)
    """
    if capability is not None:
        return "float8_e4m3fn" if tuple(capability) >= FP8_MIN_CAPABILITY else None
    if arch is None:
        return None
    rocm = tuple(int(v) for v in re.findall(r"\d+", hip or "0")[:2])
    for prefix, dtype, min_rocm in FP8_AMD_ARCHS:
        if arch.startswith(prefix) and rocm >= min_rocm:
            return dtype
    return None


def device_fp8_gemm(device: Any) -> tuple[str | None, str]:
    """:func:`fp8_gemm_dtype` of a ``torch.device`` as torch sees it, and the device in words
    (``"NVIDIA H100 80GB HBM3 (sm90)"``, ``"AMD Instinct MI300X (gfx942)"``, ``"cpu"``)."""
    import torch  # heavy: only where a run has loaded it anyway

    if device.type != "cuda" or not torch.cuda.is_available():
        return None, device.type
    index = device.index if device.index is not None else torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    if torch.version.hip:
        arch = getattr(props, "gcnArchName", "") or ""
        return (fp8_gemm_dtype(arch=arch, hip=torch.version.hip),
                f"{props.name} ({arch.split(':')[0]}, ROCm {torch.version.hip})")
    capability = (props.major, props.minor)
    return fp8_gemm_dtype(capability), f"{props.name} (sm{props.major}{props.minor})"
