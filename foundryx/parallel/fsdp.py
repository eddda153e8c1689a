"""FSDP2 with public torch APIs: device mesh, mixed precision, ``fully_shard`` per block."""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import (
    CPUOffloadPolicy,
    FSDPModule,
    MixedPrecisionPolicy,
    fully_shard,
    register_fsdp_forward_method,
)

from foundryx.config.schema import ParallelismConfig
from foundryx.errors import ConfigError, did_you_mean
from foundryx.parallel.pinning import pins

log = logging.getLogger(__name__)

DTYPES = {
    "bf16": torch.bfloat16, "bfloat16": torch.bfloat16,
    "fp16": torch.float16, "float16": torch.float16, "half": torch.float16,
    "fp32": torch.float32, "float32": torch.float32, "float": torch.float32,
}
PRECISION_DTYPE = {"fp32": torch.float32, "amp_bf16": torch.bfloat16, "amp_fp16": torch.float16,
                   "amp_fp8": torch.bfloat16}
MP_KEYS = ("param_dtype", "reduce_dtype", "output_dtype")


def mixed_precision_policy(mixed_precision: str | dict[str, str], precision: str) -> MixedPrecisionPolicy:
    """FSDP2 MixedPrecisionPolicy for ``parallelism.mixed_precision`` under ``precision``.

    DEFAULT: gathered weights in the precision's dtype, gradients reduced in fp32. PURE: both
    in the precision's dtype. FULL: no casting (fp32). A mapping names the dtypes itself.
    """
    compute = PRECISION_DTYPE[precision]
    if isinstance(mixed_precision, dict):
        problems = [f"parallelism.mixed_precision.{k}: unknown key{did_you_mean(k, MP_KEYS)}"
                    for k in mixed_precision if k not in MP_KEYS]
        problems += [f"parallelism.mixed_precision.{k}: unknown dtype {v!r}; use one of "
                     f"{', '.join(DTYPES)}{did_you_mean(v, DTYPES)}"
                     for k, v in mixed_precision.items() if k in MP_KEYS and v not in DTYPES]
        if problems:
            raise ConfigError(problems)
        return MixedPrecisionPolicy(**{k: DTYPES[v] for k, v in mixed_precision.items()})
    if mixed_precision == "FULL":
        return MixedPrecisionPolicy()
    if mixed_precision == "PURE":
        return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=compute)
    return MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32)


def frozen_compute_dtype(parallelism: Any, precision: str, world_size: int) -> torch.dtype | None:
    """The dtype the compute sees frozen weights in when it is not theirs: FSDP2's
    ``param_dtype`` on several processes; bf16 for one process under ``amp_bf16`` (autocast, no
    FSDP2); else None (the weights' own). A frozen-only unit may then be stored in it (the
    loader keeps a bf16 checkpoint's dtype: foundryx/loading/dtypes.py; the planner counts it)."""
    if world_size < 2:
        return torch.bfloat16 if precision == "amp_bf16" else None
    if parallelism is None:
        return None
    return mixed_precision_policy(parallelism.mixed_precision, precision).param_dtype


def mesh_shape(parallelism: ParallelismConfig, world_size: int, local_world_size: int) -> tuple[int, int]:
    """(replicate, shard) sizes of the device mesh."""
    hybrid = parallelism.sharding_strategy == "HYBRID_SHARD"
    degree = parallelism.data_parallel_shard_degree
    shard = (local_world_size if hybrid else world_size) if degree == -1 else degree
    if shard < 1 or world_size % shard:
        raise ConfigError([
            f"parallelism.data_parallel_shard_degree: {shard} ranks per copy does not divide the "
            f"world size {world_size}; use a divisor of {world_size} (or -1)"
        ])
    return world_size // shard, shard


