"""The tensor-parallel styles a plan names (see :mod:`foundryx.parallel.tp`), as torch's
``ParallelStyle`` objects: linear layers cut by rows or columns (low-precision frozen layers
too, by their own cut), fused projections reordered so each rank's rows are its heads, the
vocabulary and sequence-parallel styles.

Shared with :mod:`~foundryx.parallel.tp` and :mod:`~foundryx.parallel.tp_lora`:
:func:`styles_for` (a style's name to its ``ParallelStyle`` objects), :func:`reorder_fused_rows`
(a fused projection's rows in TP order) and :func:`cut_params` (a module's parameters cut into
DTensors, the partition function of torch's ``distribute_module``)."""

from __future__ import annotations

from functools import partial
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

from foundryx.parallel.head_norm import HeadNorm
from foundryx.parallel.loss_parallel import SplitLogits
from foundryx.parallel.materialize import TP_ROWS_ATTR as ROWS_ATTR

LINEAR_STYLES = ("colwise", "colwise_fused", "colwise_gather", "colwise_loss_parallel", "rowwise")


def interleaved_rows(sizes: tuple[int, ...], tp: int) -> torch.Tensor:
    """Row order of a fused layer with parts of ``sizes`` rows such that the i-th of ``tp``
    equal blocks holds the i-th slice of every part (q_0 k_0 v_0 q_1 k_1 v_1 ...)."""
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    order: list[int] = []
    for r in range(tp):
        for start, n in zip(starts, sizes):
            c = n // tp
            order.extend(range(start + r * c, start + (r + 1) * c))
    return torch.tensor(order)


def reorder_fused_rows(module: nn.Module, tp: int) -> None:
    """Put a fused projection's rows (``module._fused``: the sizes of its parts, q k v say) in
    :func:`interleaved_rows` order, so the i-th of ``tp`` row blocks holds every part's i-th
    slice; the order is kept on the module (``ROWS_ATTR``: materializing, the state dict and the
    offload's re-cut read it). A low-precision layer reorders its own storage
    (``reorder_rows``). Called before the layer's style cuts it (:mod:`foundryx.parallel.tp`,
    :mod:`foundryx.parallel.tp_lora`)."""
    order = interleaved_rows(tuple(module._fused), tp)
    setattr(module, ROWS_ATTR, order)
    if callable(getattr(module, "reorder_rows", None)):  # a low-precision layer reorders its own
        module.reorder_rows(order)
        return
    with torch.no_grad():
        for p in (module.weight, getattr(module, "bias", None)):
            if p is not None and not p.is_meta:
                p.copy_(p[order])


