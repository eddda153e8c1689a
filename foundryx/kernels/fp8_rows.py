"""Per-row FP8 quantization in one kernel: the activations of a frozen FP8 base's GEMMs.

``quantize_rows(x, dtype, col_scale=None, min_scale)`` returns ``(q, scale)`` with
``x' ~= q * scale[:, None]``, where ``x' = x * col_scale[None, :]`` (float32, one rounding) or
``x`` itself, per row ``scale = max(max_k |x'| / fmax, min_scale)`` and
``q = round(clamp(x' / scale, -fmax, fmax))`` in ``dtype`` (e4m3fn, fmax 448; e4m3fnuz, 240):
exactly what :func:`foundryx.kernels.fp8_rows_op.quantize_rows_eager` computes with five
torch ops and a float32 copy of ``x``, which move about 25 bytes per element where this kernel
moves 5 (``x`` read twice in bf16, ``q`` written once). On an H100 the quantization of an 8B
LoRA step's activations and gradients goes from ~0.22 s to ~0.03 s on paper (669 kernels,
95 GB: benchmarks/op_census.py; benchmarks/RESULTS.md, the flagship step).

One program per row: a pass for the row's largest magnitude, then a pass that scales, clamps,
rounds and stores. The division is IEEE's (``div_rn``, as torch's), and the rounding to 3
mantissa bits, nearest-even, is done on the float32 bits before the store (then the store's
conversion is exact): the hardware's conversion does the same on NVIDIA and AMD, and Triton's
interpreter, which rounds ties away from zero and drops a mantissa's carry into the exponent
(126.1 -> 64), tests the same code on a CPU. A row with a NaN gets a NaN scale, so its row of
the GEMM's output is NaN, as with the eager ops (its ``q`` is NaN on a GPU; the interpreter
converts NaN to 384).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# dtype -> (fmax, the smallest normal exponent): below 2**min_exp values are multiples of
# 2**(min_exp - 3) (subnormals)
FORMATS = {torch.float8_e4m3fn: (448.0, -6)}
if hasattr(torch, "float8_e4m3fnuz"):
    FORMATS[torch.float8_e4m3fnuz] = (240.0, -7)


@triton.jit
def _round_e4m3(v, MIN_EXP: tl.constexpr):
    """``v`` (float32, within fmax) rounded to the nearest e4m3 value, ties to even (a NaN
    stays a NaN)."""
    bits = v.to(tl.uint32, bitcast=True)
    sign = bits & 0x80000000
    # normal: keep 3 of float32's 23 mantissa bits, nearest-even (a carry moves the exponent)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    # subnormal: adding 2**(MIN_EXP + 20) makes float32's last place 2**(MIN_EXP - 3), so the
    # sum rounds |v| to that step, nearest-even; the subtraction is exact
    big: tl.constexpr = 2.0 ** (MIN_EXP + 20)
    mag = tl.abs(v)
    sub = ((mag + big) - big).to(tl.uint32, bitcast=True) | sign
    return tl.where(mag >= 2.0 ** MIN_EXP, normal, sub.to(tl.float32, bitcast=True))


@triton.jit
def _load(x_row, COL, k0, K, HAS_COL: tl.constexpr, BLOCK_K: tl.constexpr):
    """Columns ``k0 .. k0 + BLOCK_K`` of a row in float32 (times their column scales), and
    which of them exist."""
    offs = k0 + tl.arange(0, BLOCK_K)
    mask = offs < K
    v = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_COL:
        v = v * tl.load(COL + offs, mask=mask, other=0.0)
    return v, offs, mask


@triton.jit
def fp8_rows_kernel(X, COL, Q, S, K, stride_xm, stride_qm, FMAX: tl.constexpr,
                    MIN_SCALE: tl.constexpr, MIN_EXP: tl.constexpr, HAS_COL: tl.constexpr,
                    BLOCK_K: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    x_row = X + row * stride_xm
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        v, _, _ = _load(x_row, COL, k0, K, HAS_COL, BLOCK_K)
        amax = tl.maximum(amax, tl.abs(v), propagate_nan=tl.PropagateNan.ALL)
    nan = tl.max((amax != amax).to(tl.int32), axis=0)
    scale = tl.maximum(tl.math.div_rn(tl.max(amax, axis=0), FMAX), MIN_SCALE)
    scale = tl.where(nan > 0, float("nan"), scale)
    tl.store(S + row, scale)
    q_row = Q + row * stride_qm
    for k0 in range(0, K, BLOCK_K):
        v, offs, mask = _load(x_row, COL, k0, K, HAS_COL, BLOCK_K)
        q = tl.clamp(tl.math.div_rn(v, scale), -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL)
        tl.store(q_row + offs, _round_e4m3(q, MIN_EXP).to(Q.dtype.element_ty), mask=mask)


def launch_config(k: int) -> tuple[int, int]:
    """``(BLOCK_K, num_warps)`` for rows of ``k`` elements: a whole row of up to 4096 held at
    once (16 values a thread at 8 warps), longer rows in steps of 4096."""
    block = min(triton.next_power_of_2(max(k, 16)), 4096)
    return block, (8 if block >= 2048 else 4)


def quantize_rows(x: torch.Tensor, dtype: torch.dtype, col_scale: torch.Tensor | None = None,
                  min_scale: float = 1e-12) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel on a 2-D ``x`` (rows contiguous in their last dimension) on its device: a
    GPU, or a CPU under ``TRITON_INTERPRET=1``."""
    if dtype not in FORMATS:
        raise TypeError(f"fp8 rows: {dtype} is not an e4m3 format ({', '.join(map(str, FORMATS))})")
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"fp8 rows: a 2-D tensor with contiguous rows is needed, not {x.shape} "
                         f"with strides {x.stride()}")
    m, k = x.shape
    q = torch.empty((m, k), dtype=dtype, device=x.device)
    scale = torch.empty(m, dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    fmax, min_exp = FORMATS[dtype]
    block, warps = launch_config(k)
    col = col_scale.to(torch.float32).contiguous() if col_scale is not None else scale
    fp8_rows_kernel[(m,)](x, col, q, scale, k, x.stride(0), q.stride(0), FMAX=fmax,
                          MIN_SCALE=min_scale, MIN_EXP=min_exp, HAS_COL=col_scale is not None,
                          BLOCK_K=block, num_warps=warps)
    return q, scale
