"""NF4 dequantization in one kernel (Triton): a frozen QLoRA weight decoded to a dense one.

torchao's NF4 stores a weight as 4-bit codes, two a byte (the first in the high half), an int8
scaler per block of ``block_size`` weights and, per group of ``scaler_block_size`` scalers, a
factor, plus one mean (double quantization). The weight is, in the NF4 tensor's dtype ``D``::

    scale = D(D(scaler / factor) + mean)     # the block's absmax, decoded
    w     = D(levels[code] * scale)          # levels: the 16 NF4 values, in D

then cast to the output dtype: ``NF4Tensor.get_original_weight().to(dtype)``, what
:func:`foundryx.kernels.nf4_dequant_op.nf4_dequantize_eager` computes with torch ops (ten a
chunk of blocks: the unpacked codes as int64 indices, the looked-up levels and their products
each a weight-sized tensor, about 18 bytes moved per weight). This kernel reads each byte of
codes once (half a byte a weight, plus a byte of scaler per block) and writes the output once.

Each program decodes ``BLOCK`` bytes (``2 * BLOCK`` weights): codes, their blocks' scalers and
factors gathered (a scaler serves ``block_size / 2`` neighbouring bytes: cache hits), the 16
levels gathered from a 16-entry table, the two halves interleaved and stored contiguously.
Every step is rounded as torch rounds it: float32 arithmetic (IEEE division, ``div_rn``),
rounded to ``D`` after each op (bfloat16 by rounding the float32 bits to nearest even, so that
the store's conversion is exact, on a GPU and in Triton's interpreter alike), then to the
output dtype. So the result is torchao's bit for bit (tests/test_nf4_dequant.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foundryx.kernels.nf4_dequant_op import KINDS, problem

BLOCK = 1024  # bytes a program (2,048 weights): 8 bytes a thread at 4 warps
WARPS = 4


@triton.jit
def _round(v, KIND: tl.constexpr):
    """``v`` (float32) rounded to the dtype of ``KIND`` (0: float32, itself; 1: bfloat16,
    nearest even on the bits, a NaN kept; 2: float16, by the hardware's conversion), as a
    float32."""
    if KIND == 1:
        bits = v.to(tl.uint32, bitcast=True)
        r = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        return tl.where(v != v, v, r)
    elif KIND == 2:
        return v.to(tl.float16).to(tl.float32)
    else:
        return v


@triton.jit
def nf4_dequant_kernel(DATA, SCALERS, FACTORS, MEAN, LEVELS, OUT, n_bytes,
                       HALF_BLOCK: tl.constexpr, SCALER_BLOCK: tl.constexpr,
                       NF4_KIND: tl.constexpr, OUT_KIND: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0).to(tl.int64)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n_bytes
    byte = tl.load(DATA + offs, mask=mask, other=0).to(tl.int32)
    block = offs // HALF_BLOCK
    q = tl.load(SCALERS + block, mask=mask, other=0).to(tl.float32)
    f = tl.load(FACTORS + block // SCALER_BLOCK, mask=mask, other=1.0).to(tl.float32)
    mean = tl.load(MEAN).to(tl.float32)
    scale = _round(_round(tl.math.div_rn(q, f), NF4_KIND) + mean, NF4_KIND)
    hi = _round(tl.load(LEVELS + (byte >> 4)).to(tl.float32) * scale, NF4_KIND)
    lo = _round(tl.load(LEVELS + (byte & 15)).to(tl.float32) * scale, NF4_KIND)
    out = tl.interleave(_round(hi, OUT_KIND), _round(lo, OUT_KIND))
    out_offs = pid * (2 * BLOCK) + tl.arange(0, 2 * BLOCK)
    tl.store(OUT + out_offs, out.to(OUT.dtype.element_ty), mask=out_offs < 2 * n_bytes)


def dequantize(data: torch.Tensor, scalers: torch.Tensor, factors: torch.Tensor,
               mean: torch.Tensor, levels: torch.Tensor, block_size: int,
               scaler_block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight, flat (``2 * data.numel()`` values of ``dtype``), on ``data``'s device (a GPU,
    or a CPU under ``TRITON_INTERPRET=1``). The parts as torchao holds them (contiguous):
    ``data`` uint8, ``scalers`` int8 (one a block), ``factors`` (one per ``scaler_block_size``
    scalers), ``mean`` (one value) and ``levels`` (16) in the NF4 dtype; :func:`problem` says
    what else this needs."""
    why = problem(data, scalers, factors, mean, levels, block_size, scaler_block_size, dtype)
    # problem() reads no values: this check costs no device synchronisation
    if why:
        raise ValueError(f"nf4 dequantize kernel: {why}")
    n_bytes = data.numel()
    out = torch.empty(2 * n_bytes, dtype=dtype, device=data.device)
    if n_bytes:
        nf4_dequant_kernel[(triton.cdiv(n_bytes, BLOCK),)](
            data, scalers, factors, mean, levels, out, n_bytes, HALF_BLOCK=block_size // 2,
            SCALER_BLOCK=scaler_block_size, NF4_KIND=KINDS[levels.dtype], OUT_KIND=KINDS[dtype],
            BLOCK=BLOCK, num_warps=WARPS)
    return out