def _cut(p: torch.Tensor, mesh: DeviceMesh, placement: Any, part: Any = None) -> torch.Tensor:
    """This rank's part of ``p`` as a DTensor, cut with ``narrow`` or, given, with ``part(dim,
    start, stop)`` (a low-precision layer's own cut: the weight keeps its storage, as a TP part
    when replicated too; every rank holds the same ``p``, so nothing is sent)."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    local = p.detach()
    if isinstance(placement, Shard):
        shape, offset = compute_local_shape_and_global_offset(p.shape, mesh, [placement])
        d = placement.dim
        local = (part(d, offset[d], offset[d] + shape[d]) if part is not None
                 else local.narrow(d, offset[d], shape[d]).clone())
    elif part is not None:
        local = part(0, 0, p.shape[0])
    return DTensor.from_local(local, mesh, [placement], run_check=False, shape=p.shape,
                              stride=p.stride())


def cut_params(layout: dict[str, Any], name: str, module: nn.Module, mesh: DeviceMesh) -> None:
    """Replace each parameter of ``module`` (its own, not its children's) by this rank's part of
    it as a DTensor placed as ``layout`` says per parameter name (a low-precision layer's weight
    by its own cut, ``tp_part``). The ``partition_fn`` of torch's ``distribute_module``
    (``name`` is the module's name there, unused): for the styles here and for the modules a
    plan leaves whole (:mod:`foundryx.parallel.tp`, every parameter replicated)."""
    part = getattr(module, "tp_part", None)  # a low-precision layer's cut of its weight
    for pname, p in list(module.named_parameters(recurse=False)):
        if p is not None:
            cut = _cut(p, mesh, layout[pname], part if pname == "weight" else None)
            module.register_parameter(pname, nn.Parameter(cut, requires_grad=p.requires_grad))


def _any_linear(style_cls: type, layout: dict[str, Any], input_layouts: tuple[Any, ...] | None):
    """``style_cls`` (torch's ColwiseParallel or RowwiseParallel) for a linear layer that is
    not an ``nn.Linear`` (a frozen low-precision layer: ``weight`` [out, in] in a storage
    subclass, dequantized when it runs): its parameters cut as ``layout`` says."""
    from functools import partial

    from torch.distributed.tensor.parallel.style import distribute_module

    class AnyLinear(style_cls):
        def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
            if input_layouts is not None:
                self.desired_input_layouts = input_layouts
            return distribute_module(
                module, device_mesh, partial(cut_params, layout),
                partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                partial(self._prepare_output_fn, self.output_layouts, self.use_local_output))

    return AnyLinear


def styles_for(style: str, module: nn.Module | None = None) -> list[Any]:
    """The ``ParallelStyle`` objects that apply ``style`` (a name a plan gives a module, e.g.
    ``colwise``, ``rowwise``, ``sequence_parallel``) to ``module``, in order; a linear style on a
    layer that is not an ``nn.Linear`` (a frozen low-precision layer) cuts its parameters by the
    layer's own cut. ValueError for a name this module does not know."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        PrepareModuleOutput,
        RowwiseParallel,
        SequenceParallel,
    )

    if module is not None and not isinstance(module, nn.Linear) and style in LINEAR_STYLES:
        colwise = _any_linear(ColwiseParallel, {"weight": Shard(0), "bias": Shard(0)}, None)
        rowwise = _any_linear(RowwiseParallel, {"weight": Shard(1), "bias": Replicate()},
                              (Shard(-1),))
    else:
        colwise, rowwise = ColwiseParallel, RowwiseParallel
    if style in ("colwise", "colwise_fused"):
        return [colwise()]
    if style == "colwise_loss_parallel":
        return [colwise(output_layouts=Shard(-1), use_local_output=False), SplitLogits()]
    if style == "vocab_parallel_embedding":
        return [rowwise(input_layouts=Replicate(), output_layouts=Replicate())]
    if style == "vocab_rows":
        return [_VocabRows()]
    if style == "colwise_gather":
        return [colwise(output_layouts=Replicate())]
    if style == "rowwise":
        return [rowwise(output_layouts=Shard(1))]
    if style == "sequence_parallel":
        return [SequenceParallel()]
    if style == "sequence_parallel_local":
        return [SequenceParallel(use_local_output=True)]
    if style == "head_norm":
        return [HeadNorm()]
    if style == "sequence_parallel_start":
        return [PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                   use_local_output=True)]
    if style == "sequence_parallel_end":
        return [SequenceParallel(),
                PrepareModuleOutput(output_layouts=Shard(1), desired_output_layouts=Replicate(),
                                    use_local_output=True)]
    if style == "gather_sequence":
        return [PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),),
                                   use_local_output=True)]
    if style.startswith("gather_sequence(") and style.endswith(")"):
        kw = style[len("gather_sequence("):-1]
        return [PrepareModuleInput(input_layouts=(), desired_input_layouts=(),
                                   input_kwarg_layouts={kw: Shard(1)},
                                   desired_input_kwarg_layouts={kw: Replicate()},
                                   use_local_output=True)]
    raise ValueError(f"tensor-parallel plan: unknown style {style!r}")


class _VocabRows(ParallelStyle):
    """A parallel style that only cuts a weight by rows (``Shard(0)``) and adds no hooks."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel.style import distribute_module

        return distribute_module(module, device_mesh,
                                 partial(cut_params, {"weight": Shard(0), "bias": Shard(0)}))
