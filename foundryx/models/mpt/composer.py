"""``ComposerMPTCausalLM``: MPTForCausalLM as a Composer model (loss, metrics, FLOPs)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from composer.metrics.nlp import LanguageCrossEntropy, LanguagePerplexity

from foundryx.config.types import options_or_fields, to_data
from foundryx.errors import ConfigError, DataError
from foundryx.models.composer_base import FusedLossLM, labels_of
from foundryx.models.mpt.configuration import MPTConfig
from foundryx.models.mpt.modeling import MPTForCausalLM
from foundryx.models.mpt.options import RUN_FIELDS, MPTOptions


class ComposerMPTCausalLM(FusedLossLM):
    """An MPT causal LM: ``ComposerMPTCausalLM(tokenizer, options=MPTOptions(...))``, or with
    the options as keywords: ``ComposerMPTCausalLM(tokenizer, d_model=..., attn_config={...})``.

    Batches are dicts with ``input_ids`` (batch, seq) and optionally ``attention_mask``
    (1 = token, 0 = padding), ``labels`` (aligned with input_ids; the model shifts them; by
    default input_ids with padding set to -100) and ``sequence_id`` (read only when
    ``attn_config.attn_uses_sequence_id`` is true, and then required).
    ``self.model`` is the underlying :class:`MPTForCausalLM`.
    """

    def __init__(self, tokenizer: Any = None, options: MPTOptions | None = None, **fields: Any):
        options = options_or_fields(MPTOptions, options, fields, "the 'mpt_causal_lm' model")
        if tokenizer is not None and options.vocab_size < len(tokenizer):
            raise ConfigError([
                f"model.vocab_size: {options.vocab_size} is smaller than the tokenizer's "
                f"{len(tokenizer)} tokens; set vocab_size >= {len(tokenizer)} (a multiple of "
                "64 is fastest)"
            ])
        model = MPTForCausalLM(MPTConfig(**{k: to_data(v) for k, v in vars(options).items()
                                            if k not in RUN_FIELDS}))
        super().__init__(
            model=model,
            tokenizer=tokenizer,
            use_logits=True,
            metrics=[LanguageCrossEntropy()],
            eval_metrics=[LanguageCrossEntropy(), LanguagePerplexity()],
        )
        self.n_matmul_params = matmul_params(model)
        self.uses_sequence_id = options.uses_sequence_id

    def _forward(self, batch: Mapping[str, Any], fused: bool):
        kwargs = {"input_ids": batch["input_ids"], "attention_mask": batch.get("attention_mask")}
        if self.uses_sequence_id:
            if batch.get("sequence_id") is None:
                raise DataError(
                    "model.attn_config.attn_uses_sequence_id is true but the batch "
                    "has no sequence_id; use a packing dataloader that emits it, or "
                    "set attn_uses_sequence_id: false"
                )
            kwargs["sequence_id"] = batch["sequence_id"]
        if batch.get("position_ids") is not None:  # a context-parallel shard's (parallel/cp.py)
            kwargs["position_ids"] = batch["position_ids"]
        if fused and batch.get("shift_labels") is not None:
            return self.model(**kwargs, shift_labels=batch["shift_labels"], return_logits=False)
        if fused:
            return self.model(**kwargs, labels=labels_of(batch), return_logits=False)
        return self.model(**kwargs)

    def flops_per_batch(self, batch: Mapping[str, Any]) -> int:
        """Training FLOPs (forward + backward = 3 x forward) of one batch of b sequences of s:

        ``3 * b * (2 * N * s + 4 * n_layers * d_model * s**2)``, i.e.
        ``6 * N * tokens + 12 * n_layers * d_model * s * tokens``, where N counts the
        parameters used in matmuls (all but the position table and, when untied, the input
        embedding; the output projection counts, tied or not), ``2 * N`` is one multiply-add
        per parameter per token, and ``4 * n_layers * d_model * s**2`` is q @ k^T plus
        scores @ v over the full s x s square (as LLM Foundry counts it, ignoring causal and
        document masking).
        """
        b, s = batch["input_ids"].shape[:2]
        cfg = self.model.config
        return 3 * b * (2 * self.n_matmul_params * s + 4 * cfg.n_layers * cfg.d_model * s * s)


def matmul_params(model: MPTForCausalLM) -> int:
    """Parameters used in matmuls: all but the lookup tables (position table, and the input
    embedding when the output projection is separate; a tied one is the output projection)."""
    lookups = [model.transformer.wpe] if model.transformer.wpe is not None else []
    if model.lm_head is not None:
        lookups.append(model.transformer.wte)
    total = sum(p.numel() for p in model.parameters())
    return total - sum(m.weight.numel() for m in lookups)
