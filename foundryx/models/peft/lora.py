"""LoRA applied to a built model, before parallelism and the optimizer (torchtitan's order:
model -> LoRA -> activation checkpointing, compile, FSDP2 -> optimizer).

The adapters are PEFT's own LoRA layers, put in place with ``peft.inject_adapter_in_model``:
each targeted ``nn.Linear`` becomes a ``peft`` ``lora.Linear`` holding the original layer as
``base_layer`` plus ``lora_A`` / ``lora_B``. The model object and its classes stay as they were
(no ``PeftModel`` wrapper), so the model's forward, its FSDP / checkpointing hooks and the
Composer wrapper are unchanged. Every other parameter is frozen.

A model may declare logical target names (``lora_logical_targets``: MPT's ``q``, ``k``, ``v``
address row slices of the fused ``Wqkv``; ``o``, ``up``, ``down``, ``gate`` its other
projections). Slices are adapted by :class:`foundryx.models.peft.fused.FusedLoraLinear`.

Adapter weights do not depend on the global RNG: each is drawn from the run's seed and its
name, and carries a ``param_init_fn`` repeating that init, so a model built on the meta device
(initialised after FSDP2 sharding) or loaded on rank 0 and broadcast gets the same adapters as
one built on the CPU, on every rank.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from typing import Any

import torch
from torch import nn

from foundryx.errors import ConfigError, did_you_mean
from foundryx.models.peft.fused import FusedLoraLinear, adapter_seed, attach_init
from foundryx.models.peft.options import ALL_LINEAR, LoraOptions

log = logging.getLogger(__name__)

PATH = "model.peft_config"


def inner_model(model: nn.Module) -> nn.Module:
    """The module LoRA addresses: a Composer ``HuggingFaceModel``'s ``.model``, else ``model``."""
    inner = getattr(model, "model", None)
    return inner if isinstance(inner, nn.Module) else model


def linear_modules(model: nn.Module) -> dict[str, nn.Linear]:
    """``{dotted name: module}`` of the model's linear layers, the output projection left out
    (its weight may be read directly, e.g. by MPT's fused loss, so an adapter there would not
    apply)."""
    get_out = getattr(model, "get_output_embeddings", None)
    out = get_out() if callable(get_out) else None
    return {name: m for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and m is not out}


def _matches(name: str, target: str) -> bool:
    """PEFT's rule for a list of target names: the full name, or its last dotted parts."""
    return name == target or name.endswith("." + target)


def logical_targets(model: nn.Module) -> dict[str, tuple[str, int | None]]:
    """The model's logical target names: ``{name: (module name, slice index or None)}``; the
    slice index picks rows of a fused linear layer (its ``_fused`` row sizes)."""
    table = getattr(model, "lora_logical_targets", None)
    return dict(table) if isinstance(table, dict) else {}


class Targets:
    """What ``target_modules`` selects: whole linear layers (PEFT's LoRA) and slices of fused
    ones (``{dotted name: (layer, [slice names])}``)."""

    def __init__(self) -> None:
        self.whole: dict[str, nn.Linear] = {}
        self.slices: dict[str, tuple[nn.Linear, list[str]]] = {}

    def __len__(self) -> int:
        return len(self.whole) + len(self.slices)


def _slice_names(model: nn.Module, module_short: str) -> list[str]:
    """The logical names of the slices of fused layer ``module_short``, in row order."""
    table = logical_targets(model)
    named = sorted((idx, n) for n, (mod, idx) in table.items() if mod == module_short and idx is not None)
    return [n for _, n in named]


def resolve_targets(model: nn.Module, options: LoraOptions) -> Targets:
    """The linear layers (and fused-layer slices) ``options.target_modules`` selects in
    ``model`` (the inner model); a ConfigError (with the YAML path) for a name that selects
    nothing, a slice and its whole layer named together, or an ``r`` larger than a target's
    smaller dimension."""
    linears = linear_modules(model)
    logical = logical_targets(model)
    short = sorted({n.rsplit(".", 1)[-1] for n in linears})
    where = f"{PATH}.target_modules"
    found = Targets()
    if options.target_modules == ALL_LINEAR:
        found.whole = dict(linears)
    else:
        problems = []
        all_names = dict(model.named_modules())
        sliced: dict[str, list[str]] = defaultdict(list)
        for i, target in enumerate(options.target_modules):
            module_name, index = logical.get(target, (target, None))
            hits = {n: m for n, m in linears.items() if _matches(n, module_name)}
            if not hits:
                others = [n for n in all_names if n and _matches(n, module_name)]
                what = (f"names {type(all_names[others[0]]).__name__} {others[0]!r}, not a "
                        "linear layer LoRA can adapt" if others else "matches no linear layer")
                if module_name != target:
                    what = f"(the model's {module_name}) {what}"
                names = short + sorted(logical)
                logical_note = (f"; its logical targets are: {', '.join(sorted(logical))}"
                                if logical else "")
                problems.append(
                    f"{where}[{i}]: {target!r} {what}{did_you_mean(target, names)}; the "
                    f"model's linear layers are: {', '.join(short) or 'none'}{logical_note} (or "
                    f"write target_modules: {ALL_LINEAR})")
            elif index is None:
                found.whole.update(hits)
            else:
                for n in hits:
                    sliced[n].append(target)
        for n, chosen in sliced.items():
            if n in found.whole:
                problems.append(
                    f"{where}: {', '.join(chosen)} and {n.rsplit('.', 1)[-1]} both adapt "
                    f"{n.rsplit('.', 1)[-1]}; name either the whole layer or its slices")
                continue
            order = _slice_names(model, n.rsplit(".", 1)[-1])
            found.slices[n] = (linears[n], [s for s in order if s in chosen])
        if problems:
            raise ConfigError(problems)
    if not found:
        raise ConfigError([f"{where}: the model has no linear layers to adapt"])
    dims = [(n, m.in_features, m.out_features) for n, m in found.whole.items()]
    for n, (m, chosen) in found.slices.items():
        sizes = dict(zip(_slice_names(model, n.rsplit(".", 1)[-1]), m._fused))
        dims += [(f"{n}[{s}]", m.in_features, sizes[s]) for s in chosen]
    name, d_in, d_out = min(dims, key=lambda d: min(d[1], d[2]))
    if options.r > min(d_in, d_out):
        raise ConfigError([
            f"{PATH}.r: {options.r} is larger than the smaller dimension of target {name!r} "
            f"({d_in} in, {d_out} out); use r <= {min(d_in, d_out)}, or leave that layer out "
            "of target_modules"])
    return found


