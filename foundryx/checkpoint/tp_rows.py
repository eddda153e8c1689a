"""Fused layers in a checkpoint in their logical row order, whatever the TP degree.

Under tensor parallelism a fused projection (MPT's ``Wqkv``) is held with its rows reordered
so that each TP rank's block is its own q, k and v heads (:func:`foundryx.parallel.tp.
interleaved_rows`). A checkpoint keeps the logical order (q, then k, then v: what a tp 1 model
holds), so DCP can reshard it to any degree by row ranges. The weights and the optimizer's
per-parameter state (AdamW's moments) are converted alike: gathered one tensor at a time,
reordered and cut again as the parameter is (a transient of one full tensor per rank).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from foundryx.parallel.tp_fused import fused_row_orders


def _reordered(t: Any, index: torch.Tensor) -> Any:
    """``t`` (a DTensor sharded by rows) with its global rows taken in ``index``'s order, cut
    again as ``t`` is. A low-precision storage (a tensor subclass: a frozen int8/fp8 base's
    rows and row scales) has each of its inner tensors reordered alike."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor) or t.dim() == 0:
        return t
    local = t.to_local()
    if type(local) is torch.Tensor:
        return _reordered_plain(local, t, t.shape, index)
    names, meta = local.__tensor_flatten__()
    rows = local.shape[0]
    inner = {}
    for name in names:
        part = getattr(local, name)
        global_shape = (t.shape[0], *part.shape[1:])
        inner[name] = _reordered_plain(part, t, global_shape, index, rows).to_local()
    new = type(local).__tensor_unflatten__(inner, meta, local.shape, local.stride())
    return DTensor.from_local(new, t.device_mesh, t.placements, run_check=False,
                              shape=t.shape, stride=t.stride())


def _reordered_plain(local: torch.Tensor, like: Any, shape: tuple[int, ...],
                     index: torch.Tensor, rows: int | None = None) -> Any:
    from torch.distributed.tensor import DTensor, distribute_tensor

    if rows is not None and local.shape[0] != rows:
        raise ValueError(f"a {type(like.to_local()).__name__} part of {local.shape[0]} rows, "
                         f"not {rows}: its rows cannot be reordered")
    raw = local.view(torch.uint8) if local.element_size() == 1 else local  # float8 over gloo
    shape = torch.Size(shape)
    stride = torch.empty(shape, device="meta").stride()
    whole = DTensor.from_local(raw, like.device_mesh, like.placements, run_check=False,
                               shape=shape, stride=stride).full_tensor()
    out = distribute_tensor(whole[index.to(whole.device)], like.device_mesh, like.placements,
                            src_data_rank=None)
    return out if raw is local else DTensor.from_local(
        out.to_local().view(local.dtype), like.device_mesh, like.placements, run_check=False,
        shape=shape, stride=stride)


def _convert(model: nn.Module, model_sd: dict[str, Any], optim_sd: dict[str, Any],
             to_logical: bool) -> None:
    for key, order in fused_row_orders(model).items():
        index = torch.argsort(order) if to_logical else order
        if key in model_sd:
            model_sd[key] = _reordered(model_sd[key], index)
        states = optim_sd.get("state") or {}
        if isinstance(states.get(key), dict):  # a new dict: this one may be the optimizer's own
            states[key] = {name: _reordered(value, index) if isinstance(value, torch.Tensor)
                           else value for name, value in states[key].items()}


def to_logical_rows(model: nn.Module, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
    """In place: the state dicts' fused rows from the model's TP order to the logical order."""
    _convert(model, model_sd, optim_sd, to_logical=True)


def to_model_rows(model: nn.Module, model_sd: dict[str, Any], optim_sd: dict[str, Any]) -> None:
    """In place: loaded state dicts' fused rows from the logical order to the model's."""
    _convert(model, model_sd, optim_sd, to_logical=False)
