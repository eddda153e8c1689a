"""Per-module forward wrappers: activation checkpointing, compile,
and linear layers routed through foundryx's CPU matmul.

Each replaces ``module.forward`` on the instance and keeps the module where it is, so
parameter names (and so checkpoints) do not change, and FSDP's hooks, which run around
``forward``, stay outside the checkpointed or compiled region.
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from typing import Any

import torch
from torch import nn

from foundryx.kernels import cpu_matmul


def checkpoint_activations(module: nn.Module) -> None:
    """Recompute ``module``'s forward in backward instead of storing its activations."""
    from torch.utils.checkpoint import checkpoint

    inner = module.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(inner, *args, use_reentrant=False, **kwargs)

    module.forward = forward


def route_linear(module: nn.Linear) -> None:
    """``module``'s product through :func:`foundryx.kernels.cpu_matmul.linear`, which takes
    oneDNN's GEMM when that backend is set and takes the operands (and is ``F.linear``
    otherwise)."""

    def forward(x: torch.Tensor) -> torch.Tensor:
        return cpu_matmul.linear(x, module.weight, module.bias)

    module.forward = forward


def compile_problem(device: torch.device) -> str | None:
    """Why ``torch.compile`` (inductor) cannot run on ``device`` here, or None."""
    if sys.platform == "win32":
        return "torch.compile is not set up by default on Windows"
    if device.type == "cpu":
        compilers = [os.environ.get("CXX"), "g++", "clang++", "c++"]
        if not any(c and shutil.which(c) for c in compilers):
            return "no C++ compiler (g++, clang++ or $CXX) for inductor's CPU code"
        return None
    if device.type == "cuda":
        try:
            from torch.utils._triton import has_triton  # lazy: imports Triton when present
        except ImportError:
            return "this torch has no Triton check"
        return None if has_triton() else "Triton does not import or this GPU is too old for it"
    return f"torch.compile is not on by default for device type {device.type!r}"


def compile_forward(module: nn.Module, options: dict[str, Any]) -> None:
    """``torch.compile`` the module's forward (after any checkpoint/offload wrapper)."""
    module.forward = torch.compile(module.forward, **options)
    module._foundryx_compiled = True
