"""Offloaded frozen layers under tensor parallelism: each keeps its TP block, its rows split
over the data-parallel ranks that hold the same block (``split_offloaded``, by the layer's
style); the re-cut of a weight already in host memory, gathered whole once to be cut again
(``split_for_tp``, the one collective here)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from foundryx.parallel.fsdp import data_parallel_mesh
from foundryx.parallel.materialize import TP_ROWS_ATTR as ROWS_ATTR
from foundryx.parallel.offload import Offloaded
from foundryx.parallel.offload_gather import gather_rows

KV_REPLICATED = "kv_replicated"  # a k or v projection replicated over the TP ranks (tp_kv.py)


def offload_group(world_mesh: DeviceMesh) -> Any:
    """The process group of the ranks that hold this rank's tensor-parallel block (the same
    ``tp`` coordinate): the data-parallel sub-mesh of the world mesh at this rank's ``tp``
    coordinate (replicas x shards flattened into one dimension under hybrid sharding), whose
    group the mesh made with the world's backends (``cpu:gloo,cuda:nccl`` on a GPU run: the
    offload gathers run on host tensors)."""
    dp = data_parallel_mesh(world_mesh)
    return (dp._flatten() if dp.ndim > 1 else dp).get_group()


def split_for_tp(source: Offloaded, mesh: DeviceMesh, placement: Any, group: object,
                 order: torch.Tensor | None = None) -> None:
    """Keep this rank's tensor-parallel block of an offloaded weight (``placement`` over
    ``mesh``: Shard(0), rows, for a column-wise layer, in ``order`` when TP reorders a fused
    layer's rows; Shard(1), columns, for a row-wise one, each row's scale whole; Replicate: all
    of it), its rows split over ``group``, the data-parallel ranks that hold the same block.
    A weight already in host memory is gathered whole once to be cut again (a meta
    placeholder: the loader reads the new rows)."""
    host, formats = source.host, source.formats
    shape = torch.Size((source.rows or host.shape[0], *host.shape[1:]))
    whole = None
    if not host.is_meta:
        whole = host if source.rows is None else \
            gather_rows(host, source.rows, source.world, formats)
        if order is not None:
            whole = formats.index_rows(whole, order, source.name)
    local, offset = compute_local_shape_and_global_offset(shape, mesh, [placement])
    source.group, source.world = group, torch.distributed.get_world_size(group)
    source.placed = (mesh, (placement,), shape)
    if not placement.is_shard():  # replicated over the TP ranks: the whole weight
        source.rows = shape[0]
    elif placement.dim == 0:
        source.rows, source.row_offset = local[0], offset[0]
    else:
        source.rows, source.columns = shape[0], (offset[1], offset[1] + local[1])
    if whole is not None:
        start, stop = source.shard_range()
        part = formats.take_rows(whole, start, stop)
        source.host = (part if source.columns is None
                       else formats.take_columns(part, *source.columns, source.name))


def split_offloaded(module: nn.Module, style: str, tp_mesh: DeviceMesh, group: Any) -> None:
    """An offloaded frozen layer (its weight in host memory, not a parameter TP's styles cut)
    keeps its TP block, as the style cuts a weight (fused rows in TP's order; a replicated
    kv projection all of it)."""
    from torch.distributed.tensor import Replicate, Shard

    placement = (Shard(1) if style == "rowwise" else Replicate() if style == KV_REPLICATED
                 else Shard(0))
    split_for_tp(module.offload, tp_mesh, placement, group, getattr(module, ROWS_ATTR, None))
