"""``parallelize(model, parallelism, ...)``: the per-block policies and FSDP2, applied from outside.

As in torchtitan's ``parallelize.py``, in this order: tensor parallelism from the plan the
model declares (``parallel/tp.py``; whether a fused loss survives it is decided there too),
torchao's float8 training (``parallel/float8.py``), activation checkpointing (full or
selective), activation CPU offload, ``torch.compile`` per block, ``fully_shard`` per block and
then per top-level child (with the model's extra forward entries registered:
``fsdp.register_forward_methods``), and finally materialising meta-device parameters shard by
shard. The model code stays single-device; it only names its blocks (see
:mod:`foundryx.parallel.policy`).
"""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from foundryx.config.schema import (
    ActivationCheckpointingConfig,
    CompileConfig,
    Float8Config,
    FusedOpsConfig,
    ParallelismConfig,
    TilingConfig,
)
from foundryx.errors import ConfigError
from foundryx.kernels.cpu_matmul import onednn_available, set_backend
from foundryx.kernels.cpu_matmul import resolve as resolve_backend
from foundryx.parallel import dist
from foundryx.parallel import materialize as mat
from foundryx.parallel.contract import check_composer_contract
from foundryx.parallel.cp import apply_context_parallel, build_cp_mesh, cp_mesh_shape
from foundryx.parallel.cp import plan_problems as cp_plan_problems
from foundryx.parallel.float8 import apply_float8
from foundryx.parallel.fsdp import (
    build_mesh,
    data_parallel_mesh,
    mesh_dims,
    shard_model,
    sum_only_reductions,
)
from foundryx.parallel.fused_ops import FUSED, apply_fused_ops
from foundryx.parallel.offload_activations import (
    MIN_BYTES,
    ActivationOffload,
    offload_activations,
)
from foundryx.parallel.pinning import pins
from foundryx.parallel.policy import blocks, checkpoint_targets
from foundryx.parallel.selective_ac import checkpoint_selectively
from foundryx.parallel.tiling import (
    RMS_NORMS,
    mlp_modules,
    rms_norm_modules,
    tile_mlp,
    tile_rms_norm,
)
from foundryx.parallel.tp import apply_tensor_parallel, plan_problems, unfuse_loss_without_reader
from foundryx.parallel.tp_fused import permute_full_state
from foundryx.parallel.wrappers import (
    checkpoint_activations,
    compile_forward,
    compile_problem,
    route_linear,
)
from foundryx.runtime.device_choice import pick_device

log = logging.getLogger(__name__)


def resolve_compile(compile: CompileConfig, device: torch.device, has_blocks: bool) -> bool:
    """``compile.enabled``, with ``auto`` decided for this device, and said in one line."""
    if compile.enabled != "auto":
        return bool(compile.enabled)
    why_not = ("FOUNDRYX_COMPILE=0 in the environment" if os.environ.get("FOUNDRYX_COMPILE") == "0"
               else compile_problem(device) or (None if has_blocks else "the model names no blocks"))
    if why_not:
        log.info("compile: off (%s); compile.enabled: true asks for it anyway", why_not)
        return False
    log.info("compile: torch.compile per transformer block on %s (the default where supported; "
             "compile: false turns it off)", device.type)
    return True


def resolve_cpu_matmul(choice: str, device: torch.device) -> str | None:
    """The fp32 matmul backend for training on ``device`` (None off the CPU), set for the
    process and said in one line. ``auto``: oneDNN on x86-64 where this torch has it."""
    if device.type != "cpu":
        return None
    if choice == "onednn" and not onednn_available():
        raise ConfigError(["cpu_matmul: onednn, but this torch has no oneDNN "
                           "(torch.backends.mkldnn is unavailable); use auto or blas"])
    if choice == "auto":
        choice, why_not = resolve_backend("auto")
        if why_not:
            log.info("cpu_matmul: torch's BLAS for fp32 matmuls (%s); cpu_matmul: onednn asks "
                     "for oneDNN", why_not)
        else:
            log.info("cpu_matmul: oneDNN's GEMM for fp32 linear layers and the fused loss (the "
                     "default on x86-64, the same fp32 arithmetic; cpu_matmul: blas uses torch's "
                     "BLAS)")
    set_backend(choice)
    return choice


