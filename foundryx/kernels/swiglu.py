"""SwiGLU's product ``silu(gate) * up`` and its backward, each in one kernel (Triton): the
activation of Llama's MLP, ``down(silu(gate(x)) * up(x))``.

Eager PyTorch runs ``silu`` and the product as two kernels forward (``silu(gate)`` written and
read back at the MLP's hidden width) and keeps ``gate``, ``silu(gate)`` and ``up`` for backward,
which takes two products and ``silu``'s backward: three to four more kernels. Here the forward
reads ``gate`` and ``up`` once and writes the product (float32 math, one rounding), and the
backward reads ``dy``, ``gate`` and ``up`` and writes ``dgate`` and ``dup``, recomputing
``silu(gate)`` (only ``gate`` and ``up`` are kept).

Elementwise over the flattened tensors, ``BLOCK`` elements a program.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
WARPS = 4


@triton.jit
def swiglu_fwd_kernel(G, U, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def swiglu_bwd_kernel(DY, G, U, DG, DU, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.sigmoid(g)
    silu = g * s
    tl.store(DU + offs, (dy * silu).to(DU.dtype.element_ty), mask=mask)
    # d silu / dg = s + g s (1 - s) = s (1 + g (1 - s))
    tl.store(DG + offs, (dy * u * s * (1.0 + g * (1.0 - s))).to(DG.dtype.element_ty), mask=mask)


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(-1)


def forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` on ``gate``'s device (a GPU, or a CPU under ``TRITON_INTERPRET=1``),
    in the promotion of the two dtypes."""
    if gate.shape != up.shape:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    y = torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype),
                    device=gate.device)
    n = y.numel()
    if n:
        swiglu_fwd_kernel[(triton.cdiv(n, BLOCK),)](_flat(gate), _flat(up), y.view(-1), n,
                                                    BLOCK=BLOCK, num_warps=WARPS)
    return y


def backward(dy: torch.Tensor, gate: torch.Tensor,
             up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(dgate, dup)`` in ``gate``'s and ``up``'s dtypes."""
    dg = torch.empty(gate.shape, dtype=gate.dtype, device=gate.device)
    du = torch.empty(up.shape, dtype=up.dtype, device=up.device)
    n = dg.numel()
    if n:
        swiglu_bwd_kernel[(triton.cdiv(n, BLOCK),)](_flat(dy), _flat(gate), _flat(up),
                                                    dg.view(-1), du.view(-1), n, BLOCK=BLOCK,
                                                    num_warps=WARPS)
    return dg, du
