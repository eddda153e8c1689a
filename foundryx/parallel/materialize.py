"""Giving meta-device parameters real memory: only each rank's shards, never N full copies.

Three starting points, agreed across ranks:

- ``meta``: every rank built the model on the meta device; after sharding each rank allocates
  its shards (``to_empty``) and runs the model's ``param_init_fn`` on them.
- ``rank0``: rank 0 holds real (e.g. pretrained) weights, the others are on meta; rank 0's full
  state dict is broadcast and each rank keeps its shards (one copy in CPU memory, on rank 0).
- ``real``: every rank has real weights; nothing to do.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from foundryx.errors import ConfigError
from foundryx.parallel import dist
from foundryx.parallel.policy import init_function

log = logging.getLogger(__name__)

# A module's set of tensor names that a pretrained-weights loader fills after sharding
# (foundryx.loading): meta materialisation leaves them alone, so no rank initialises (or
# allocates a full-size temporary for) a weight that is about to be read from the files.
LOADED_ATTR = "_foundryx_loaded_later"
TP_ROWS_ATTR = "_foundryx_tp_rows"  # foundryx.parallel.tp: a fused layer's row order under TP


def has_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in (*model.parameters(), *model.buffers()))


def init_mode(model: nn.Module) -> str:
    """``meta``, ``rank0`` or ``real`` (see the module doc); ConfigError for other mixtures."""
    flags = dist.all_gather_object(has_meta(model))
    if all(flags):
        return "meta"
    if not any(flags):
        return "real"
    if not flags[0] and all(flags[1:]):
        return "rank0"
    raise ConfigError([
        "model: some ranks built it on the meta device and others did not "
        f"(meta on ranks {[r for r, f in enumerate(flags) if f]}); build it on meta everywhere "
        "(init_device: meta) or on rank 0 only"
    ])


def full_state_on_rank0(model: nn.Module) -> dict[str, Any]:
    """Rank 0's full model state dict (CPU); empty on other ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if dist.rank() != 0:
        return {}
    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def init_meta(model: nn.Module, device: torch.device) -> None:
    """Allocate meta parameters on ``device`` and initialise them, module by module.

    Modules are visited in ``model.modules()`` order, as a single-device init does; a module
    whose meta tensors are all marked as loaded later (``LOADED_ATTR``) is skipped. A module
    with sharded (DTensor) parameters is initialised on full-size temporary tensors, of
    which each rank keeps its own shards, so the result equals the unsharded init with the
    same seed, at the memory cost of one module's own parameters.

    A parameter shared by several modules (tied embeddings) stays shared: it is materialised
    and initialised once, by the first module that holds it, and every other holder then
    holds the new one (``to_empty`` alone would replace it in that one module and untie the
    others); a module's parameters that are already real are kept as they are.
    """
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for _, module in model.named_modules(remove_duplicate=False):
        for name, p in module._parameters.items():
            if p is not None and p.is_meta:
                holders.setdefault(id(p), []).append((module, name))
    shared = {k: v for k, v in holders.items() if len(v) > 1}
    inherited: dict[nn.Module, Any] = {}
    for module in model.modules():
        fn = init_function(module, inherited.get(module))
        for child in module.children():
            inherited[child] = fn
        later = getattr(module, LOADED_ATTR, ())
        own = [t for n, t in (*module.named_parameters(recurse=False),
                              *module.named_buffers(recurse=False)) if n not in later]
        if any(t.is_meta for t in own):
            before = dict(module._parameters)
            _init_module(module, fn, device)
            for name, old in before.items():
                if old is not None and not old.is_meta:  # e.g. a tied weight, already done
                    module._parameters[name] = old
                for other, other_name in shared.get(id(old), ()):
                    other._parameters[other_name] = module._parameters[name]
        for name, buf in module.named_buffers(recurse=False):
            if not buf.is_meta and buf.device != device:  # built for real beside meta params
                module._buffers[name] = buf.to(device)


def _init_module(module: nn.Module, fn: Any, device: torch.device) -> None:
    from torch.distributed.tensor import DTensor, distribute_tensor

    with torch.no_grad():
        module.to_empty(device=device, recurse=False)
        sharded = {n: p for n, p in module.named_parameters(recurse=False) if isinstance(p, DTensor)}
        for name, p in sharded.items():
            full = torch.empty(p.shape, dtype=p.dtype, device=device)
            module.register_parameter(name, nn.Parameter(full, requires_grad=p.requires_grad))
        if fn is not None:
            fn(module)
        elif callable(getattr(module, "reset_parameters", None)):
            module.reset_parameters()
        else:
            raise ConfigError([
                f"model: {type(module).__name__} has meta-device parameters but neither the "
                "model's param_init_fn nor the module's reset_parameters can initialise them; "
                "add param_init_fn to the model or build it on cpu"
            ])
        rows = getattr(module, TP_ROWS_ATTR, None)  # a fused layer reordered for TP
        for name, p in sharded.items():
            full = getattr(module, name)
            if rows is not None and name in ("weight", "bias"):
                full = full[rows]
            mine = distribute_tensor(full.detach(), p.device_mesh, p.placements, src_data_rank=None)
            p.to_local().copy_(mine.to_local())
            module.register_parameter(name, p)


def broadcast_from_rank0(model: nn.Module, full_state: dict[str, Any], device: torch.device) -> None:
    """Fill every rank's (sharded) parameters from rank 0's full state dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if dist.rank() != 0:
        model.to_empty(device=device)
    set_model_state_dict(model, full_state,
                         options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
    for buf in model.buffers():
        dist.broadcast(buf, src=0)