def route_linears(model: nn.Module) -> int:
    """Every ``nn.Linear`` of ``model`` through foundryx's CPU matmul; returns how many."""
    linears = [m for m in model.modules() if type(m) is nn.Linear]
    for m in linears:
        route_linear(m)
    return len(linears)


def apply_block_policies(model: nn.Module, ac: ActivationCheckpointingConfig,
                         compile: CompileConfig, device: torch.device | None = None,
                         tiling: TilingConfig | None = None,
                         microbatch_tokens: int | None = None,
                         fused_ops: FusedOpsConfig | None = None) -> list[str]:
    """Fused RMS norms and SwiGLU (``fused_ops``, None: off), tiled MLPs (``tiling``, None:
    off; ``auto`` decided for ``microbatch_tokens``), activation checkpointing, activation
    offload and compile; returns summary phrases."""
    block_list = blocks(model)
    device = device or pick_device()
    compile_on = resolve_compile(compile, device, bool(block_list))
    summary = []
    if fused_ops is not None:  # before tiling: a tiled MLP runs the fused forward tile by tile
        summary += apply_fused_ops(model, [m for _, m in block_list], fused_ops, device)
    if tiling is not None:
        summary += apply_tiling(model, [m for _, m in block_list], tiling, microbatch_tokens)
    if ac.enabled:
        targets = checkpoint_targets(model, ac.modules, ac.every)
        if not targets:
            raise ConfigError(["activation_checkpointing.enabled: the model names no modules "
                               "to checkpoint; set activation_checkpointing.modules"])
        if ac.mode == "auto":  # foundryx.train decides it from the plan before building
            log.info("activation_checkpointing.mode: auto -> full (not decided by a plan here: "
                     "`foundryx train` decides it for the device from the planner's peak)")
        wrap = checkpoint_selectively if ac.mode == "selective" else checkpoint_activations
        for _, m in targets:
            wrap(m)
        summary.append(f"{'selective ' if ac.mode == 'selective' else ''}activation "
                       f"checkpointing on {len(targets)} modules")
    for flag, what in ((ac.cpu_offload, "activation_checkpointing.cpu_offload"),
                       (compile_on, "compile.enabled")):
        if flag and not block_list:
            raise ConfigError([f"{what}: the model names no transformer blocks; give it an "
                               "fsdp_wrap_fn (or _no_split_modules)"])
    if ac.cpu_offload:
        # one for the model: backward prefetches across blocks; with checkpointing what is
        # saved is each block's input, offloaded whatever its size
        offload = ActivationOffload(device, pins(device), 0 if ac.enabled else MIN_BYTES)
        for _, m in block_list:
            offload_activations(m, offload)
        summary.append(f"activation CPU offload on {len(block_list)} blocks")
    if compile_on:
        for _, m in block_list:
            compile_forward(m, compile.options)
        summary.append(f"torch.compile on {len(block_list)} blocks")
    return summary