def param_counts(model: nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameter counts."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def plain_linear_dispatch(config: Any, one_pass: bool = False) -> Any:
    """``config`` (a peft ``LoraConfig``) with ``nn.Linear`` mapped straight to PEFT's own
    ``lora.Linear`` (``one_pass``: its subclass with the adapter path in one pass,
    ``one_pass.OnePassLoraLinear``), skipping PEFT's dispatchers (torchao, bitsandbytes, ...):
    at injection every base layer is a plain ``nn.Linear`` (low-precision storage is applied
    afterwards by foundryx.models.peft.frozen_base), and injection then does not depend on
    which optional quantization packages are installed (PEFT 0.21 raises ImportError for a
    torchao older than 0.16)."""
    if one_pass:  # imports peft (heavy, optional): only here
        from foundryx.models.peft.one_pass import OnePassLoraLinear as Linear
    else:
        from peft.tuners.lora.layer import Linear  # a heavy optional import, used only here

    config._register_custom_module({nn.Linear: Linear})
    return config


def _inject_slices(inner: nn.Module, targets: Targets, options: LoraOptions) -> None:
    """Replace each fused layer that has chosen slices by a FusedLoraLinear around it."""
    for name, (layer, chosen) in targets.slices.items():
        parent_name, _, child = name.rpartition(".")
        parent = inner.get_submodule(parent_name) if parent_name else inner
        slices = dict(zip(_slice_names(inner, child), layer._fused))
        setattr(parent, child, FusedLoraLinear(
            layer, slices, chosen, r=options.r, lora_alpha=options.lora_alpha,
            lora_dropout=options.lora_dropout, use_rslora=options.use_rslora, name=name))


def _seed_peft_adapters(inner: nn.Module) -> None:
    """Re-initialise PEFT's adapters from the run's seed and their names (see the module doc)."""
    for name, module in inner.named_modules():
        for attr, is_a in (("lora_A", True), ("lora_B", False)):
            holder = getattr(module, attr, None)
            if isinstance(holder, nn.ModuleDict) and not isinstance(module, FusedLoraLinear):
                for adapter, layer in holder.items():
                    attach_init(layer, is_a, adapter_seed(f"{name}.{attr}.{adapter}"))


def apply_lora(model: nn.Module, options: LoraOptions) -> nn.Module:
    """Put LoRA adapters on the layers ``options`` targets, in place, and freeze every other
    parameter; log trainable / total parameters once. Returns ``model`` (a Composer model or a
    plain one). Raises ConfigError, before changing anything, for bad targets or rank. Works
    on a model built on the meta device too (its adapters are materialised with it)."""
    from peft import LoraConfig, inject_adapter_in_model  # a heavy optional import, used only here

    inner = inner_model(model)
    targets = resolve_targets(inner, options)
    # Injection draws PEFT's own init from the global RNG; keep the run's RNG stream as it
    # was (the adapters are re-drawn from their own seeds below).
    with torch.random.fork_rng(devices=[]):
        if targets.whole:
            config = LoraConfig(r=options.r, lora_alpha=options.lora_alpha,
                                lora_dropout=options.lora_dropout, use_rslora=options.use_rslora,
                                target_modules=sorted(targets.whole), bias="none")
            inject_adapter_in_model(plain_linear_dispatch(config, options.one_pass), inner)
            _seed_peft_adapters(inner)
        _inject_slices(inner, targets, options)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_A." in name or ".lora_B." in name)
    trainable, total = param_counts(model)
    sliced = sum(len(c) for _, c in targets.slices.values())
    log.info("LoRA (r=%d, alpha=%g%s%s) on %d linear layers%s: %s of %s parameters train "
             "(%.4f%%)", options.r, options.lora_alpha, ", rslora" if options.use_rslora else "",
             ", adapter path in one pass" if options.one_pass and targets.whole else "",
             len(targets.whole) + len(targets.slices),
             f" ({sliced} slices of {len(targets.slices)} fused ones)" if targets.slices else "",
             f"{trainable:,}", f"{total:,}", 100 * trainable / max(total, 1))
    return model
