"""``parallelize(model, fsdp_config)``: the per-block policies and FSDP2, applied from outside.

As in torchtitan's ``parallelize.py``, in this order: activation checkpointing, activation
CPU offload, ``torch.compile`` per block, ``fully_shard`` per block and then per top-level
child, and finally materialising meta-device parameters shard by shard. The model code
stays single-device; it only names its blocks (see :mod:`foundryx.parallel.policy`).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from foundryx.config.schema import FSDPConfig
from foundryx.errors import ConfigError
from foundryx.parallel import dist
from foundryx.parallel import materialize as mat
from foundryx.parallel.fsdp import build_mesh, mesh_shape, shard_model, sum_only_reductions
from foundryx.parallel.policy import blocks, checkpoint_targets
from foundryx.parallel.wrappers import checkpoint_activations, compile_forward, offload_activations

log = logging.getLogger(__name__)


def default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def apply_block_policies(model: nn.Module, fsdp: FSDPConfig) -> list[str]:
    """Activation checkpointing, activation offload and compile; returns summary phrases."""
    block_list = blocks(model)
    summary = []
    if fsdp.activation_checkpointing:
        targets = checkpoint_targets(model, fsdp.activation_checkpointing_modules,
                                     fsdp.activation_checkpointing_every)
        if not targets:
            raise ConfigError(["fsdp_config.activation_checkpointing: the model names no modules "
                               "to checkpoint; set activation_checkpointing_modules"])
        for _, m in targets:
            checkpoint_activations(m)
        summary.append(f"activation checkpointing on {len(targets)} modules")
    for flag, what in ((fsdp.activation_cpu_offload, "activation_cpu_offload"), (fsdp.compile, "compile")):
        if flag and not block_list:
            raise ConfigError([f"fsdp_config.{what}: the model names no transformer blocks; give "
                               "it an fsdp_wrap_fn (or _no_split_modules)"])
    if fsdp.activation_cpu_offload:
        for _, m in block_list:
            offload_activations(m)
        summary.append(f"activation CPU offload on {len(block_list)} blocks")
    if fsdp.compile:
        for _, m in block_list:
            compile_forward(m, fsdp.compile_options)
        summary.append(f"torch.compile on {len(block_list)} blocks")
    return summary


def parallelize(
    model: nn.Module,
    fsdp: FSDPConfig | None,
    *,
    precision: str = "fp32",
    device: torch.device | None = None,
) -> nn.Module:
    """Apply ``fsdp`` (None: only materialise) to ``model`` in place and return it.

    Sharding needs more than one process (an initialised process group); with one process
    the per-block policies still apply. Meta-device parameters are materialised afterwards,
    on ``device`` (default: the current CUDA device, else CPU).
    """
    device = device or default_device()
    world = dist.world_size()
    mode = mat.init_mode(model) if world > 1 else ("meta" if mat.has_meta(model) else "real")
    full = mat.full_state_on_rank0(model) if mode == "rank0" else {}
    summary = apply_block_policies(model, fsdp) if fsdp is not None else []
    sharded = fsdp is not None and world > 1
    if sharded:
        local_world = dist.local_world_size()
        replicate, shard = mesh_shape(fsdp, world, local_world)
        block_list = [m for _, m in blocks(model)]
        if not block_list:
            log.info("FSDP2: the model names no transformer blocks; its top-level modules are the "
                     "only FSDP units")
        sum_only = sum_only_reductions(replicate, device.type)  # before any work: fail fast
        mesh = build_mesh(fsdp, world, local_world, device.type)
        shard_model(model, block_list, mesh, fsdp, precision, sum_only)
        summary.insert(0, f"FSDP2 {fsdp.sharding_strategy} over {world} ranks (mesh "
                          f"{replicate}x{shard}, {len(block_list)} blocks as units)")
    elif fsdp is not None:
        log.info("fsdp_config is set but this is one process: no sharding (the per-block "
                 "policies still apply)")
    if mode == "meta":
        mat.init_meta(model, device)
    elif mode == "rank0":
        mat.broadcast_from_rank0(model, full, device)
    if summary or mode != "real":
        log.info("parallelism: %s; weights: %s", ", ".join(summary) or "none",
                 {"meta": "initialised per shard", "rank0": "broadcast from rank 0",
                  "real": "as built"}[mode])
    if fsdp is not None and fsdp.verbose:
        log.info("parallelized model:\n%s", model)
    return model