def mesh_dims(parallelism: ParallelismConfig, world_size: int,
              local_world_size: int) -> tuple[int, int, int]:
    """(replicate, shard, tp) sizes of the device mesh: the tensor-parallel ranks are the
    innermost (neighbours, within a node), the data-parallel ranks the rest."""
    tp = parallelism.tp
    if tp < 1 or world_size % tp:
        divisors = [d for d in range(1, world_size + 1) if world_size % d == 0]
        raise ConfigError([
            f"parallelism.tp: {tp} does not divide the world size {world_size}; use one of "
            f"{', '.join(map(str, divisors))}"
        ])
    if tp > 1 and parallelism.sharding_strategy == "HYBRID_SHARD" and local_world_size % tp:
        raise ConfigError([
            f"parallelism.tp: {tp} does not divide the {local_world_size} processes of a node; "
            "HYBRID_SHARD with tp keeps each TP group within a node"
        ])
    replicate, shard = mesh_shape(parallelism, world_size // tp, max(local_world_size // tp, 1))
    return replicate, shard, tp


def build_mesh(replicate: int, shard: int, device_type: str, tp: int = 1) -> DeviceMesh:
    """A 1-D mesh (shard) or, with replicas (hybrid sharding), a 2-D mesh (replicate, shard);
    with tensor parallelism a 3-D mesh (replicate, shard, tp)."""
    if tp > 1:
        log.info("device mesh: %d replicas x %d shards x %d tensor-parallel ranks",
                 replicate, shard, tp)
        return init_device_mesh(device_type, (replicate, shard, tp),
                                mesh_dim_names=("replicate", "shard", "tp"))
    if replicate == 1:
        return init_device_mesh(device_type, (shard,), mesh_dim_names=("shard",))
    log.info("FSDP2 hybrid sharding: %d replicas x %d shards", replicate, shard)
    return init_device_mesh(device_type, (replicate, shard), mesh_dim_names=("replicate", "shard"))


def data_parallel_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The axes FSDP2 shards over: all but ``tp``."""
    names = mesh.mesh_dim_names or ()
    if "tp" not in names:
        return mesh
    if mesh["replicate"].size() == 1:
        return mesh["shard"]
    return mesh["replicate", "shard"]


def sum_only_reductions(replicate: int, device_type: str) -> bool:
    """Whether hybrid sharding must avoid AVG reductions (gloo has none); ConfigError when
    this torch cannot (``set_force_sum_reduction_for_comms`` arrived in torch 2.8)."""
    if replicate == 1 or device_type != "cpu":
        return False
    if not hasattr(FSDPModule, "set_force_sum_reduction_for_comms"):
        raise ConfigError([
            "parallelism.sharding_strategy: HYBRID_SHARD on CPU (gloo) needs torch >= 2.8 "
            f"(this is {torch.__version__}: gloo cannot all-reduce with AVG); use FULL_SHARD "
            "on CPU, or GPUs (NCCL)"
        ])
    return True


def reduce_scatter_sums_averages(mesh: DeviceMesh) -> bool:
    """Whether the reduce-scatter of ``mesh``'s shard axis sums when asked to average.

    gloo in torch 2.7 does (torch 2.14's averages): FSDP2 reduce-scatters fp32 gradients with
    AVG, so each rank's gradient came out the SUM over the data-parallel ranks, N times too
    large. AdamW hides a constant factor, but not gradient clipping, SGD, or a resume at
    another data-parallel degree (the AdamW moments of N-fold gradients meet M-fold ones). One
    two-element probe per call; every rank calls it (it is a collective)."""
    import torch.distributed as tdist

    if mesh.device_type != "cpu":
        return False
    group = mesh.get_group(mesh.ndim - 1)
    n = tdist.get_world_size(group)
    if n == 1:
        return False
    out = torch.zeros(1)
    tdist.reduce_scatter_tensor(out, torch.ones(n), op=tdist.ReduceOp.AVG, group=group)
    return out.item() > 1.5


def _mean_of_sums(n: int):
    def hook(reduced: torch.Tensor) -> None:
        # fp32/bf16 went through the (summing) AVG; FSDP2 reduces fp16 with SUM and divides
        # by the data-parallel size itself (torch's _get_gradient_divide_factors)
        if reduced.dtype in (torch.float32, torch.bfloat16):
            reduced.div_(n)
    return hook


def fsdp_units(model: nn.Module, blocks: list[nn.Module]) -> list[nn.Module]:
    """The modules :func:`shard_model` makes FSDP2 units, in its order: each block, then each
    direct child of ``model`` that has parameters."""
    return [*blocks, *(c for c in model.children() if any(True for _ in c.parameters()))]


def unit_parameters(model: nn.Module, blocks: list[nn.Module]) -> list[list[tuple[nn.Module, str]]]:
    """For each of :func:`fsdp_units`, the places ``(module, name)`` of the parameters it
    manages: those under it and not under a unit sharded before it (as ``fully_shard`` takes
    them); a shared parameter once per place that holds it."""
    taken: set[int] = set()
    out = []
    for unit in fsdp_units(model, blocks):
        places = [(m, n) for _, m in unit.named_modules(remove_duplicate=False)
                  for n, p in m._parameters.items() if p is not None and id(p) not in taken]
        taken.update(id(m._parameters[n]) for m, n in places)
        out.append(places)
    return out


def register_forward_methods(unit: nn.Module) -> None:
    """FSDP2 gathers a unit's weights for its ``forward`` only; a model that reads them in
    other entry points names those methods in ``foundryx_forward_methods`` (a Hugging Face
    model's fused loss reads the output head's weight outside the head: models/hf.py), and
    each gets the same gather and reshard as ``forward`` (``register_fsdp_forward_method``)."""
    for name in getattr(unit, "foundryx_forward_methods", ()):
        register_fsdp_forward_method(unit, name)


def shard_model(model: nn.Module, blocks: list[nn.Module], mesh: DeviceMesh,
                parallelism: ParallelismConfig, precision: str, sum_only: bool = False) -> None:
    """``fully_shard`` each block, then each direct child of ``model`` that has parameters
    (the ComposerModel itself is not a unit, as in Composer)."""
    kwargs: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": parallelism.reshard_after_forward,
        "mp_policy": mixed_precision_policy(parallelism.mixed_precision, precision),
    }
    if parallelism.cpu_offload:
        # pinned for a GPU run only (the mesh's device is the run's, not the machine's)
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=pins(mesh.device_type))
    for unit in fsdp_units(model, blocks):
        fully_shard(unit, **(kwargs if any(unit is b for b in blocks)
                             else {**kwargs, "reshard_after_forward": False}))
        register_forward_methods(unit)
    if sum_only:
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_force_sum_reduction_for_comms(True)
    elif reduce_scatter_sums_averages(mesh):
        n = mesh.size(mesh.ndim - 1)
        log.info("FSDP2: gloo's reduce-scatter in torch %s sums where asked to average; "
                 "gradients are divided by the %d data-parallel ranks after it", torch.__version__, n)
        for m in model.modules():
            if isinstance(m, FSDPModule):
                m.set_all_reduce_hook(_mean_of_sums(n))
