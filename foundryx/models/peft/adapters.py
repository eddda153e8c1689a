"""LoRA weights by name, and PEFT adapter folders (``adapter_config.json`` +
``adapter_model.safetensors``, what ``peft.PeftModel.save_pretrained`` writes and
``PeftModel.from_pretrained`` reads).

Names: inside a model with injected adapters a LoRA weight is ``<layer>.lora_A.default.weight``
and the frozen weight it adapts ``<layer>.base_layer.weight``; a PEFT folder names the former
``base_model.model.<layer>.lora_A.weight``. ``model.pretrained_lora_id_or_path`` loads such a
folder into the built model (:func:`load_adapter`); ``foundryx export`` writes one.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import torch
from torch import nn

from foundryx.config.types import coerce
from foundryx.errors import ConfigError
from foundryx.models.peft.options import LoraOptions

log = logging.getLogger(__name__)

ADAPTER = "default"  # PEFT's name of the one adapter inject_adapter_in_model adds
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
PATH = "model.pretrained_lora_id_or_path"
# LoraOptions fields compared with (or taken from) an adapter's config
COMPARED = ("r", "lora_alpha", "use_rslora", "target_modules")


def is_adapter_key(key: str) -> bool:
    """Whether a state-dict key is a LoRA weight (``lora_A`` / ``lora_B``)."""
    return ".lora_A." in key or ".lora_B." in key


def base_key(key: str) -> str:
    """The name a frozen weight has in the model without adapters (``base_layer`` dropped)."""
    return key.replace(".base_layer.", ".")


def has_lora(model: nn.Module) -> bool:
    return any(is_adapter_key(n) for n, _ in model.named_parameters())


def to_peft_key(key: str) -> str:
    """``<layer>.lora_A.default.weight`` (inner-model name) → PEFT's saved name."""
    return PEFT_PREFIX + key.replace(f".{ADAPTER}.", ".")


def from_peft_key(key: str) -> str:
    """PEFT's saved name → the inner-model name (inverse of :func:`to_peft_key`)."""
    key = key.removeprefix(PEFT_PREFIX)
    for part in ("lora_A", "lora_B"):
        key = key.replace(f".{part}.weight", f".{part}.{ADAPTER}.weight")
    return key


def peft_config_dict(options: LoraOptions, target_modules: list[str], base: str | None) -> dict[str, Any]:
    """The ``adapter_config.json`` of ``options`` (PEFT's own ``LoraConfig`` serialised)."""
    from peft import LoraConfig  # a heavy optional import, used only here

    config = LoraConfig(r=options.r, lora_alpha=options.lora_alpha,
                        lora_dropout=options.lora_dropout, use_rslora=options.use_rslora,
                        target_modules=sorted(target_modules), bias="none",
                        task_type="CAUSAL_LM", base_model_name_or_path=base)
    out = config.to_dict()
    return json.loads(json.dumps(out, default=lambda v: sorted(v) if isinstance(v, set) else str(v)))


