"""LoRA adapters on a tensor-parallel linear layer: torchtitan's rule."""

from __future__ import annotations

import logging

from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from foundryx.parallel.tp_styles import reorder_fused_rows, styles_for

log = logging.getLogger(__name__)


def apply_lora(module: nn.Module, style: str, tp_mesh: DeviceMesh, model_name: str) -> None:
    """torchtitan's rule for LoRA adapters on a split linear layer: column-wise base (a fused
    one's slices too) -> ``lora_A`` replicated, ``lora_B`` split by output rows (Shard(0));
    row-wise base -> ``lora_A`` split by input columns (Shard(1)), ``lora_B`` replicated (on
    the whole sequence; its output then cut to this rank's sequence shard, as the base
    layer's is)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleOutput,
        RowwiseParallel,
        parallelize_module,
    )

    if style == "colwise_loss_parallel":  # the adapters' output would have to stay split too
        log.info("parallelism.tp: %s has LoRA adapters on the output projection; its logits "
                 "are gathered whole for the loss (no loss parallel)", model_name)
        style = "colwise_gather"
    if style == "colwise_fused":  # LoRA on slices of a fused layer (MPT's q, k, v of Wqkv):
        # its rows reordered as without LoRA, each slice's lora_B split like the slice's rows
        tp = tp_mesh.size()
        reorder_fused_rows(module.base_layer, tp)
        module.slice_sizes = tuple(n // tp for n in module.slice_sizes)
    for s in styles_for(style, module.base_layer):
        parallelize_module(module.base_layer, tp_mesh, s)
    for key in module.lora_A:
        a, b = module.lora_A[key], module.lora_B[key]
        if style == "rowwise":
            # A's rank-r output summed whole (small), B on it, then this rank's sequence shard
            # (a Linear on a sequence-sharded DTensor would gather it anyway)
            parallelize_module(a, tp_mesh, RowwiseParallel(output_layouts=Replicate()))
            parallelize_module(b, tp_mesh, PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=True))
        else:
            out = Replicate() if style == "colwise_gather" else Shard(-1)
            parallelize_module(b, tp_mesh, ColwiseParallel(output_layouts=out))
