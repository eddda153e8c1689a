"""The output projection of a language model (hidden states -> vocabulary logits), whose
weight may be split by vocabulary rows over ranks.

Tensor parallelism (``foundryx.parallel.tp``, applied from outside the model) can leave an
embedding or head weight as a DTensor split by rows (``Shard(0)``) over the TP ranks: each rank
holds a contiguous range of the vocabulary. The model's code stays single-device; the two
functions that read the weight handle that case: :func:`output_logits` here (whole logits, for
eval and generation) and :func:`foundryx.models.layers.loss.linear_cross_entropy` (the fused
loss, vocabulary-parallel: no rank ever holds whole logits).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F


def vocab_split(weight: torch.Tensor) -> tuple[Any, int] | None:
    """``(process group, first row)`` when ``weight`` is a DTensor split by rows over a
    one-dimensional mesh (this rank holds rows ``first row ..``), None when it is whole (a plain
    tensor, or a DTensor replicated over its mesh)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    if not isinstance(weight, DTensor) or all(p.is_replicate() for p in weight.placements):
        return None
    mesh = weight.device_mesh
    if mesh.ndim != 1 or weight.placements[0] != Shard(0):
        raise ValueError(f"an output projection split as {weight.placements} over a {mesh.ndim}-D "
                         "mesh: only a split by vocabulary rows (Shard(0)) over one mesh "
                         "dimension is supported")
    _, offset = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)
    return mesh.get_group(), int(offset[0])


def output_logits(h: torch.Tensor, weight: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """``(h @ weight.T) * scale``, whole (a plain tensor) even when ``weight`` is split by
    vocabulary: each rank projects onto its rows and the logits are all-gathered (with autograd,
    so a loss on them trains the split weight)."""
    from torch.distributed.tensor import DTensor, Replicate

    if isinstance(weight, DTensor):
        x = DTensor.from_local(h, weight.device_mesh, [Replicate()], run_check=False)
        logits = F.linear(x, weight).full_tensor()
    else:
        logits = F.linear(h, weight)
    return logits if scale is None else logits * scale
