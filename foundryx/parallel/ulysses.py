"""Ulysses' all-to-alls for context parallelism (:mod:`foundryx.parallel.cp`): a rank's shard of
the sequence for all heads traded for the whole sequence of its share of the heads, and back,
and a sequence's shards gathered whole; each differentiable (the backward is the inverse
collective) and run eagerly inside a compiled block (``torch.compiler.disable``).
``all_to_all_single`` and ``all_gather``: gloo and NCCL both run them, so CPU ranks too."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as tdist

__all__ = ["gather_seq", "heads_to_seq", "seq_to_heads"]


def _seq_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """(b, s/n, h, d) -> (b, s, h/n, d): the rank's shard of all heads -> its heads' whole
    sequence (rank i gets heads [i h/n, (i+1) h/n))."""
    n = tdist.get_world_size(group)
    b, s, h, d = x.shape
    send = x.reshape(b, s, n, h // n, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = torch.empty_like(send)
    tdist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 0, 2, 3, 4).reshape(b, n * s, h // n, d)


def _heads_to_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    """The inverse: (b, s, h/n, d) -> (b, s/n, h, d)."""
    n = tdist.get_world_size(group)
    b, s, h, d = x.shape
    send = x.reshape(b, n, s // n, h, d).permute(1, 0, 2, 3, 4).contiguous()
    recv = torch.empty_like(send)
    tdist.all_to_all_single(recv, send, group=group)
    return recv.permute(1, 2, 0, 3, 4).reshape(b, s // n, n * h, d)


class _Swap(torch.autograd.Function):
    """One all-to-all forward (``there``), its inverse backward (``back``)."""

    @staticmethod
    def forward(ctx, x, group, there, back):  # noqa: D102
        ctx.group, ctx.back = group, back
        return there(x, group)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        return ctx.back(grad.contiguous(), ctx.group), None, None, None


class _GatherSeq(torch.autograd.Function):
    """Shards along dim 1 gathered whole on every rank; backward: the gradient summed over
    the ranks (each rank's copy of the whole took its own), this rank's slice of it."""

    @staticmethod
    def forward(ctx, x, group):  # noqa: D102
        ctx.group = group
        n = tdist.get_world_size(group)
        parts = [torch.empty_like(x) for _ in range(n)]
        tdist.all_gather(parts, x.contiguous(), group=group)
        ctx.shard = x.shape[1]
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad):  # noqa: D102
        grad = grad.contiguous()
        tdist.all_reduce(grad, group=ctx.group)
        r = tdist.get_rank(ctx.group)
        return grad[:, r * ctx.shard:(r + 1) * ctx.shard], None


@torch.compiler.disable  # collectives in an autograd Function: run eagerly inside a compiled block
def seq_to_heads(x: torch.Tensor, group: Any) -> torch.Tensor:
    """Differentiable :func:`_seq_to_heads` over ``group`` (one all-to-all each way)."""
    return _Swap.apply(x, group, _seq_to_heads, _heads_to_seq)


@torch.compiler.disable
def heads_to_seq(x: torch.Tensor, group: Any) -> torch.Tensor:
    return _Swap.apply(x, group, _heads_to_seq, _seq_to_heads)


@torch.compiler.disable
def gather_seq(x: torch.Tensor | None, group: Any, grad: bool = False) -> torch.Tensor | None:
    """``x`` (b, s/n, ...) gathered to (b, s, ...) over ``group``; differentiable with ``grad``."""
    if x is None:
        return None
    if grad:
        return _GatherSeq.apply(x, group)
    parts = [torch.empty_like(x) for _ in range(tdist.get_world_size(group))]
    tdist.all_gather(parts, x.contiguous(), group=group)
    return torch.cat(parts, dim=1)