def apply_tiling(model: nn.Module, block_list: list[nn.Module], tiling: TilingConfig,
                 microbatch_tokens: int | None) -> list[str]:
    """``tiling.mlp`` on the blocks' MLPs and ``tiling.norm`` on the model's RMS norms;
    ``auto`` decided for a microbatch of ``microbatch_tokens`` tokens and said in one line."""
    long = microbatch_tokens is not None and microbatch_tokens >= tiling.auto_tokens
    mlps = mlp_modules(model, block_list, tiling.mlp_modules)
    norms = rms_norm_modules(model)
    fused = [m for m in norms if getattr(m, FUSED, None)]
    norms = [m for m in norms if not getattr(m, FUSED, None)]
    if fused and (tiling.norm is True or (tiling.norm == "auto" and long)):
        log.info("tiling.norm: the %d fused RMS norms are not tiled (fused_ops.rms_norm keeps "
                 "only their input and a float32 statistic per token already)", len(fused))
    if tiling.mlp is True and not mlps:
        names = tiling.mlp_modules
        what = f"of class {', '.join(names)}" if names else "whose class name ends in MLP"
        raise ConfigError([f"tiling.mlp: the model's blocks have no module {what}; name "
                           "them in tiling.mlp_modules or set tiling.mlp: false"])
    if tiling.norm is True and not norms and not fused:
        raise ConfigError([f"tiling.norm: the model has no RMS norm of a kind foundryx tiles "
                           f"({', '.join(sorted(RMS_NORMS))}); set tiling.norm: false"])
    tile_mlps = bool(mlps) and (tiling.mlp is True or (tiling.mlp == "auto" and long))
    tile_norms = bool(norms) and (tiling.norm is True or (tiling.norm == "auto" and long))
    if not (tile_mlps or tile_norms):
        return []
    tokens = tiling.mlp_tokens or mlp_width(mlps[0] if mlps else norms[0])
    said = []
    if tile_mlps:
        for m in mlps:
            tile_mlp(m, tokens)
        said.append(f"MLP tiled by {tokens} tokens in {len(mlps)} blocks")
    if tile_norms:
        for m in norms:
            tile_rms_norm(m, tokens)
        said.append(f"{len(norms)} RMS norms tiled by {tokens} tokens")
    if "auto" in (tiling.mlp if tile_mlps else None, tiling.norm if tile_norms else None):
        log.info("tiling: %s (a microbatch of %d tokens >= tiling.auto_tokens %d: the MLP's "
                 "hidden-width tensors and the norms' float32 copies are never whole; one more "
                 "MLP forward a step; tiling.mlp / tiling.norm: false turn them off)",
                 " and ".join(said), microbatch_tokens, tiling.auto_tokens)
    return said


def mlp_width(mlp: nn.Module) -> int:
    """The MLP's input width (its first linear layer's in_features; a norm's width): the
    default tile."""
    for m in mlp.modules():
        if isinstance(getattr(m, "in_features", None), int):
            return m.in_features
    w = getattr(mlp, "weight", None)
    return int(w.shape[0]) if isinstance(w, torch.Tensor) and w.dim() == 1 else 4096


