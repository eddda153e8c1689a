"""Models for standalone eval: a foundryx checkpoint (rebuilt from its run config or its
``hf/`` folder) or a Hugging Face causal LM, each as a Composer ``HuggingFaceModel`` with its
tokenizer."""

from __future__ import annotations

import logging
from typing import Any

from foundryx.errors import CheckpointError
from foundryx.eval.config import ModelSpec

log = logging.getLogger(__name__)


def wrap_hf_model(model: Any, tokenizer: Any) -> Any:
    """A Hugging Face ``PreTrainedModel`` (causal LM) as a Composer model that ICL eval can run."""
    from composer.models import HuggingFaceModel

    return HuggingFaceModel(model=model, tokenizer=tokenizer, use_logits=True, shift_labels=True,
                            eval_metrics=[])


def _model_from_run_config(spec: ModelSpec) -> tuple[Any, Any]:
    from foundryx import builders
    from foundryx.config import load_config
    from foundryx.data.tokenizers import build_hf_tokenizer

    loaded = load_config(spec.run_config, spec.overrides, world_size=1)
    tokenizer = build_hf_tokenizer(spec.tokenizer) if spec.tokenizer else builders.build_tokenizer(loaded.cfg)
    return builders.build_model(loaded.cfg, tokenizer), tokenizer


def _model_from_metadata(spec: ModelSpec) -> tuple[Any, Any]:
    """The model (random weights) and tokenizer described by the checkpoint's ``hf/`` folder."""
    from transformers import AutoModelForCausalLM

    from foundryx.data.tokenizers import build_hf_tokenizer
    from foundryx.export.source import spec_from_checkpoint

    tokenizer = build_hf_tokenizer(spec.tokenizer) if spec.tokenizer else None
    meta = spec_from_checkpoint(spec.checkpoint, tokenizer)
    if meta is None or meta.tokenizer is None:
        raise CheckpointError(f"{spec.checkpoint}: no hf/ folder with a model config and tokenizer; "
                              "give run_config, the run YAML that trained it")
    return wrap_hf_model(AutoModelForCausalLM.from_config(meta.config), meta.tokenizer), meta.tokenizer


def _from_checkpoint(spec: ModelSpec) -> tuple[Any, Any]:
    from foundryx.checkpoint import load_model_weights

    if spec.run_config:
        model, tokenizer = _model_from_run_config(spec)
    else:
        model, tokenizer = _model_from_metadata(spec)
    state = load_model_weights(spec.checkpoint)
    source = spec.run_config or "its hf/ folder"
    fix = "give the run config (and overrides) it was trained with"
    try:
        missing, unexpected = model.load_state_dict(state, strict=False)
    except RuntimeError as e:  # shape mismatches
        lines = [ln.strip() for ln in str(e).splitlines()[1:4]]
        raise CheckpointError(f"{spec.checkpoint}: its weights do not fit the model of "
                              f"{source} ({'; '.join(lines)}); {fix}") from None
    if missing or unexpected:
        raise CheckpointError(
            f"{spec.checkpoint}: its weights do not match the model of {source} "
            f"(missing: {', '.join(missing[:5]) or 'none'}; unexpected: "
            f"{', '.join(unexpected[:5]) or 'none'}); {fix}"
        )
    return model, tokenizer


def _from_hf(spec: ModelSpec) -> tuple[Any, Any]:
    from transformers import AutoModelForCausalLM

    import foundryx.models.mpt.modeling  # noqa: F401  (lets Auto* load exported foundryx MPTs)
    from foundryx.data.tokenizers import build_hf_tokenizer

    tokenizer = build_hf_tokenizer(spec.tokenizer or spec.hf)
    try:
        model = AutoModelForCausalLM.from_pretrained(spec.hf)
    except (OSError, ValueError) as e:
        raise CheckpointError(
            f"could not load Hugging Face model {spec.hf!r}: {str(e).splitlines()[0]}. Give a "
            f"local folder with config.json and weights, or a hub name with network access."
        ) from None
    return wrap_hf_model(model, tokenizer), tokenizer


def load_eval_model(spec: ModelSpec) -> tuple[Any, Any]:
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
