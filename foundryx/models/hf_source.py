"""Where a Hugging Face model comes from: a local folder, a hub name, or a config dict.

Shared by ``hf_causal_lm`` (training) and its options check. Whether a name is a folder or
a hub id, and whether the hub answers, is :mod:`foundryx.runtime.hub`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from foundryx.errors import ConfigError, did_you_mean


def config_from_dict(config: Mapping[str, Any], key: str) -> Any:
    """A ``PretrainedConfig`` from ``{model_type: ..., **fields}``."""
    from transformers import AutoConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    fields = dict(config)
    model_type = fields.pop("model_type", None)
    if model_type not in CONFIG_MAPPING:
        hint = did_you_mean(str(model_type), CONFIG_MAPPING.keys()) or (
            "; e.g. llama, mistral, qwen2, gpt_neox, gpt2"
        )
        raise ConfigError([f"{key}.model_type: {model_type!r} is not a Hugging Face model type{hint}"])
    return AutoConfig.for_model(model_type, **fields)


def override_problems(config: Any, overrides: Mapping[str, Any], key: str) -> list[str]:
    """Override keys that ``config`` (a PretrainedConfig) does not have."""
    known = set(config.to_dict()) | set(getattr(config, "attribute_map", {}))
    return [
        f"{key}.{k}: {type(config).__name__} has no attribute {k!r}{did_you_mean(k, known)}"
        for k in overrides
        if k not in known
    ]


def apply_overrides(config: Any, overrides: Mapping[str, Any], key: str) -> Any:
    """Set each override on ``config``; ConfigError naming unknown keys."""
    problems = override_problems(config, overrides, key)
    if problems:
        raise ConfigError(problems)
    for k, v in overrides.items():
        setattr(config, k, v)
    return config
