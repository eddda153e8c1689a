"""Offloaded frozen layers under tensor parallelism: each keeps its TP block, its rows split
over the data-parallel ranks that hold the same block."""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from foundryx.parallel.fsdp import data_parallel_mesh
from foundryx.parallel.materialize import TP_ROWS_ATTR as ROWS_ATTR

KV_REPLICATED = "kv_replicated"  # a k or v projection replicated over the TP ranks (tp_kv.py)


def offload_group(world_mesh: DeviceMesh) -> Any:
    """The process group of the ranks that hold this rank's tensor-parallel block (the same
    ``tp`` coordinate): the data-parallel sub-mesh of the world mesh at this rank's ``tp``
    coordinate (replicas x shards flattened into one dimension under hybrid sharding), whose
    group the mesh made with the world's backends (``cpu:gloo,cuda:nccl`` on a GPU run: the
    offload gathers run on host tensors)."""
    dp = data_parallel_mesh(world_mesh)
    return (dp._flatten() if dp.ndim > 1 else dp).get_group()


def split_offloaded(module: nn.Module, style: str, tp_mesh: DeviceMesh, group: Any) -> None:
    """An offloaded frozen layer (its weight in host memory, not a parameter TP's styles cut)
    keeps its TP block, as the style cuts a weight (fused rows in TP's order; a replicated
    kv projection all of it)."""
    from torch.distributed.tensor import Replicate, Shard

    placement = (Shard(1) if style == "rowwise" else Replicate() if style == KV_REPLICATED
                 else Shard(0))
    module.offload.split_for_tp(tp_mesh, placement, group, getattr(module, ROWS_ATTR, None))
