"""Selective activation checkpointing (``activation_checkpointing.mode: selective``), after
torchtitan's selective op AC: a checkpointed block keeps the outputs of its expensive ops and
recomputes only the cheap ones in backward.

Kept: every other matmul's output (the first, third, ... of a block's forward: torchtitan's
rule, which keeps about half the GEMM work out of the recompute; an FP8 frozen base's
``_scaled_mm`` on tensor cores is a matmul here too), attention (SDPA's flash,
memory-efficient and cuDNN kernels) and ``max`` (float8's scales). Recomputed: everything else
(norms, activations, residual adds, casts, the other matmuls). Memory lies between no
checkpointing and a full checkpoint of the block; so does the recompute time.

A product added in place into an earlier matmul's output (``addmm_``: LoRA's one-pass adapter,
foundryx.models.peft.one_pass, writes ``scaling · t Bᵀ`` into the base layer's output) is not
counted and follows that matmul: kept with it (the kept output already holds the sum: the
recompute must neither recompute nor add it again), recomputed with it. Out of place (an
``addmm`` whose first operand is a whole product, not a bias: the one-pass adapter where the
base output is a view, as an FP8 tensor-core layer's is) it is not counted either, and is
recomputed: cheap (rank r), and the product it reads is kept or recomputed. Counted in a LoRA
block: each adapted layer's base product and its rank-r ``h Aᵀ``, so the base products are the
1st, 3rd, ... and every one of them is kept (benchmarks/RESULTS.md, the flagship section).
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn


def _save_list() -> set[Any]:
    aten = torch.ops.aten
    ops = {aten.mm.default, aten.addmm.default, aten.max.default,
           aten._scaled_dot_product_efficient_attention.default,
           aten._scaled_dot_product_flash_attention.default}
    for name in ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu",
                 "_scaled_mm"):
        op = getattr(aten, name, None)  # absent on older torch builds
        if op is not None:
            ops.add(op.default)
    return ops


MATMULS = ("mm", "addmm", "_scaled_mm")  # _scaled_mm: an FP8 frozen base on tensor cores


def _operands(func: Any, args: tuple) -> tuple[Any, Any]:
    """A matmul's two factors: ``addmm(bias, a, b)``, ``mm(a, b)``, ``_scaled_mm(a, b, ...)``."""
    return (args[1], args[2]) if func._overloadpacket.__name__ == "addmm" else (args[0], args[1])


def policy(counts: dict[Any, Any]):
    """The op policy for one checkpointed forward (and its recompute): MUST_SAVE for the save
    list's ops but every second matmul, PREFER_RECOMPUTE for the rest; an in-place ``addmm_``
    takes the decision of the latest matmul whose output has its shape (the one it adds into),
    an ``addmm`` into a whole product (not a bias) is recomputed and not counted."""
    from torch.utils.checkpoint import CheckpointPolicy

    save = _save_list()
    addmm, addmm_ = torch.ops.aten.addmm.default, torch.ops.aten.addmm_.default

    def decide(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        key = "recompute" if ctx.is_recompute else "forward"
        if func is addmm_:  # into a product made earlier in this forward: as that product
            keep = counts.get((key, tuple(args[0].shape)), False)
            return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE
        if func is addmm and args[0].dim() == 2 and args[0].shape[0] > 1:
            return CheckpointPolicy.PREFER_RECOMPUTE  # the same, out of place: recomputed
        is_mm = func in save and func._overloadpacket.__name__ in MATMULS
        if is_mm:
            counts[key] = counts.get(key, 0) + 1
        keep = func in save and not (is_mm and counts[key] % 2 == 0)
        if is_mm:
            a, b = _operands(func, args)
            counts[(key, (a.shape[0], b.shape[1]))] = keep
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return decide


def _context() -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    # allow_cache_entry_mutation: a kept in-place addmm_'s output is a view of the layer's
    # output, whose version autograd bumps as the custom function marks it dirty (no data
    # change); the kept values are the forward's (tests/test_selective_ac.py: LoRA gradients)
    return create_selective_checkpoint_contexts(policy({}), allow_cache_entry_mutation=True)


def checkpoint_selectively(module: nn.Module) -> None:
    """Recompute ``module``'s cheap ops in backward and keep its expensive ones' outputs."""
    from torch.utils.checkpoint import checkpoint

    inner = module.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(inner, *args, use_reentrant=False, context_fn=_context, **kwargs)

    module.forward = forward
