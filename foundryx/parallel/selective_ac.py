"""Selective activation checkpointing (``activation_checkpointing.mode: selective``), after
torchtitan's selective op AC: a checkpointed block keeps the outputs of its expensive ops and
recomputes only the cheap ones in backward.

Kept: every other matmul's output (the first, third, ... of a block's forward: torchtitan's
rule, which keeps about half the GEMM work out of the recompute), attention (SDPA's flash,
memory-efficient and cuDNN kernels) and ``max`` (float8's scales). Recomputed: everything else
(norms, activations, residual adds, casts, the other matmuls). Memory lies between no
checkpointing and a full checkpoint of the block; so does the recompute time.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from typing import Any

import torch
from torch import nn


def _save_list() -> set[Any]:
    aten = torch.ops.aten
    ops = {aten.mm.default, aten.addmm.default, aten.max.default,
           aten._scaled_dot_product_efficient_attention.default,
           aten._scaled_dot_product_flash_attention.default}
    for name in ("_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu"):
        op = getattr(aten, name, None)  # absent on older torch builds
        if op is not None:
            ops.add(op.default)
    return ops


MATMULS = ("mm", "addmm")


def policy(counts: dict[str, int]):
    """The op policy for one checkpointed forward (and its recompute): MUST_SAVE for the save
    list's ops but every second matmul, PREFER_RECOMPUTE for the rest."""
    from torch.utils.checkpoint import CheckpointPolicy

    save = _save_list()

    def decide(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
        key = "recompute" if ctx.is_recompute else "forward"
        is_mm = func in save and func._overloadpacket.__name__ in MATMULS
        if is_mm:
            counts[key] += 1
        keep = func in save and not (is_mm and counts[key] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return decide


def _context() -> Any:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(policy(defaultdict(int)))


def checkpoint_selectively(module: nn.Module) -> None:
    """Recompute ``module``'s cheap ops in backward and keep its expensive ones' outputs."""
    from torch.utils.checkpoint import checkpoint

    inner = module.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(inner, *args, use_reentrant=False, context_fn=_context, **kwargs)

    module.forward = forward
