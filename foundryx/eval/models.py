"""Models for standalone eval: a foundryx checkpoint (rebuilt by
:func:`foundryx.checkpoint.rebuild.rebuild_model`, from its run config or its own record) or
a Hugging Face causal LM, each as a Composer model with its tokenizer."""

from __future__ import annotations

import logging
from typing import Any

from transformers import AutoModelForCausalLM

import foundryx.models.mpt.modeling  # noqa: F401  (lets Auto* load exported foundryx MPTs)
from foundryx.checkpoint.rebuild import build_tokenizer, rebuild_model, wrap_hf_model
from foundryx.errors import CheckpointError
from foundryx.eval.config import EvalModelSpec

log = logging.getLogger(__name__)

__all__ = ["load_eval_model", "model_max_len", "wrap_hf_model"]


def _from_checkpoint(spec: EvalModelSpec) -> tuple[Any, Any]:
    rebuilt = rebuild_model(spec.checkpoint, run_config=spec.run_config, overrides=spec.overrides,
                            tokenizer=spec.tokenizer)
    if rebuilt.tokenizer is None:
        raise CheckpointError(f"{spec.checkpoint}: no tokenizer was saved or recorded with it; give "
                              "the model's tokenizer (a folder or hub name) as tokenizer:")
    return rebuilt.model, rebuilt.tokenizer


def _from_hf(spec: EvalModelSpec) -> tuple[Any, Any]:
    tokenizer = build_tokenizer(spec.tokenizer or spec.hf)
    try:
        model = AutoModelForCausalLM.from_pretrained(spec.hf)
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"could not load Hugging Face model {spec.hf!r}: {str(e).splitlines()[0]}. Give a "
            f"local folder with config.json and weights, or a hub name with network access."
        ) from None
    return wrap_hf_model(model, tokenizer), tokenizer


def load_eval_model(spec: EvalModelSpec) -> tuple[Any, Any]:
    """``(composer_model, tokenizer)`` for one model of an eval config, in eval mode."""
    model, tokenizer = _from_hf(spec) if spec.hf else _from_checkpoint(spec)
    model.eval()
    log.info("model %s: %s (%.1fM parameters)", spec.label, spec.hf or spec.checkpoint,
             sum(p.numel() for p in model.parameters()) / 1e6)
    return model, tokenizer


def model_max_len(model: Any) -> int | None:
    """The longest sequence the model takes, from its Hugging Face config (None: unknown)."""
    cfg = getattr(getattr(model, "model", model), "config", None)
    for name in ("max_seq_len", "max_position_embeddings", "n_positions"):
        value = getattr(cfg, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
