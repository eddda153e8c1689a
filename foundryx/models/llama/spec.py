"""The shape of a Llama from its Hugging Face ``config.json``, and which configs
:class:`~foundryx.models.llama.model.LlamaLM` reproduces exactly.

Conservative by design: a config field this model does not implement the way transformers'
``LlamaModel`` does (4.57 and 5.x agree on everything accepted here) makes :func:`unsupported`
name it, and the caller keeps the transformers model. Both spellings of the rotary settings are
read: 4.x's ``rope_theta`` + ``rope_scaling`` and 5.x's ``rope_parameters``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from foundryx.errors import CheckpointError

__all__ = ["LlamaSpec", "spec_from_hf_config", "unsupported"]

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM"}
LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# transformers' config defaults for fields a config.json may leave out (4.57 and 5.x agree)
_DEFAULTS = {
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008,
              "num_hidden_layers": 32, "num_attention_heads": 32, "rms_norm_eps": 1e-6,
              "max_position_embeddings": 2048, "tie_word_embeddings": False},
    "mistral": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 14336,
                "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
                "rms_norm_eps": 1e-6, "max_position_embeddings": 4096 * 32,
                "tie_word_embeddings": False, "sliding_window": 4096},
}
_INT_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
               "num_attention_heads", "max_position_embeddings")


@dataclass(frozen=True)
class LlamaSpec:
    """What a :class:`~foundryx.models.llama.model.LlamaLM` is built from. ``rope_scaling`` is
    None (plain rotary) or the llama3 settings (``LLAMA3_KEYS``); ``dtype`` is the one the
    checkpoint declares (``torch_dtype`` / ``dtype``), None where it declares none."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float = 10000.0
    rope_scaling: dict[str, float] | None = None
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    dtype: torch.dtype | None = None


def _get(d: dict[str, Any], key: str) -> Any:
    family = d.get("model_type")
    return d[key] if key in d else _DEFAULTS.get(family, _DEFAULTS["llama"]).get(key)


def _rope(d: dict[str, Any]) -> tuple[Any, dict[str, Any] | None]:
    """(rope_theta, the scaling settings or None) in either spelling; the settings keep their
    ``rope_type`` (or legacy ``type``)."""
    params = d.get("rope_parameters")
    if isinstance(params, dict):  # transformers 5: one dict, rope_theta inside
        return params.get("rope_theta", d.get("rope_theta", 10000.0)), params
    return d.get("rope_theta", 10000.0), d.get("rope_scaling")


def _rope_type(settings: dict[str, Any] | None) -> str:
    if settings is None:
        return "default"
    return str(settings.get("rope_type", settings.get("type", "default")))


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def unsupported(d: dict[str, Any]) -> str | None:
    """Why the model of Hugging Face config ``d`` (a ``config.json`` as a dict) is not one
    :class:`~foundryx.models.llama.model.LlamaLM` reproduces exactly; None: it is."""
    family = d.get("model_type")
    if family not in ARCHITECTURES:
        return f"model_type {family!r} is not llama (or mistral without a sliding window)"
    archs = d.get("architectures")
    if archs is not None and list(archs) != [ARCHITECTURES[family]]:
        return f"architectures {archs} is not [{ARCHITECTURES[family]!r}]"
    if family == "mistral" and _get(d, "sliding_window") is not None:
        return f"mistral with sliding_window {_get(d, 'sliding_window')} (only null is supported)"
    for key in ("attention_bias", "mlp_bias"):
        if d.get(key):
            return f"{key} is true (biased projections are not implemented)"
    act = d.get("hidden_act", "silu")
    if act != "silu":
        return f"hidden_act {act!r} is not 'silu'"
    attn = d.get("attn_implementation", d.get("_attn_implementation"))
    if attn not in (None, "sdpa"):
        return f"attn_implementation {attn!r} (the native Llama computes SDPA's numbers)"
    if d.get("quantization_config") is not None:
        return "the checkpoint is quantized (quantization_config)"
    layer_types = d.get("layer_types")
    if layer_types is not None and any(t != "full_attention" for t in layer_types):
        return f"layer_types {sorted(set(layer_types))} are not all full_attention"
    if d.get("rope_parameters") is not None and d.get("rope_scaling") is not None:
        return "both rope_parameters and rope_scaling are set (transformers 4 and 5 read different ones)"
    theta, settings = _rope(d)
    if settings is not None and not isinstance(settings, dict):
        return f"rope scaling {settings!r} is not a dict"
    if not _number(theta) or theta <= 0:
        return f"rope_theta {theta!r} is not a positive number"
    kind = _rope_type(settings)
    if kind not in ("default", "llama3"):
        return f"rope scaling type {kind!r} (only llama3 is implemented)"
    if kind == "llama3":
        missing = [k for k in LLAMA3_KEYS if not _number(settings.get(k))]
        if missing:
            return f"llama3 rope scaling without numbers for {missing}"
        if settings["high_freq_factor"] == settings["low_freq_factor"]:
            return "llama3 rope scaling with high_freq_factor == low_freq_factor"
    for where in (d, settings or {}):
        factor = where.get("partial_rotary_factor", 1.0)
        if factor != 1.0:
            return f"partial_rotary_factor {factor} (transformers 4.57 and 5 differ on it)"
    for key in _INT_FIELDS:
        value = _get(d, key)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            return f"{key} {value!r} is not a positive integer"
    heads = _get(d, "num_attention_heads")
    kv_heads = d.get("num_key_value_heads") or _get(d, "num_key_value_heads") or heads
    if not isinstance(kv_heads, int) or kv_heads <= 0 or heads % kv_heads:
        return f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}"
    head_dim = d.get("head_dim") or _get(d, "hidden_size") // heads
    if not isinstance(head_dim, int) or head_dim <= 0 or head_dim % 2:
        return f"head_dim {head_dim!r} is not a positive even integer"
    if not _number(_get(d, "rms_norm_eps")):
        return f"rms_norm_eps {_get(d, 'rms_norm_eps')!r} is not a number"
    dtype = d.get("dtype", d.get("torch_dtype"))
    if dtype is not None and dtype not in DTYPES:
        return f"dtype {dtype!r} is not one of {sorted(DTYPES)}"
    return None


def spec_from_hf_config(d: dict[str, Any]) -> LlamaSpec:
    """The :class:`LlamaSpec` of Hugging Face config ``d``; a CheckpointError where
    :func:`unsupported` has a reason."""
    reason = unsupported(d)
    if reason is not None:
        raise CheckpointError(f"not a model the native Llama reproduces: {reason}")
    theta, settings = _rope(d)
    scaling = None
    if _rope_type(settings) == "llama3":
        scaling = {k: settings[k] for k in LLAMA3_KEYS}
    heads = _get(d, "num_attention_heads")
    dtype = d.get("dtype", d.get("torch_dtype"))
    return LlamaSpec(
        vocab_size=_get(d, "vocab_size"), hidden_size=_get(d, "hidden_size"),
        intermediate_size=_get(d, "intermediate_size"),
        num_hidden_layers=_get(d, "num_hidden_layers"), num_attention_heads=heads,
        num_key_value_heads=d.get("num_key_value_heads") or _get(d, "num_key_value_heads") or heads,
        head_dim=d.get("head_dim") or _get(d, "hidden_size") // heads,
        rms_norm_eps=float(_get(d, "rms_norm_eps")), rope_theta=float(theta), rope_scaling=scaling,
        tie_word_embeddings=bool(_get(d, "tie_word_embeddings")),
        max_position_embeddings=_get(d, "max_position_embeddings"),
        dtype=DTYPES[dtype] if dtype is not None else None)
