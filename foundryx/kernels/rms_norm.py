"""An RMS norm's forward and backward, each in one kernel (Triton): Hugging Face's LlamaRMSNorm
and its copies (Mistral, Qwen2/3, Phi-3).

``y = weight * (x_f32 * rstd).to(x.dtype)`` with ``rstd = 1 / sqrt(mean(x_f32²) + eps)`` per
row, as the module computes it (the normalized row rounded to the input's dtype, then the
product with the weight rounded to ``y``'s dtype, the promotion of the two); the forward also
writes ``rstd`` (float32, one a row), which is all the backward needs besides ``x``. The
module's eager form runs six or seven elementwise kernels each way and keeps a float32 copy of
``x`` for backward; here the forward reads ``x`` and the weight once and writes ``y`` and
``rstd``, and the backward reads ``dy``, ``x``, the weight and ``rstd`` once and writes ``dx``
(and, only where the weight trains, one float32 partial ``dweight`` per program, summed by
the caller: under LoRA the norms' weights are frozen and that part is skipped).

One program per row in the forward: a whole row in registers (rows up to 65,536 wide; a
Llama-3.1-8B row of 4,096 is 16 values a thread at 8 warps). The backward's programs each take
every ``n_programs``-th row, so that a program's ``dweight`` partial sums many rows.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_ROW = 65536


@triton.jit
def rms_norm_fwd_kernel(X, W, Y, RSTD, N, stride_x, stride_y, eps, BLOCK_N: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=0) / N + eps)
    tl.store(RSTD + row, rstd)
    normed = (x * rstd).to(X.dtype.element_ty).to(tl.float32)  # the module's cast back
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + offs, (w * normed).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def rms_norm_bwd_kernel(DY, X, W, RSTD, DX, DW, M, N, stride_dy, stride_x, stride_dx,
                        HAS_DX: tl.constexpr, HAS_DW: tl.constexpr, BLOCK_N: tl.constexpr):
    pid = tl.program_id(0)
    step = tl.num_programs(0)
    offs = tl.arange(0, BLOCK_N)
    mask = offs < N
    w = tl.load(W + offs, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros([BLOCK_N], dtype=tl.float32)
    first = pid.to(tl.int64)
    for r in range(pid, M, step):
        row = first + (r - pid)  # in 64 bits (a row's offset can pass 2**31)
        x = tl.load(X + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + offs, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        normed = x * rstd
        if HAS_DW:  # y = w * normed.to(x.dtype): dw sums dy * normed (as y's inputs held it)
            dw += dy * normed.to(X.dtype.element_ty).to(tl.float32)
        if HAS_DX:  # d(normed)/dx = rstd (I - normed normedᵀ / N), applied to dy * w
            g = dy * w
            dot = tl.sum(g * normed, axis=0) / N
            dx = (g - normed * dot) * rstd
            tl.store(DX + row * stride_dx + offs, dx.to(DX.dtype.element_ty), mask=mask)
    if HAS_DW:
        tl.store(DW + pid.to(tl.int64) * N + offs, dw, mask=mask)


def launch_config(n: int) -> tuple[int, int]:
    """``(BLOCK_N, num_warps)`` for rows of ``n``: the whole row at once, 4 to 16 warps so
    that a thread holds at most 16 values of each row tensor."""
    if n > MAX_ROW:
        raise ValueError(f"rms norm kernel: rows of at most {MAX_ROW} values, not {n}")
    block = triton.next_power_of_2(max(n, 16))
    return block, min(max(block // 512, 4), 16)


def _rows(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def forward(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor,
                                                                         torch.Tensor]:
    """``(y, rstd)`` on ``x``'s device (a GPU, or a CPU under ``TRITON_INTERPRET=1``); ``y``
    has ``x``'s shape, ``rstd`` one float32 a row (``x``'s leading dimensions)."""
    rows = _rows(x)
    m, n = rows.shape
    y = torch.empty((m, n), dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    if m:
        block, warps = launch_config(n)
        rms_norm_fwd_kernel[(m,)](rows, weight.contiguous(), y, rstd, n, rows.stride(0),
                                  y.stride(0), float(eps), BLOCK_N=block, num_warps=warps)
    return y.view(x.shape), rstd.view(x.shape[:-1])


def programs(m: int, device: torch.device) -> int:
    """The backward's programs for ``m`` rows: with ``dweight``, 4 a multiprocessor (each
    sums its rows' part; 8 under the interpreter), else one a row."""
    if device.type == "cuda":
        sms = torch.cuda.get_device_properties(device).multi_processor_count
        return max(1, min(m, 4 * sms))
    return max(1, min(m, 8))


def backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
             want_dx: bool, want_dw: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(dx, dweight)``, each None where not wanted; ``dweight`` in the weight's dtype."""
    rows, grads = _rows(x), _rows(dy)
    m, n = rows.shape
    dx = torch.empty((m, n), dtype=x.dtype, device=x.device) if want_dx else None
    nprog = programs(m, x.device) if want_dw else max(m, 1)
    dw = torch.zeros((nprog, n), dtype=torch.float32, device=x.device) if want_dw else None
    if m and (want_dx or want_dw):
        block, warps = launch_config(n)
        rms_norm_bwd_kernel[(nprog,)](
            grads, rows, weight.contiguous(), rstd.reshape(-1).contiguous(),
            dx if dx is not None else rows, dw if dw is not None else rstd, m, n,
            grads.stride(0), rows.stride(0), dx.stride(0) if dx is not None else 0,
            HAS_DX=want_dx, HAS_DW=want_dw, BLOCK_N=block, num_warps=warps)
    return (dx.view(x.shape) if dx is not None else None,
            dw.sum(0).to(weight.dtype) if dw is not None else None)
