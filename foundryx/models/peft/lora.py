"""LoRA applied to a built model, before parallelism and the optimizer (torchtitan's order:
model -> LoRA -> activation checkpointing, compile, FSDP2 -> optimizer).

The adapters are PEFT's own LoRA layers, put in place with ``peft.inject_adapter_in_model``:
each targeted ``nn.Linear`` becomes a ``peft`` ``lora.Linear`` holding the original layer as
``base_layer`` plus ``lora_A`` / ``lora_B``. The model object and its classes stay as they were
(no ``PeftModel`` wrapper), so the model's forward, its FSDP / checkpointing hooks and the
Composer wrapper are unchanged. Every other parameter is frozen.
"""

from __future__ import annotations

import logging

from torch import nn

from foundryx.errors import ConfigError, did_you_mean
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


def resolve_targets(model: nn.Module, options: LoraOptions) -> dict[str, nn.Linear]:
    """The linear layers ``options.target_modules`` selects in ``model`` (the inner model);
    a ConfigError (with the YAML path) for a name that selects no linear layer or an ``r``
    larger than a target's smaller dimension."""
    linears = linear_modules(model)
    short = sorted({n.rsplit(".", 1)[-1] for n in linears})
    where = f"{PATH}.target_modules"
    if options.target_modules == ALL_LINEAR:
        chosen = dict(linears)
    else:
        problems, chosen = [], {}
        all_names = dict(model.named_modules())
        for i, target in enumerate(options.target_modules):
            hits = {n: m for n, m in linears.items() if _matches(n, target)}
            if not hits:
                others = [n for n in all_names if n and _matches(n, target)]
                what = (f"names {type(all_names[others[0]]).__name__} {others[0]!r}, not a "
                        "linear layer LoRA can adapt" if others else "matches no linear layer")
                problems.append(
                    f"{where}[{i}]: {target!r} {what}{did_you_mean(target, short)}; the "
                    f"model's linear layers are: {', '.join(short) or 'none'} (or write "
                    f"target_modules: {ALL_LINEAR})")
            chosen.update(hits)
        if problems:
            raise ConfigError(problems)
    if not chosen:
        raise ConfigError([f"{where}: the model has no linear layers to adapt"])
    name, layer = min(chosen.items(), key=lambda kv: min(kv[1].in_features, kv[1].out_features))
    smallest = min(layer.in_features, layer.out_features)
    if options.r > smallest:
        raise ConfigError([
            f"{PATH}.r: {options.r} is larger than the smaller dimension of target {name!r} "
            f"({layer.in_features} in, {layer.out_features} out); use r <= {smallest}, or "
            "leave that layer out of target_modules"])
    return chosen


def param_counts(model: nn.Module) -> tuple[int, int]:
    """``(trainable, total)`` parameter counts."""
    params = list(model.parameters())
    return sum(p.numel() for p in params if p.requires_grad), sum(p.numel() for p in params)


def apply_lora(model: nn.Module, options: LoraOptions) -> nn.Module:
    """Put LoRA adapters on the layers ``options`` targets, in place, and freeze every other
    parameter; log trainable / total parameters once. Returns ``model`` (a Composer model or a
    plain one). Raises ConfigError, before changing anything, for bad targets or rank."""
    from peft import LoraConfig, inject_adapter_in_model  # a heavy optional import, used only here

    inner = inner_model(model)
    targets = resolve_targets(inner, options)
    config = LoraConfig(r=options.r, lora_alpha=options.lora_alpha,
                        lora_dropout=options.lora_dropout, use_rslora=options.use_rslora,
                        target_modules=sorted(targets), bias="none")
    inject_adapter_in_model(config, inner)
    for name, p in model.named_parameters():
        p.requires_grad_(".lora_A." in name or ".lora_B." in name)
    trainable, total = param_counts(model)
    log.info("LoRA (r=%d, alpha=%g%s) on %d linear layers: %s of %s parameters train (%.4f%%)",
             options.r, options.lora_alpha, ", rslora" if options.use_rslora else "",
             len(targets), f"{trainable:,}", f"{total:,}", 100 * trainable / max(total, 1))
    return model