def parallelize(
    model: nn.Module,
    parallelism: ParallelismConfig | None = None,
    *,
    activation_checkpointing: ActivationCheckpointingConfig | None = None,
    compile: CompileConfig | None = None,
    precision: str = "fp32",
    device: torch.device | None = None,
    cpu_matmul: str | None = None,
    float8: Float8Config | None = None,
    tiling: TilingConfig | None = None,
    microbatch_tokens: int | None = None,
    fused_ops: FusedOpsConfig | None = None,
) -> nn.Module:
    """Apply the sections to ``model`` in place and return it.

    ``activation_checkpointing`` and ``compile`` (None: off) apply in any number of
    processes. ``cpu_matmul`` (auto, onednn, blas; None: leave the process's backend as it is)
    picks the fp32 matmuls of training on a CPU. ``float8`` (None or not enabled: off) converts
    the linear layers to torchao's float8 training first, as torchtitan's converters do.
    ``parallelism`` (None: no FSDP) shards when
    there is more than one process (an initialised process group). Meta-device parameters are
    materialised afterwards, on ``device`` (default: the current CUDA device, else CPU).
    """
    device = device or pick_device()
    world = dist.world_size()
    mode = mat.init_mode(model)
    full = mat.full_state_on_rank0(model) if mode == "rank0" else {}
    routed = None
    if cpu_matmul is not None and resolve_cpu_matmul(cpu_matmul, device) == "onednn":
        routed = f"oneDNN matmuls in {route_linears(model)} linear layers"
    mesh = None
    summary: list[str] = []
    cp = getattr(parallelism, "cp", 1)
    dp_mesh = None
    if parallelism is not None and world > 1 and cp > 1:  # context parallel: parallel/cp.py
        replicate, shard, tp = *cp_mesh_shape(parallelism, world, dist.local_world_size()), 1
        problems = cp_plan_problems(model, cp)  # before any collective, as for tp
        if problems:
            raise ConfigError(problems)
        sum_only = sum_only_reductions(replicate, device.type)
        mesh, dp_mesh = build_cp_mesh(replicate, shard, cp, device.type)
        touched = apply_context_parallel(model, mesh["cp"])
        summary.append(f"context parallel (Ulysses: all-to-all over heads) over {cp} ranks "
                       f"({touched} attention modules from the model's plan)")
    elif parallelism is not None and world > 1:
        replicate, shard, tp = mesh_dims(parallelism, world, dist.local_world_size())
        if tp > 1:  # before any collective: every rank raises the same error
            problems = plan_problems(model, tp)
            if problems:
                raise ConfigError(problems)
        sum_only = sum_only_reductions(replicate, device.type)  # before any work: fail fast
        mesh = build_mesh(replicate, shard, device.type, tp)
        if tp > 1:  # torchtitan's order: TP, then AC, compile, FSDP
            touched = apply_tensor_parallel(model, mesh["tp"], world_mesh=mesh)
            unfuse_loss_without_reader(model)
            if full:
                permute_full_state(model, full)
            summary.append(f"tensor + sequence parallel over {tp} ranks ({touched} modules "
                           "from the model's plan)")
    elif parallelism is not None and parallelism.tp > 1:
        raise ConfigError([f"parallelism.tp: {parallelism.tp}, but this is one process; start "
                           f"{parallelism.tp} or a multiple (e.g. composer -n {parallelism.tp})"])
    elif parallelism is not None and cp > 1:
        raise ConfigError([f"parallelism.cp: {cp}, but this is one process; start {cp} or a "
                           f"multiple (e.g. composer -n {cp})"])
    if float8 is not None and float8.enabled:  # before AC, compile and FSDP2 see the layers
        summary.append(f"float8 ({float8.recipe}) in {apply_float8(model, float8)} linear layers")
    summary += apply_block_policies(model, activation_checkpointing or ActivationCheckpointingConfig(),
                                    compile or CompileConfig(enabled=False), device, tiling,
                                    microbatch_tokens, fused_ops)
    if routed:
        summary.append(routed)
    if mesh is not None:
        block_list = [m for _, m in blocks(model)]
        if not block_list:
            log.info("FSDP2: the model names no transformer blocks; its top-level modules are the "
                     "only FSDP units")
        dp_mesh = dp_mesh or data_parallel_mesh(mesh)
        shard_model(model, block_list, dp_mesh, parallelism, precision, sum_only)
        check_composer_contract(model)
        shape = "x".join(map(str, (replicate, shard) + ((tp,) if tp > 1 else ())
                             + ((cp,) if cp > 1 else ())))
        summary.insert(0, f"FSDP2 {parallelism.sharding_strategy} over {dp_mesh.size()} ranks "
                          f"(mesh {shape}, {len(block_list)} blocks as units)"
                       if dp_mesh.size() > 1 else  # tp = world size: one data-parallel rank
                       f"FSDP2 on 1 data-parallel rank, nothing sharded (mesh {shape}, "
                       f"{len(block_list)} blocks as units)")
    elif parallelism is not None:
        log.info("parallelism is set but this is one process: no sharding (activation "
                 "checkpointing and compile still apply)")
    if mode == "meta":
        mat.init_meta(model, device)
    elif mode == "rank0":
        mat.broadcast_from_rank0(model, full, device)
    if summary or mode != "real":
        log.info("parallelism: %s; weights: %s", ", ".join(summary) or "none",
                 {"meta": "initialised per shard", "rank0": "broadcast from rank 0",
                  "real": "as built"}[mode])
    if parallelism is not None and parallelism.verbose:
        log.info("parallelized model:\n%s", model)
    return model
