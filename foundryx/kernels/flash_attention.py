"""FlashAttention-2 in Triton as a ``torch.autograd.Function``: :func:`flash_attention`.

Runs on NVIDIA (CUDA) and AMD (ROCm) GPUs, and on CPU tensors in Triton's interpreter
(``TRITON_INTERPRET=1`` set before this module is imported; for tests). Tile sizes, and which
backward runs (two kernels, or FlashAttention-2's one with dQ added atomically), come from
:mod:`foundryx.kernels.tuning`.
"""

from __future__ import annotations

import functools
import logging
import math

import torch
import triton

from foundryx.kernels import tuning
from foundryx.kernels.flash_bwd import (
    flash_bwd_atomic_kernel,
    flash_bwd_dkdv_kernel,
    flash_bwd_dq_kernel,
    flash_bwd_preprocess,
)
from foundryx.kernels.flash_common import INTERPRETED
from foundryx.kernels.flash_fwd import flash_fwd_kernel

LOG2E = 1.4426950408889634
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256
log = logging.getLogger(__name__)


def unsupported(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0
) -> str | None:
    """Why :func:`flash_attention` cannot run on these inputs here, or None if it can."""
    if q.device.type == "cpu" and not INTERPRETED:
        return (
            "the tensors are on the CPU and Triton kernels need a CUDA or ROCm GPU "
            "(tests run them on CPU with TRITON_INTERPRET=1 set before foundryx.kernels is "
            "imported, which is slow)"
        )
    if q.device.type == "cuda" and INTERPRETED:
        return "TRITON_INTERPRET=1 is set, so the kernel runs only on CPU tensors; unset it"
    if q.device.type not in ("cpu", "cuda"):
        return f"device {q.device.type!r} is not supported; Triton needs a CUDA or ROCm GPU"
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return "q, k, v must be 4-D: (batch, seq, heads, head_dim)"
    if not (q.dtype == k.dtype == v.dtype) or q.dtype not in DTYPES:
        return (
            f"q, k, v must share one dtype of fp16, bf16, fp32; got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    if INTERPRETED and q.dtype == torch.bfloat16:
        return "Triton's interpreter multiplies bf16 tiles as raw bits; use fp16 or fp32 on CPU"
    if q.shape[-1] > MAX_HEAD_DIM:
        return f"head_dim {q.shape[-1]} is above {MAX_HEAD_DIM}"
    if q.shape[1] != k.shape[1]:
        return (
            f"query length {q.shape[1]} differs from key length {k.shape[1]} (self-attention only)"
        )
    if q.shape[2] % k.shape[2]:
        return f"n_heads {q.shape[2]} is not a multiple of kv_n_heads {k.shape[2]}"
    if dropout_p > 0:
        return "attention dropout is not implemented in the Triton kernel (attn_pdrop must be 0)"
    return None


def document_bounds(sequence_id: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """First index and one-past-last index of each token's document, both (batch, seq) int32.

    A document is a maximal run of equal ``sequence_id`` values (as packing emits them).
    """
    seq = sequence_id.shape[1]
    idx = torch.arange(seq, device=sequence_id.device).expand_as(sequence_id)
    change = sequence_id[:, 1:] != sequence_id[:, :-1]
    starts = torch.cat([torch.ones_like(change[:, :1]), change], dim=1)
    ends = torch.cat([change, torch.ones_like(change[:, :1])], dim=1)
    doc_start = torch.where(starts, idx, 0).cummax(dim=1).values
    doc_end = torch.where(ends, idx + 1, seq).flip(1).cummin(dim=1).values.flip(1)
    return doc_start.to(torch.int32).contiguous(), doc_end.to(torch.int32).contiguous()


def cu_seqlens_bounds(cu_seqlens: torch.Tensor, total: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`document_bounds` of ``total`` tokens split at cumulative lengths ``cu_seqlens``."""
    cu = cu_seqlens.to(torch.int64)
    doc = torch.searchsorted(cu, torch.arange(total, device=cu.device), right=True) - 1
    return cu[doc].to(torch.int32)[None], cu[doc + 1].to(torch.int32)[None]


@functools.cache
def _placeholders(device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Tensors passed for absent features (the kernels never read them)."""
    unused = torch.zeros(1, 1, dtype=torch.int32, device=device)
    return unused, unused.to(torch.int8), unused.float()


class _Args:
    """Everything but q, k, v that the kernels take, prepared once per call."""

    def __init__(self, q, k, bounds, kpm, slopes, scale, causal, window):
        self.group = q.shape[2] // k.shape[2]
        self.scale = scale
        self.window = window or 0
        self.block_d = max(16, triton.next_power_of_2(q.shape[-1]))
        self.bwd = _bwd_mode(self.block_d, q.device)
        unused_int, unused_int8, unused_float = _placeholders(q.device)  # for absent features
        self.doc_start, self.doc_end = bounds if bounds is not None else (unused_int,) * 2
        self.kpm = kpm if kpm is not None else unused_int8
        self.slopes = slopes if slopes is not None else unused_float
        self.batch_strides = (self.doc_start.stride(0), self.kpm.stride(0))
        self.flags = {
            "CAUSAL": causal,
            "HAS_DOCS": bounds is not None,
            "HAS_WINDOW": window is not None,
            "HAS_KPM": kpm is not None,
            "HAS_ALIBI": slopes is not None,
            # fp32 inputs multiply in full precision (Triton's default would be TF32)
            "DOT_PRECISION": "ieee" if q.dtype == torch.float32 else None,
        }

    def launch(self, kernel, kind, grid_rows, grid_heads, tensors, strided, scalars, head_dim):
        """``kernel[grid](*tensors, masks, strides of each of strided, *scalars, constexprs)``
        with the tile config of ``kind`` and ``grid_rows`` tiled by its block_m or block_n."""
        cfg = tuning.config(kind, self.block_d, tensors[0].device)
        tile = cfg.block_n if kind in ("bwd_dkdv", "bwd_atomic") else cfg.block_m
        strides = [s for t in strided for s in (t.stride(0), t.stride(1), t.stride(2))]
        kernel[(triton.cdiv(grid_rows, tile), grid_heads)](
            *tensors, self.doc_start, self.doc_end, self.kpm, self.slopes,
            *strides, *self.batch_strides, *scalars,
            HEAD_DIM=head_dim, BLOCK_D=self.block_d, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
            **self.flags, **cfg.launch_options(),
        )  # fmt: skip


def _bwd_mode(block_d: int, device: torch.device) -> str:
    """The tuning table's backward, except "split" under deterministic algorithms (the atomic
    one adds dQ in an order that varies run to run)."""
    mode = tuning.bwd_mode(block_d, device)
    if mode == "atomic" and torch.are_deterministic_algorithms_enabled():
        _say_deterministic()
        return "split"
    return mode


@functools.cache
def _say_deterministic() -> None:
    log.info(
        "flash_attention: deterministic algorithms are on, so the backward runs the split "
        "kernels (dK/dV, then dQ) instead of the tuning table's atomic one"
    )


def _forward(q, k, v, a: _Args):
    batch, seq, n_heads, head_dim = q.shape
    o = torch.empty_like(q, memory_format=torch.contiguous_format)
    lse = torch.empty(batch, n_heads, seq, device=q.device, dtype=torch.float32)
    scalars = (seq, n_heads, a.group, a.scale * LOG2E, a.window)
    a.launch(
        flash_fwd_kernel, "fwd", seq, batch * n_heads, (q, k, v, o, lse), (q, k, v, o), scalars,
        head_dim,
    )  # fmt: skip
    return o, lse


def _backward(do, q, k, v, o, lse, a: _Args):
    batch, seq, n_heads, head_dim = q.shape
    kv_heads = k.shape[2]
    do = do if do.stride(-1) == 1 else do.contiguous()
    dk, dv = (torch.empty_like(t, memory_format=torch.contiguous_format) for t in (k, v))
    delta = torch.empty_like(lse)
    rows = 64
    flash_bwd_preprocess[(triton.cdiv(seq, rows), batch * n_heads)](
        o, do, delta, o.stride(0), o.stride(1), o.stride(2), do.stride(0), do.stride(1),
        do.stride(2), seq, n_heads, HEAD_DIM=head_dim, BLOCK_D=a.block_d, BLOCK_M=rows,
    )  # fmt: skip
    tail = (a.scale * LOG2E, a.scale, a.window)
    if a.bwd == "atomic":
        dq = torch.zeros(q.shape, device=q.device, dtype=torch.float32)  # summed into
        a.launch(
            flash_bwd_atomic_kernel, "bwd_atomic", seq, batch * kv_heads,
            (q, k, v, do, lse, delta, dk, dv, dq), (q, k, v, do, dk, dv, dq),
            (seq, n_heads, kv_heads, a.group, *tail), head_dim,
        )  # fmt: skip
        return dq.to(q.dtype), dk, dv
    dq = torch.empty_like(q, memory_format=torch.contiguous_format)
    a.launch(
        flash_bwd_dkdv_kernel, "bwd_dkdv", seq, batch * kv_heads,
        (q, k, v, do, lse, delta, dk, dv), (q, k, v, do, dk, dv),
        (seq, n_heads, kv_heads, a.group, *tail), head_dim,
    )  # fmt: skip
    a.launch(
        flash_bwd_dq_kernel, "bwd_dq", seq, batch * n_heads,
        (q, k, v, do, lse, delta, dq), (q, k, v, do, dq), (seq, n_heads, a.group, *tail),
        head_dim,
    )  # fmt: skip
    return dq, dk, dv


class FlashAttentionFunction(torch.autograd.Function):
    """Forward saves q, k, v, the output and the logsumexp; backward recomputes P from them."""

    @staticmethod
    def forward(ctx, q, k, v, args: _Args):
        o, lse = _forward(q, k, v, args)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.args = args
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _backward(do, q, k, v, o, lse, ctx.args)
        return dq, dk, dv, None


def flash_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    sequence_id: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """FlashAttention-2 forward (and backward through autograd) in Triton.

    q (batch, seq, n_heads, head_dim), k/v (batch, seq, kv_n_heads, head_dim); with
    ``cu_seqlens`` (n_docs + 1 cumulative lengths) q/k/v may instead be (total, heads,
    head_dim) as in flash-attn's varlen API. Masks as in ``torch_attention``: causal;
    ``sequence_id`` (batch, seq) packed documents (runs of one id); ``alibi_slopes``
    (n_heads,) adds ``-slope * |i - j|``; ``key_padding_mask`` (batch, seq), True = token;
    ``sliding_window`` w keeps ``|i - j| <= w``. Returns q's shape, in q's dtype.
    """
    varlen = cu_seqlens is not None and q.dim() == 3
    if varlen:
        q, k, v = q[None], k[None], v[None]
    problem = unsupported(q, k, v)
    if problem:
        raise ValueError(f"flash_attention: {problem}")
    if sequence_id is not None and cu_seqlens is not None:
        raise ValueError("flash_attention: give sequence_id or cu_seqlens, not both")
    bounds = None
    if sequence_id is not None:
        bounds = document_bounds(sequence_id.to(q.device))
    elif cu_seqlens is not None:
        if q.shape[0] != 1:
            raise ValueError(
                "flash_attention: cu_seqlens needs batch 1 or (total, heads, dim) inputs"
            )
        bounds = cu_seqlens_bounds(cu_seqlens.to(q.device), q.shape[1])
    kpm = None
    if key_padding_mask is not None:
        kpm = key_padding_mask.to(device=q.device, dtype=torch.int8).contiguous()
    slopes = None
    if alibi_slopes is not None:
        slopes = alibi_slopes.to(device=q.device, dtype=torch.float32).contiguous()
        if slopes.shape != (q.shape[2],):
            raise ValueError(
                f"flash_attention: alibi_slopes must be ({q.shape[2]},), got {tuple(slopes.shape)}"
            )
    scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(q.shape[-1])
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    args = _Args(q, k, bounds, kpm, slopes, scale, causal, sliding_window)
    out = FlashAttentionFunction.apply(q, k, v, args)
    return out[0] if varlen else out
