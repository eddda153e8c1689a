"""The readers of an output projection split by vocabulary rows (the ``vocab_rows`` and
``vocab_parallel_embedding`` styles): a model that reads its head's weight rather than calling
the head (MPT: a loss fused with the projection, and the logits) names those readers in its
plan's ``vocab["readers"]``, and tensor parallelism replaces them on the model with the forms
below. The model's own code stays single-device; the collectives are here.

- :func:`split_loss`: a fused loss called as ``fn(h, weight, labels, scale, chunk=None,
  vocab=None, **options)`` (options such as ``chunks`` passed on as given) gets this rank's rows of the weight and a :class:`RowReductions` (which rows
  they are, and the all-reduces that combine the ranks' partial maxima and sums). No rank holds
  whole logits.
- :func:`gathered_logits`: logits ``fn(h, weight, scale)`` projected on each rank's rows and
  all-gathered whole (a plain tensor, with autograd).

A weight that is not split (a plain tensor, or a DTensor replicated over its mesh, as when tp
does not divide the vocabulary) goes to the reader as it is.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset


class RowReductions:
    """This rank's rows of a vocabulary split over ``group`` (starting at vocabulary row
    ``first``) and the in-place reductions over the ranks that hold the other rows."""

    def __init__(self, group: Any, first: int):
        self.group, self.first = group, first

    def max_(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, dist.ReduceOp.MAX, group=self.group)

    def sum_(self, t: torch.Tensor) -> None:
        dist.all_reduce(t, group=self.group)


def row_split(weight: torch.Tensor) -> RowReductions | None:
    """The :class:`RowReductions` of ``weight`` when it is a DTensor split by rows over a
    one-dimensional mesh; None when it is whole."""
    if not isinstance(weight, DTensor) or all(p.is_replicate() for p in weight.placements):
        return None
    mesh = weight.device_mesh
    if mesh.ndim != 1 or weight.placements[0] != Shard(0):
        raise ValueError(f"an output projection split as {weight.placements} over a {mesh.ndim}-D "
                         "mesh: only a split by vocabulary rows (Shard(0)) over one mesh "
                         "dimension is supported")
    _, offset = compute_local_shape_and_global_offset(weight.shape, mesh, weight.placements)
    return RowReductions(mesh.get_group(), int(offset[0]))


def split_loss(fn: Any) -> Any:
    """``fn`` (see the module's docstring) run vocabulary-parallel on a row-split weight."""

    def loss(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
             scale: float | None = None, chunk: int | None = None, **options: Any) -> torch.Tensor:
        split = row_split(weight)
        if split is None:
            return fn(h, weight, labels, scale, chunk, **options)
        # to_local is differentiable: the rows' gradient becomes the DTensor's again
        return fn(h, weight.to_local(), labels, scale, chunk, vocab=split, **options)

    return loss


def gathered_logits(fn: Any) -> Any:
    """``fn`` (see the module's docstring) giving whole logits from a row-split weight."""

    def logits(h: torch.Tensor, weight: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        if not isinstance(weight, DTensor):
            return fn(h, weight, scale)
        x = DTensor.from_local(h, weight.device_mesh, [Replicate()], run_check=False)
        out = fn(x, weight, None)
        out = out.full_tensor() if isinstance(out, DTensor) else out
        return out if scale is None else out * scale

    return logits


READERS = {"loss": split_loss, "logits": gathered_logits}
