"""``torch.ops.foundryx.fp8_quantize_rows``: per-row FP8 quantization as one torch operator.

A custom operator (``torch.library.custom_op``) so that everything that looks at a step op by
op sees one op where a GPU runs one kernel: FakeTensorMode and torch's memory tracker (its
fake implementation), the op census of benchmarks/op_census.py, and ``torch.compile``
(which keeps it whole). On a GPU (CUDA or ROCm) it runs :mod:`foundryx.kernels.fp8_rows`'s
Triton kernel; on any other device :func:`quantize_rows_eager`, the torch ops whose results
the kernel reproduces bit for bit (tests/test_fp8_rows.py).
"""

from __future__ import annotations

import functools
import importlib.util

import torch


def quantize_rows_eager(x: torch.Tensor, dtype: torch.dtype,
                        col_scale: torch.Tensor | None = None,
                        min_scale: float = 1e-12) -> tuple[torch.Tensor, torch.Tensor]:
    """``(q, scale)`` with ``x' ~= q * scale.unsqueeze(1)`` for a 2-D ``x``, where ``x' = x *
    col_scale`` (float32, one rounding) or ``x``: per row ``scale = max |x'| / fmax`` (at
    least ``min_scale``, so a zero row stays zero), ``q = x' / scale`` in float32, clamped to
    +-fmax and rounded to ``dtype`` once. One float32 working copy of ``x``."""
    fmax = torch.finfo(dtype).max
    work = x.to(torch.float32, copy=True)
    if col_scale is not None:
        work.mul_(col_scale)
    amax = torch.linalg.vector_norm(work, float("inf"), dim=1)
    scale = amax.div_(fmax).clamp_(min=min_scale)
    q = work.div_(scale.unsqueeze(1)).clamp_(-fmax, fmax)
    return q.to(dtype), scale


@torch.library.custom_op("foundryx::fp8_quantize_rows", mutates_args=())
def fp8_quantize_rows(x: torch.Tensor, col_scale: torch.Tensor | None, dtype: torch.dtype,
                      min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`quantize_rows_eager` on a device without the kernel."""
    return quantize_rows_eager(x, dtype, col_scale, min_scale)


@fp8_quantize_rows.register_kernel("cuda")
def _on_a_gpu(x: torch.Tensor, col_scale: torch.Tensor | None, dtype: torch.dtype,
              min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    from foundryx.kernels import fp8_rows  # Triton (heavy): imported on a GPU's first call only

    return fp8_rows.quantize_rows(x.contiguous(), dtype, col_scale, min_scale)


@fp8_quantize_rows.register_fake
def _fake(x: torch.Tensor, col_scale: torch.Tensor | None, dtype: torch.dtype,
          min_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(x.shape, dtype=dtype, device=x.device),
            torch.empty(x.shape[0], dtype=torch.float32, device=x.device))


@functools.cache
def triton_missing() -> str | None:
    """None when Triton can be imported (torch's Linux wheels ship it); else why not."""
    if importlib.util.find_spec("triton") is None:
        return "Triton is not installed"
    return None
