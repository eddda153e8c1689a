"""Rotary position embedding (RoPE, rotate-half form) of the queries and keys in one kernel
each way (Triton): Hugging Face Llama's ``apply_rotary_pos_emb``.

``y = x * cos + rotate_half(x) * sin`` per head, with ``rotate_half(x) = cat(-x2, x1)`` of
the head's two halves: ``y1 = x1 c1 - x2 s1``, ``y2 = x2 c2 + x1 s2``. Eager PyTorch runs
about ten kernels forward for q and k (two products, a negation, a concatenation and a sum
each, with slices) and as many again in a checkpointed recompute and backward; here one
launch rotates q and k (float32 math, one rounding) and one launch takes the gradients back
(the transposed rotation: ``dx1 = g1 c1 + g2 s2``, ``dx2 = g2 c2 - g1 s1``). ``cos`` and
``sin`` get no gradient (Hugging Face computes them without one).

q and k are ``[batch, heads, seq, head_dim]`` in any strides with a contiguous last dimension
(the model's ``view(...).transpose(1, 2)``); the outputs have the inputs' strides. One program
per (batch, position) row and head, q's heads first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate(X, Y, C, S, b, h, s, sxb, sxh, sxs, syb, syh, sys_, HALF, BACKWARD: tl.constexpr,
            BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    mask = offs < HALF
    x = X + b * sxb + h * sxh + s * sxs
    y = Y + b * syb + h * syh + s * sys_
    x1 = tl.load(x + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(x + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    c1 = tl.load(C + offs, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(C + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(S + offs, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(S + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    if BACKWARD:
        y1 = x1 * c1 + x2 * s2
        y2 = x2 * c2 - x1 * s1
    else:
        y1 = x1 * c1 - x2 * s1
        y2 = x2 * c2 + x1 * s2
    tl.store(y + offs, y1.to(Y.dtype.element_ty), mask=mask)
    tl.store(y + HALF + offs, y2.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def rope_kernel(Q, K, QO, KO, COS, SIN, SEQ, HQ, HALF,
                sqb, sqh, sqs, skb, skh, sks, sob, soh, sos, spb, sph, sps, scb, scs,
                BACKWARD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1).to(tl.int64)
    b = row // SEQ
    s = row % SEQ
    c = COS + b * scb + s * scs
    n = SIN + b * scb + s * scs
    if head < HQ:
        _rotate(Q, QO, c, n, b, head, s, sqb, sqh, sqs, sob, soh, sos, HALF, BACKWARD, BLOCK)
    else:
        _rotate(K, KO, c, n, b, head - HQ, s, skb, skh, sks, spb, sph, sps, HALF, BACKWARD,
                BLOCK)


def launch_config(head_dim: int) -> tuple[int, int]:
    """``(BLOCK, num_warps)``: a half of a head a block (a power of two), 1 to 4 warps."""
    block = triton.next_power_of_2(max(head_dim // 2, 16))
    return block, min(max(block // 64, 1), 4)


def rotate(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
           backward: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE of ``q`` and ``k`` (``[b, h, s, d]``; ``cos``, ``sin``: ``[b or 1, s, d]``), or
    with ``backward`` the gradients of its inputs from its outputs' (then ``q`` and ``k`` are
    those); on ``q``'s device (a GPU, or a CPU under ``TRITON_INTERPRET=1``)."""
    b, hq, s, d = q.shape
    hk = k.shape[1]
    if d % 2 or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(f"rope: heads of even size with a contiguous last dimension, not "
                         f"{tuple(q.shape)} {q.stride()} / {tuple(k.shape)} {k.stride()}")
    dtype = torch.promote_types(q.dtype, cos.dtype) if not backward else q.dtype
    qo = torch.empty_like(q, dtype=dtype)
    ko = torch.empty_like(k, dtype=torch.promote_types(k.dtype, cos.dtype) if not backward
                          else k.dtype)
    if cos.shape != sin.shape or cos.shape[-2:] != (s, d) or cos.shape[0] not in (1, b):
        raise ValueError(f"rope: cos and sin of [{b} or 1, {s}, {d}], not {tuple(cos.shape)}, "
                         f"{tuple(sin.shape)}")
    if cos.stride() != sin.stride() or cos.stride(-1) != 1:
        cos, sin = cos.contiguous(), sin.contiguous()
    if q.numel() and k.numel():
        block, warps = launch_config(d)
        rope_kernel[(b * s, hq + hk)](
            q, k, qo, ko, cos, sin, s, hq, d // 2, *q.stride()[:3], *k.stride()[:3],
            *qo.stride()[:3], *ko.stride()[:3], cos.stride(0) if cos.shape[0] > 1 else 0,
            cos.stride(1), BACKWARD=backward, BLOCK=block, num_warps=warps)
    return qo, ko
