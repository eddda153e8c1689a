"""``ComposerMPTCausalLM``: MPTForCausalLM as a Composer model (loss, metrics, FLOPs)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from composer.metrics.nlp import LanguageCrossEntropy, LanguagePerplexity

from foundryx.config.types import options_or_fields, to_data
from foundryx.errors import ConfigError, DataError
from foundryx.models.composer_base import CausalLMBase
from foundryx.models.mpt.configuration import MPTConfig
from foundryx.models.mpt.modeling import IGNORE_INDEX, MPTForCausalLM, causal_lm_loss
from foundryx.models.mpt.options import RUN_FIELDS, MPTOptions


class ComposerMPTCausalLM(CausalLMBase):
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

    def forward(self, batch: Mapping[str, Any]):
        """A training step (training mode, gradients on) returns the loss fused with the output
        projection and no logits (see ``loss``); any other call returns the logits."""
        return self._forward(batch, fused=self.training and torch.is_grad_enabled())

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
        if fused:
            return self.model(**kwargs, labels=_labels(batch), return_logits=False)
        return self.model(**kwargs)

    def loss(self, outputs, batch: Mapping[str, Any]) -> torch.Tensor:
        """Token-mean next-token cross entropy; -100 labels are ignored. In a training step
        the forward has already computed it, fused with the output projection, so the
        vocabulary logits are never held whole (``outputs.logits`` is then None)."""
        if outputs.logits is None:
            return outputs.loss
        return causal_lm_loss(outputs.logits, _labels(batch))

    def eval_forward(self, batch: dict[str, Any], outputs: Any = None):
        """Logits (batch, seq, vocab); the shifted labels are kept for ``update_metric``.
        Given a fused training step's outputs (no logits), returns them: the training metric
        is updated from their loss (``update_metric``), without building the logits."""
        if outputs is not None and outputs.logits is None:
            return outputs
        if "labels" not in batch:
            batch = {**batch, "labels": _labels(batch)}
        return super().eval_forward(batch, outputs or self._forward(batch, fused=False))

    def update_metric(self, batch: Any, outputs: Any, metric: Any) -> dict:
        """As Composer's, and for a fused training step the training cross entropy from its
        token-mean loss (the same number, weighted by the step's counted tokens)."""
        if getattr(outputs, "logits", True) is not None:
            return super().update_metric(batch, outputs, metric)
        if not isinstance(metric, LanguageCrossEntropy):
            raise ConfigError([f"training metric {type(metric).__name__}: mpt_causal_lm computes "
                               "the training loss without logits, so only LanguageCrossEntropy "
                               "can be tracked during training; evaluate the others"])
        n = (_labels(batch)[:, 1:] != IGNORE_INDEX).sum()
        metric.sum_loss += outputs.loss.detach().float() * n
        metric.total_items += n
        return {}

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


def _labels(batch: Mapping[str, Any]) -> torch.Tensor:
    """``batch["labels"]``, else input_ids with padding (attention_mask == 0) set to -100."""
    if batch.get("labels") is not None:
        return batch["labels"]
    mask = batch.get("attention_mask")
    ids = batch["input_ids"]
    return ids if mask is None else ids.masked_fill(mask == 0, IGNORE_INDEX)


def matmul_params(model: MPTForCausalLM) -> int:
    """Parameters used in matmuls: all but the lookup tables (position table, and the input
    embedding when the output projection is separate; a tied one is the output projection)."""
    lookups = [model.transformer.wpe] if model.transformer.wpe is not None else []
    if model.lm_head is not None:
        lookups.append(model.transformer.wte)
    total = sum(p.numel() for p in model.parameters())
    return total - sum(m.weight.numel() for m in lookups)
