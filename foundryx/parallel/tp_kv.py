"""Grouped-query attention with fewer kv heads than tensor-parallel ranks.

With ``tp`` a multiple of the kv heads, k and v cannot be split by heads. Every rank's q heads
share one kv head, ``rank // (tp / kv_heads)``, so the k and v projections are replicated over
the TP ranks (FSDP2 still shards them over the data-parallel ones) and each rank keeps its kv
head's columns of their output. The gradient of that output is this rank's part of the whole
one (its q heads' use of the head), so it leaves as ``Partial``: DTensor sums the input's
gradient over the TP ranks, and FSDP2 reduces a TP parameter's gradient to its placement
(``Replicate``) before it reduce-scatters. The attention's own kv-group count becomes the
rank's (its q heads per its one kv head).

A fused projection (MPT's ``Wqkv``, its ``_fused`` row sizes q, k, v) is replicated whole,
and each rank keeps its q heads' columns and its kv head's: its q is then not split by TP (it
costs the memory and compute of the whole q projection on every TP rank).

A model declares this in its plan as data::

    "kv_heads": {"count": 2, "name": "num_key_value_heads", "heads": 8,
                 "layers": ["<k_proj pattern>", "<v_proj pattern>"],   # or the fused layer
                 "rank_attrs": {"<attention pattern>": {"num_key_value_groups": "heads_per_rank"}}}

``rank_attrs`` values: ``heads_per_rank`` (heads / tp: the rank's q heads per its one kv
head) or ``one``; set after the plan's ``local`` division.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def kv_problem(kv: dict[str, Any] | None, tp: int) -> str | None:
    """Why ``tp`` ranks can neither split nor replicate the declared kv heads (None: they can)."""
    if kv is None or kv["count"] % tp == 0 or tp % kv["count"] == 0:
        return None
    return (f"parallelism.tp: {tp}: the model's {kv['count']} kv heads ({kv['name']}) can be "
            f"split over tp ranks only when tp divides {kv['count']}, or replicated when tp is a "
            f"multiple of it")


def replicates_kv(kv: dict[str, Any] | None, tp: int) -> bool:
    """Whether ``tp`` ranks replicate the declared kv heads (more ranks than kv heads)."""
    return kv is not None and tp > kv["count"] and tp % kv["count"] == 0


def kv_rank_attrs(kv: dict[str, Any], tp: int) -> dict[str, dict[str, int]]:
    """The attention attributes a rank sets when it replicates the kv heads (see the module)."""
    values = {"heads_per_rank": kv["heads"] // tp, "one": 1}
    return {pattern: {attr: values[kind] for attr, kind in attrs.items()}
            for pattern, attrs in kv["rank_attrs"].items()}


def _own_columns(base: nn.Module, tp: int, rank: int, kv_heads: int) -> torch.Tensor:
    """The output columns of this rank: its kv head's (of k or v), or, for a fused q, k, v
    projection (``_fused``), its q heads' and its kv head's k and v."""
    head = rank // (tp // kv_heads)
    fused = getattr(base, "_fused", None)
    if fused is None:
        width = base.out_features // kv_heads
        return torch.arange(head * width, (head + 1) * width)
    q_rows, k_rows, _ = fused
    q_width, width = q_rows // tp, k_rows // kv_heads
    return torch.cat([torch.arange(rank * q_width, (rank + 1) * q_width),
                      q_rows + torch.arange(head * width, (head + 1) * width),
                      q_rows + k_rows + torch.arange(head * width, (head + 1) * width)])


def replicate_kv_projection(module: nn.Module, tp_mesh: DeviceMesh, kv_heads: int,
                            replicate: Callable[[str, nn.Module, DeviceMesh], None]) -> None:
    """Make ``module`` (k_proj or v_proj, or a fused q, k, v projection: a linear layer, a
    frozen low-precision one, or a LoRA layer around one) a replicated projection whose
    output is this rank's columns (:func:`_own_columns`); ``replicate(name, submodule, mesh)``
    makes a submodule's parameters Replicate DTensors (foundryx.parallel.tp's cut)."""
    from torch.distributed.tensor import DTensor, Partial, Replicate
    from torch.distributed.tensor.parallel.style import distribute_module

    base = getattr(module, "base_layer", module)
    columns = _own_columns(base, tp_mesh.size(), tp_mesh.get_local_rank(), kv_heads)

    def whole_input(mod: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, mesh, [Replicate()], run_check=False)
        return (x, *inputs[1:])

    def own_columns(mod: nn.Module, out: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        local = out.to_local(grad_placements=[Partial()]) if isinstance(out, DTensor) else out
        return local.index_select(-1, columns.to(local.device))

    distribute_module(module, tp_mesh, replicate, whole_input, own_columns)
