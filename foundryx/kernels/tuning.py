"""Launch configurations of the FlashAttention kernels, per device family: the one place to tune.

A configuration is a tile shape plus Triton launch options. Each kernel (``fwd``, ``bwd_dkdv``,
``bwd_dq``, ``bwd_atomic``) has one per family and head-dim bucket (the head dim padded to a
power of 2: <= 64, <= 128, <= 256). The starting points came from the Triton tutorial (NVIDIA)
and ROCm's perf-kernels (AMD); each row was then checked, and where needed replaced, by
compiling it ahead of time for its target (``python -m foundryx.kernels.targets``, ``python -m
foundryx.kernels.search``). ``python -m benchmarks.attention --tune`` times :data:`CANDIDATES`
on the GPU at hand and prints the rows to paste here.

:data:`BWD` chooses the backward per family and bucket: ``"split"`` runs ``bwd_dkdv`` and then
``bwd_dq`` (7 matmuls per tile pair, no atomics, deterministic), ``"atomic"`` runs
``bwd_atomic`` alone (FlashAttention-2's 5 matmuls, dQ added in float32 with atomics, in an
order that varies run to run). Every row says ``"split"``, the backward measured so far, until
a GPU measures both (``python -m benchmarks.attention --bwd split atomic``); with
``torch.use_deterministic_algorithms(True)`` the backward is ``"split"`` whatever the row says.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

KERNELS = ("fwd", "bwd_dkdv", "bwd_dq", "bwd_atomic")
BWD_MODES = ("split", "atomic")
BUCKETS = (64, 128, 256)


@dataclass(frozen=True)
class KernelConfig:
    """Tile rows (``block_m``, queries) and columns (``block_n``, keys) plus launch options."""

    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    extra: dict[str, int] = field(default_factory=dict)  # backend options, e.g. waves_per_eu

    def launch_options(self) -> dict[str, int]:
        return {"num_warps": self.num_warps, "num_stages": self.num_stages, **self.extra}

    def __str__(self) -> str:
        extra = "".join(f" {k}={v}" for k, v in self.extra.items())
        return (
            f"{self.block_m}x{self.block_n} warps={self.num_warps} stages={self.num_stages}{extra}"
        )


C = KernelConfig
_AMD = {"waves_per_eu": 2}  # the compiler budgets registers for 2 waves per SIMD
_AMD1 = {"waves_per_eu": 1}  # ... for 1 wave: up to 512 VGPRs, for the largest tiles

# family -> kernel -> (config for head dim <= 64, <= 128, <= 256). Every row compiles for its
# target without register spills and within its shared memory / LDS, for every dtype and
# feature set, with Triton 3.3 (torch 2.7) and Triton 3.8 (torch 2.14) alike (checked ahead of
# time on any machine: `python -m foundryx.kernels.targets --set full`; the reasoning is in
# docs/attention.md). The bwd_atomic rows (issue 47) were chosen on paper only, as the tiles of
# the largest arithmetic intensity that compile without spills with every feature on in bf16
# (Triton 3.3; its extra dQ product leaves less room than bwd_dkdv: sm90's 32x32 tiles at head
# dim 128 spill 188-292 B there); `python -m benchmarks.attention --tune` has the last word on a GPU.
TABLE: dict[str, dict[str, tuple[KernelConfig, KernelConfig, KernelConfig]]] = {
    # H100 / H200 (and other big-shared-memory NVIDIA GPUs: sm90, sm100)
    "sm90": {
        "fwd": (C(128, 128, 8, 3), C(128, 64, 8, 3), C(64, 32, 8, 1)),
        "bwd_dkdv": (C(32, 128, 8, 2), C(32, 32, 8, 3), C(64, 16, 8, 1)),
        "bwd_dq": (C(128, 64, 8, 4), C(128, 32, 8, 3), C(32, 16, 8, 3)),
        "bwd_atomic": (C(64, 64, 8, 1), C(16, 32, 8, 2), C(16, 16, 8, 1)),
    },
    # A100 / A800 (164 KB shared memory)
    "sm80": {
        "fwd": (C(128, 64, 8, 3), C(128, 32, 8, 3), C(32, 32, 4, 2)),
        "bwd_dkdv": (C(32, 32, 4, 2), C(32, 32, 8, 3), C(64, 16, 8, 1)),
        "bwd_dq": (C(128, 64, 8, 3), C(128, 32, 8, 2), C(64, 32, 8, 2)),
        "bwd_atomic": (C(32, 32, 4, 2), C(32, 32, 8, 1), C(32, 16, 8, 1)),
    },
    # other NVIDIA (sm86, sm89, sm120: ~100 KB shared memory)
    "nvidia": {
        "fwd": (C(128, 64, 4, 2), C(64, 64, 4, 2), C(64, 32, 4, 1)),
        "bwd_dkdv": (C(32, 64, 4, 2), C(32, 64, 4, 1), C(16, 32, 4, 1)),
        "bwd_dq": (C(64, 32, 4, 2), C(64, 32, 4, 1), C(32, 16, 4, 1)),
        "bwd_atomic": (C(32, 32, 4, 2), C(32, 32, 8, 1), C(32, 16, 8, 1)),
    },
    # MI300X / MI325X (gfx942) and MI350 (gfx950)
    "cdna3": {
        "fwd": (C(128, 64, 8, 1, _AMD), C(128, 64, 4, 1, _AMD1), C(64, 32, 4, 1, _AMD1)),
        "bwd_dkdv": (C(64, 128, 4, 1, _AMD1), C(32, 128, 4, 1, _AMD1), C(16, 64, 8, 1, _AMD)),
        "bwd_dq": (C(128, 32, 4, 1, _AMD), C(64, 32, 4, 1, _AMD), C(32, 16, 4, 1, _AMD)),
        "bwd_atomic": (C(64, 128, 4, 1, _AMD1), C(32, 64, 4, 1, _AMD1), C(16, 64, 4, 1, _AMD1)),
    },
    # MI200 (gfx90a) and other AMD GPUs
    "cdna2": {
        "fwd": (C(128, 64, 4, 1, _AMD), C(128, 32, 4, 1, _AMD), C(64, 32, 4, 1, _AMD1)),
        "bwd_dkdv": (C(32, 64, 4, 1, _AMD), C(64, 64, 4, 1, _AMD1), C(16, 32, 4, 1, _AMD)),
        "bwd_dq": (C(64, 32, 4, 1, _AMD), C(128, 64, 4, 1, _AMD1), C(32, 16, 4, 1, _AMD)),
        "bwd_atomic": (C(32, 64, 4, 1, _AMD1), C(32, 64, 4, 1, _AMD1), C(16, 32, 4, 1, _AMD1)),
    },
    # CPU tensors under TRITON_INTERPRET=1 (tests): small uneven tiles exercise every boundary.
    "interpreter": {
        "fwd": (C(32, 16),) * 3,
        "bwd_dkdv": (C(16, 32),) * 3,
        "bwd_dq": (C(32, 16),) * 3,
        "bwd_atomic": (C(16, 32),) * 3,
    },
}

# family -> backward per head-dim bucket (<= 64, <= 128, <= 256): "split" (bwd_dkdv + bwd_dq)
# or "atomic" (bwd_atomic). "split" everywhere: it is what every GPU figure so far measured, and
# "atomic" has not run on a GPU yet; a row changes only when `python -m benchmarks.attention
# --bwd split atomic` has timed both on that family (issue 47), so users see no change before.
BWD: dict[str, tuple[str, str, str]] = {
    "sm90": ("split", "split", "split"),
    "sm80": ("split", "split", "split"),
    "nvidia": ("split", "split", "split"),
    "cdna3": ("split", "split", "split"),
    "cdna2": ("split", "split", "split"),
    "interpreter": ("split", "split", "split"),
}

# What `python -m benchmarks.attention --tune` tries, per kernel (tiles that do not fit are skipped).
CANDIDATES: dict[str, list[KernelConfig]] = {
    "fwd": [
        C(bm, bn, w, s)
        for bm, bn in ((128, 128), (128, 64), (64, 64), (128, 32))
        for w in (4, 8)
        for s in (1, 2, 3, 4)
    ],
    "bwd_dkdv": [
        C(bm, bn, w, s)
        for bm, bn in ((32, 128), (64, 128), (32, 64), (16, 64), (64, 64))
        for w in (4, 8)
        for s in (1, 2, 3, 4)
    ],
    "bwd_dq": [
        C(bm, bn, w, s)
        for bm, bn in ((128, 32), (128, 64), (64, 32), (64, 64), (64, 16))
        for w in (4, 8)
        for s in (1, 2, 3, 4)
    ],
    "bwd_atomic": [
        C(bm, bn, w, s)
        for bm, bn in ((32, 128), (64, 128), (32, 64), (64, 64), (16, 64), (32, 32))
        for w in (4, 8)
        for s in (1, 2, 3, 4)
    ],
}

_forced: dict[str, KernelConfig] = {}
_forced_bwd: list[str] = []


@functools.cache
def device_family(device: torch.device) -> str:
    """``sm90``, ``sm80``, ``nvidia``, ``cdna3``, ``cdna2`` or ``interpreter`` (CPU tensors)."""
    if device.type != "cuda":
        return "interpreter"
    props = torch.cuda.get_device_properties(device)
    if torch.version.hip is not None:
        arch = getattr(props, "gcnArchName", "")
        return "cdna3" if arch.startswith(("gfx94", "gfx95")) else "cdna2"
    if props.major in (9, 10):
        return "sm90"
    return "sm80" if (props.major, props.minor) == (8, 0) else "nvidia"


def config(kernel: str, head_dim_padded: int, device: torch.device) -> KernelConfig:
    """The configuration of ``kernel`` for a head dim (padded to a power of 2) on ``device``."""
    if kernel in _forced:
        return _forced[kernel]
    return TABLE[device_family(device)][kernel][_bucket(head_dim_padded)]


def bwd_mode(head_dim_padded: int, device: torch.device) -> str:
    """``"split"`` or ``"atomic"``: the backward :data:`BWD` (or :func:`forced`) chooses."""
    if _forced_bwd:
        return _forced_bwd[-1]
    return BWD[device_family(device)][_bucket(head_dim_padded)]


def _bucket(head_dim_padded: int) -> int:
    return next(i for i, b in enumerate(BUCKETS) if head_dim_padded <= b)


@contextlib.contextmanager
def forced(bwd: str | None = None, **configs: KernelConfig) -> Iterator[None]:
    """Use the given configs (``fwd=..., bwd_dkdv=..., bwd_dq=..., bwd_atomic=...``) and
    backward (``bwd="split"`` or ``"atomic"``) inside the block (tuning, benchmarks, tests).
    The backward is chosen when the forward runs: a backward run later uses that choice."""
    unknown = set(configs) - set(KERNELS)
    if unknown:
        raise ValueError(f"unknown kernels {sorted(unknown)}; known: {', '.join(KERNELS)}")
    if bwd is not None and bwd not in BWD_MODES:
        raise ValueError(f"unknown backward {bwd!r}; known: {', '.join(BWD_MODES)}")
    old = dict(_forced)
    _forced.update(configs)
    if bwd is not None:
        _forced_bwd.append(bwd)
    try:
        yield
    finally:
        _forced.clear()
        _forced.update(old)
        if bwd is not None:
            _forced_bwd.pop()
