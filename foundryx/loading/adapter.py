"""A PEFT adapter (``model.pretrained_lora_id_or_path``) read into a model built on the meta
device, after parallelism has materialised it: every rank reads the adapter's file (LoRA weights
are small) and keeps its shards of each weight, fused rows in this run's tensor-parallel order.
A model built on a real device gets its adapter before parallelism
(:func:`foundryx.models.peft.adapters.load_adapter`), which for a meta-built one only checks
that the adapter fits and leaves the copy to :func:`load_adapter_shards`."""

from __future__ import annotations

import logging
from pathlib import Path

from torch import nn

from foundryx.errors import ConfigError
from foundryx.models.peft.adapters import PATH, is_adapter_key, read_adapter_weights
from foundryx.parallel import dist
from foundryx.parallel.tp_fused import permute_full_state

log = logging.getLogger(__name__)

ADAPTER_ATTR = "pretrained_adapter_folder"  # set by the builder on a meta-built model


def load_adapter_shards(model: nn.Module, folder: str | Path) -> None:
    """Copy the adapter in ``folder`` into ``model``'s (sharded) LoRA weights."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        set_model_state_dict,
    )

    weights = read_adapter_weights(folder)  # keyed by inner-model name; checked to fit already
    keys = [k for k in get_model_state_dict(model) if is_adapter_key(k)]
    first = next(iter(sorted(weights)), None)
    owner = next((k for k in keys if first and (k == first or k.endswith("." + first))), None)
    prefix = owner[:len(owner) - len(first)] if owner else ""
    full = {prefix + name: w for name, w in weights.items()}
    if owner is None or set(full) != set(keys):
        raise ConfigError([f"{PATH}: the adapter in {folder} names {len(weights)} LoRA weights, "
                           f"the model holds {len(keys)} others after parallelism; build the "
                           "model with init_device: cpu to load it before"])
    permute_full_state(model, full)  # a fused layer's rows as tensor parallelism ordered them
    count = len(full)  # set_model_state_dict adds the model's other keys to the dict it is given
    set_model_state_dict(model, full, options=StateDictOptions(full_state_dict=True, strict=False))
    if dist.rank() == 0:
        log.info("LoRA adapter loaded from %s (%d weights, into each rank's shards)", folder, count)
