"""``gradient_clipping``: Composer's GradientClipping, with the gradient norm computed over
gradients that live on different device meshes.

Under ``parallelism.tp`` some parameters are DTensors on the 2-D (shard, tp) mesh (the split
layers) and others on the shard mesh alone (the embedding, LoRA's replicated halves); torch's
``clip_grad_norm_`` stacks their norms and fails ("All operands in aten.stack.default must have
the same mesh"). Here the norm of each mesh's gradients is reduced to a plain number first, and
those are combined: the same total norm (p-norms and the max norm alike), the same clipping.
``clipping_type: adaptive`` is per parameter and stays Composer's.
"""

from __future__ import annotations

from typing import Any

import torch
from composer.algorithms import GradientClipping as _ComposerGradientClipping
from composer.core import Event, State
from composer.loggers import Logger


def _by_mesh(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` grouped by the device mesh they are DTensors on (plain tensors: one group);
    torch's foreach kernels take one mesh at a time."""
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault(t.device_mesh if isinstance(t, DTensor) else None, []).append(t)
    return list(groups.values())


def total_norm(grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
    """The ``norm_type`` norm of all ``grads`` together, as a plain tensor (DTensor gradients
    on any mix of meshes)."""
    from torch.distributed.tensor import DTensor

    norms = []
    for group in _by_mesh(grads):
        n = torch.nn.utils.get_total_norm(group, norm_type)
        norms.append(n.full_tensor() if isinstance(n, DTensor) else n)
    if len(norms) <= 1:  # one mesh (or none): torch's own number, bit for bit
        return norms[0] if norms else torch.tensor(0.0)
    device = norms[0].device
    return torch.nn.utils.get_total_norm([n.to(device) for n in norms], norm_type)


def clip_grad_norm(parameters: list[torch.Tensor], max_norm: float,
                   norm_type: float = 2.0) -> torch.Tensor:
    """Scale the gradients of ``parameters`` so that their total norm is at most ``max_norm``
    (torch's ``clip_grad_norm_``, mixed meshes allowed); returns the norm before clipping."""
    with_grad = [p for p in parameters if p.grad is not None]
    norm = total_norm([p.grad for p in with_grad], norm_type)
    for group in _by_mesh(with_grad):
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, norm)
    return norm


class GradientClipping(_ComposerGradientClipping):
    """Clip the gradients after each batch: ``clipping_type: norm`` (the total 2-norm to
    ``clipping_threshold``), ``value`` (Composer's: each element to ±threshold) or ``adaptive``
    (Composer's AGC)."""

    def apply(self, event: Event, state: State, logger: Logger) -> int | None:
        if event != Event.AFTER_TRAIN_BATCH or self.clipping_type != "norm":
            return super().apply(event, state, logger)
        clip_grad_norm(list(state.model.parameters()), self.clipping_threshold)
        return None