def write_adapter_folder(folder: Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> None:
    """Write ``tensors`` (PEFT names) and ``config`` as a PEFT adapter folder."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in tensors.items()}, str(folder / WEIGHTS_FILE),
              metadata={"format": "pt"})
    (folder / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")


def read_adapter_config(folder: str | Path) -> dict[str, Any]:
    """An adapter folder's ``adapter_config.json``; ConfigError naming the folder otherwise."""
    path = Path(folder).expanduser() / CONFIG_FILE
    if not path.is_file():
        raise ConfigError([f"{PATH}: {folder!r} holds no {CONFIG_FILE}; give a folder written by "
                           "PeftModel.save_pretrained or `foundryx export` of a LoRA run"])
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError([f"{PATH}: {path} is unreadable ({e})"]) from None
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        kind = config.get("peft_type") if isinstance(config, dict) else None
        raise ConfigError([f"{PATH}: {path} is a {kind!r} adapter; foundryx loads LoRA adapters "
                           "(peft_type: LORA) only"])
    return config


def options_from_adapter(config: dict[str, Any]) -> LoraOptions:
    """``LoraOptions`` with an adapter config's values (its targets sorted, as a list)."""
    targets = config.get("target_modules")
    targets = "all-linear" if targets == "all-linear" else sorted(targets or [])
    return LoraOptions(target_modules=targets, r=int(config["r"]),
                       lora_alpha=float(config["lora_alpha"]),
                       lora_dropout=float(config.get("lora_dropout") or 0.0),
                       use_rslora=bool(config.get("use_rslora", False)))


def config_differences(options: LoraOptions, config: dict[str, Any]) -> list[str]:
    """Where ``model.peft_config`` disagrees with an adapter's config (lora_dropout may differ:
    it changes training, not the weights)."""
    theirs = options_from_adapter(config)
    out = []
    for field in COMPARED:
        mine, other = getattr(options, field), getattr(theirs, field)
        if field == "target_modules" and isinstance(mine, list) and isinstance(other, list):
            same = sorted(mine) == other
        else:
            same = mine == other
        if not same:
            out.append(f"model.peft_config.{field} is {mine!r}, the adapter's is {other!r}")
    return out


def read_adapter_weights(folder: str | Path) -> dict[str, torch.Tensor]:
    """The adapter's tensors keyed as inside a model (see :func:`from_peft_key`)."""
    from safetensors.torch import load_file

    folder = Path(folder).expanduser()
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        legacy = folder / "adapter_model.bin"
        raise ConfigError([f"{PATH}: {folder} holds no {WEIGHTS_FILE}"
                           + (" (only adapter_model.bin, which foundryx does not unpickle; "
                              "re-save it with safe_serialization=True)" if legacy.is_file() else "")])
    try:
        tensors = load_file(str(path), device="cpu")
    except Exception as e:  # safetensors raises its own error types for a damaged file
        raise ConfigError([f"{PATH}: {path} is unreadable ({e})"]) from None
    return {from_peft_key(k): v for k, v in tensors.items()}


def load_adapter(model: nn.Module, folder: str | Path) -> bool:
    """Copy the adapter weights of ``folder`` into ``model`` (the inner model, adapters already
    injected, not yet sharded); ConfigError when they do not fit (:func:`check_fits`). A model
    built on the meta device has no memory to copy into yet: the adapter is only checked, and
    False returned (the loader reads it into the shards after materialisation:
    foundryx.loading.adapter)."""
    weights = read_adapter_weights(folder)
    params = {n: p for n, p in model.named_parameters() if is_adapter_key(n)}
    check_fits(folder, {n: tuple(w.shape) for n, w in weights.items()},
               {n: tuple(p.shape) for n, p in params.items()})
    if any(p.is_meta for p in params.values()):
        return False
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(weights[name].to(p.dtype))
    log.info("LoRA adapter loaded from %s (%d weights)", folder, len(params))
    return True


def check_fits(folder: str | Path, weights: dict[str, tuple[int, ...]],
               params: dict[str, tuple[int, ...]]) -> None:
    """ConfigError naming the first weight of the adapter in ``folder`` that does not fit the
    model's LoRA weights (missing from the model or the adapter, or of another shape), with
    both shapes. ``weights`` and ``params``: shapes by inner-model name."""
    for name in sorted(set(weights) | set(params)):
        if name not in params:
            raise ConfigError([f"{PATH}: the adapter in {folder} does not fit the model: its weight "
                               f"{to_peft_key(name)!r} {weights[name]} has no LoRA "
                               "layer in the model (another base, or other target_modules)"])
        if name not in weights:
            raise ConfigError([f"{PATH}: the adapter in {folder} does not fit the model: the model's "
                               f"LoRA weight {to_peft_key(name)!r} {params[name]} is "
                               "missing from it (other target_modules)"])
        if weights[name] != params[name]:
            raise ConfigError([f"{PATH}: the adapter in {folder} does not fit the model: weight "
                               f"{to_peft_key(name)!r} has shape {weights[name]} in "
                               f"the adapter, {params[name]} in the model (an adapter "
                               "trained on another base)"])


def section_options(peft_section: Any, adapter: str | None) -> LoraOptions | None:
    """The LoRA options of a model section: ``peft_config``; with ``pretrained_lora_id_or_path``
    (a PEFT adapter folder) they are checked against the adapter's config (ConfigError listing
    the differences), or taken from it when ``peft_config`` is absent (logged)."""
    options = None if peft_section is None else coerce(LoraOptions, peft_section, owner="model.peft_config")
    if adapter is None:
        return options
    config = read_adapter_config(adapter)
    if options is None:
        options = options_from_adapter(config)
        log.info("model.peft_config: not set; taken from %s (r=%d, lora_alpha=%g, targets %s)",
                 adapter, options.r, options.lora_alpha, options.target_modules)
        return options
    differences = config_differences(options, config)
    if differences:
        raise ConfigError([f"model.pretrained_lora_id_or_path: the adapter {adapter} was trained "
                           f"with another LoRA config: {'; '.join(differences)}; make them equal "
                           "or remove model.peft_config to take the adapter's"])
    return options
