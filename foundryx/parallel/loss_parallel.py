"""Loss parallel (torchtitan's): an LM head's logits left split by vocabulary over the TP ranks
in training, the loss computed on them inside torch's ``loss_parallel`` (forward and backward),
and whole logits wherever something reads them (eval, ICL tasks, Composer's training metrics).
Applied by :mod:`foundryx.parallel.tp` from a model's plan."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle


class SplitLogits(ParallelStyle):
    """A parallel style (a forward hook on the LM head): its DTensor logits stay split by
    vocabulary in training (the loss runs on them, :func:`loss_parallel`), and are gathered
    whole in eval, where metrics and ICL tasks read them."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(_logits_for_mode)
        return module


def _logits_for_mode(module: nn.Module, args: Any, out: Any) -> Any:
    return out if module.training else out.full_tensor()


def whole_logits(eval_forward: Any) -> Any:
    """A ComposerModel's ``eval_forward`` whose outputs hold whole logits: Composer's training
    metrics are computed on the training step's outputs, whose logits are split (gathered here,
    without autograd, once per step)."""
    from torch.distributed.tensor import DTensor

    def whole(batch: Any, outputs: Any = None) -> Any:
        out = eval_forward(batch, outputs)  # the logits (Composer's HF models), or a dict
        if isinstance(out, DTensor):
            return out.detach().full_tensor()
        if isinstance(out, dict) and isinstance(out.get("logits"), DTensor):
            out["logits"] = out["logits"].detach().full_tensor()
        return out

    return whole


def loss_parallel(fn: Any) -> Any:
    """``fn`` (a loss called as ``fn(logits=..., labels=..., ...)``) run on vocabulary-split
    DTensor logits inside torch's ``loss_parallel`` context, forward and backward (each rank
    holds its 1/tp of the logits and of their gradient; the loss is the same number); whole
    logits go to ``fn`` as they are."""
    from torch.distributed.tensor import DTensor

    def loss(logits: Any = None, labels: Any = None, **kwargs: Any) -> Any:
        if not isinstance(logits, DTensor):
            return fn(logits=logits, labels=labels, **kwargs)
        return _ParallelLoss.apply(logits, lambda x: fn(logits=x, labels=labels, **kwargs))

    return loss


class _ParallelLoss(torch.autograd.Function):
    """The loss's own graph built and run backward inside ``loss_parallel`` (which the caller's
    ``backward()``, Composer's, does not enter)."""

    @staticmethod
    def forward(ctx: Any, logits: Any, compute: Any) -> torch.Tensor:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor.parallel import loss_parallel as context

        with torch.enable_grad(), context():
            x = logits.detach().requires_grad_(True)
            out = compute(x)
            out = out.full_tensor() if isinstance(out, DTensor) else out
        ctx.inner = (x, out)
        return out.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[Any, None]:
        from torch.distributed.tensor.parallel import loss_parallel as context

        x, out = ctx.inner
        ctx.inner = None
        with context():
            torch.autograd.backward(out, grad)
        return x.grad, None
