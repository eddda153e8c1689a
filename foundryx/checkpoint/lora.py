"""LoRA checkpoints: what they hold and which base they belong to.

A LoRA run whose base comes from a source (``pretrained_model_name_or_path`` of
``hf_causal_lm`` with ``pretrained: true``, or ``load_path``: a weights file or a foundryx
checkpoint) saves only the adapter weights (``lora_A`` / ``lora_B``) and their optimizer
state, plus ``lora_base.json``: the base's source and a hash of its config. Resuming reads
the base from that source again and refuses (CheckpointError, exit 2) a base whose source or
config differs. A LoRA run on a randomly initialised base has no source to read the base from,
so its checkpoints hold the whole model (base included; logged once), as full runs do.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any

from torch import nn

from foundryx.checkpoint.layout import read_json, write_json_atomic
from foundryx.checkpoint.weights import load_model_weights, match_prefix
from foundryx.config.types import coerce
from foundryx.errors import CheckpointError
from foundryx.models.peft.adapters import base_key, has_lora, is_adapter_key
from foundryx.models.peft.lora import inner_model
from foundryx.models.peft.options import LoraOptions

log = logging.getLogger(__name__)

BASE_FILE = "lora_base.json"  # inside a checkpoint folder of a LoRA run
# config fields that do not change the base's weights or what they compute
_NOT_IDENTITY = {"_name_or_path", "transformers_version", "torch_dtype", "dtype", "architectures",
                 "init_device", "auto_map", "_attn_implementation_autoset", "_attn_implementation",
                 "attn_implementation", "use_cache", "_commit_hash"}


def config_hash(model: nn.Module) -> str | None:
    """sha256 (first 16 hex digits) of the model's Hugging Face config, fields that do not
    change the weights left out; None for a model without one."""
    config = getattr(inner_model(model), "config", None)
    if not hasattr(config, "to_dict"):
        return None
    fields = {k: v for k, v in config.to_dict().items() if k not in _NOT_IDENTITY}
    text = json.dumps(fields, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _normalise(source: str) -> str:
    p = Path(source).expanduser()
    return str(p.resolve()) if p.exists() else source


def base_record(model: nn.Module, model_section: dict[str, Any] | None,
                load_path: str | None, loaded: dict[str, Any] | None = None) -> dict[str, Any] | None:
    """What a checkpoint of ``model`` records about its base, or None when it has no LoRA:
    ``{"source": ..., "source_field": ..., "config_sha256": ..., "adapter_only": bool}``.
    ``loaded``: the base record of the checkpoint ``load_path`` names, if it is a LoRA run's.
    An adapter-only one gives this run its adapters, not its base (which comes, as it did for
    that run, from the model section): this run continues training them."""
    if not has_lora(model):
        return None
    section = model_section or {}
    source, field = None, None
    if load_path and not (loaded and loaded.get("adapter_only")):
        source, field = _normalise(str(load_path)), "load_path"
    elif section.get("pretrained_model_name_or_path") and section.get("pretrained", True):
        source, field = _normalise(str(section["pretrained_model_name_or_path"])), \
            "model.pretrained_model_name_or_path"
    return {"source": source, "source_field": field, "config_sha256": config_hash(model),
            "adapter_only": source is not None}


def adapter_state(model_sd: dict[str, Any]) -> dict[str, Any]:
    """The LoRA weights of a model state dict."""
    return {k: v for k, v in model_sd.items() if is_adapter_key(k)}


def write_base(folder: Path, record: dict[str, Any]) -> None:
    write_json_atomic(Path(folder) / BASE_FILE, record)


def read_base(folder: Path) -> dict[str, Any] | None:
    """A checkpoint's ``lora_base.json``, or None for a checkpoint of a run without LoRA."""
    path = Path(folder) / BASE_FILE
    return read_json(path) if path.is_file() else None


def is_adapter_only(folder: Path) -> bool:
    record = read_base(folder)
    return bool(record and record.get("adapter_only"))


def describe(record: dict[str, Any]) -> str:
    source = (f"{record['source_field']}: {record['source']}" if record.get("source")
              else "a randomly initialised base")
    return f"{source} (config sha256 {record.get('config_sha256')})"


def check_base(folder: Path, current: dict[str, Any] | None,
               via: str = "save_folder") -> dict[str, Any] | None:
    """The checkpoint's base record after checking that this run has LoRA and the same base;
    CheckpointError naming both bases otherwise, with the fix that applies to how the run
    reached ``folder`` (``via``: ``save_folder``, autoresume, or ``load_path``)."""
    saved = read_base(folder)
    if saved is None:
        return None
    where = f"load_path {folder}" if via == "load_path" else str(folder)
    if current is None:
        raise CheckpointError(
            f"{where} is a checkpoint of a LoRA run (its base: {describe(saved)}), but this run's "
            f"model has no peft_config; add the run's peft_config, or {_other(via)}")
    same_source = saved.get("source") == current.get("source") or not saved.get("adapter_only")
    if not same_source or saved.get("config_sha256") != current.get("config_sha256"):
        raise CheckpointError(
            f"{where} holds LoRA adapters trained on {describe(saved)}, but this run's base is "
            f"{describe(current)}; {_same_base(saved)}, or {_other(via)}")
    return saved


def _same_base(saved: dict[str, Any]) -> str:
    """The fix that gives a run the base ``saved`` records."""
    if saved.get("source") and saved.get("adapter_only"):
        return f"set {saved['source_field']}: {saved['source']} (the base they were trained on)"
    return "give the model section the run was trained with (the base they were trained on)"


def _other(via: str) -> str:
    return ("drop load_path to train new adapters on this base" if via == "load_path"
            else "use another save_folder")


def lora_options(section: dict[str, Any] | None) -> LoraOptions | None:
    """The ``LoraOptions`` of a recorded model section, or None when it has no peft_config."""
    peft = (section or {}).get("peft_config")
    return None if peft is None else coerce(LoraOptions, peft, owner="model.peft_config")


def with_base(model: nn.Module, adapters: dict[str, Any], folder: Path,
              saved: dict[str, Any]) -> dict[str, Any]:
    """The full state dict of ``model`` (a rebuilt LoRA model whose base came from a
    pretrained folder, already loaded) from an adapter-only checkpoint's ``adapters``: the
    base's weights are read from ``load_path`` when the checkpoint's base came from there.
    CheckpointError when the rebuilt base's config differs from the recorded one."""
    mine = config_hash(model)
    if mine != saved.get("config_sha256"):
        raise CheckpointError(
            f"{folder} holds LoRA adapters trained on {describe(saved)}, but the model rebuilt "
            f"for it has config sha256 {mine}; give the run config it was trained with")
    current = model.state_dict()
    names = {base_key(k): k for k in current if not is_adapter_key(k)}
    if saved.get("source_field") == "load_path":
        source = Path(saved["source"])
        if not source.exists():
            raise CheckpointError(
                f"{folder} holds only LoRA adapters; their base is load_path {source}, which is "
                "gone; put the base back there, or rebuild from a run config naming it")
        base = match_prefix(load_model_weights(source), names)
        base = {names[k]: v for k, v in base.items() if k in names}
    else:  # the pretrained base, loaded when the model was built
        base = {k: current[k] for k in names.values()}
    return {**base, **adapters}
