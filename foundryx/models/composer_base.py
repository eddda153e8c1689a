"""``CausalLMBase``: Composer's HuggingFaceModel for foundryx's causal LMs, without the scan
of every transformers model class that its constructor makes.

``HuggingFaceModel.__init__`` (Composer 0.32.1, frozen upstream) calls
``_is_registered_causal_lm``, which lists transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING`` and so
imports every causal-LM modeling module transformers ships (~200). Measured on a 2-core machine:
5.5 s per process, and one of those modules calls ``torch.compile`` at import, which starts
inductor's compile-worker pool (two more Python processes) and costs 3.3 s more at exit. The
answer only decides ``shift_labels`` when it is not given and a warning when it is false;
foundryx's models are causal LMs and pass ``shift_labels=True``, so the scan is skipped for them.

A training step of a model that can fuse its loss with the output projection (MPT; the Hugging
Face causal LMs whose head is a plain linear layer) returns the loss and no logits: the
``tokens x vocab`` logits, their float32 copy, log-softmax and gradient are never held whole
(``foundryx.models.layers.loss``). The loss, eval and training-metric paths for such outputs are
here, shared: a subclass gives ``_forward(batch, fused)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from composer.metrics.nlp import LanguageCrossEntropy
from composer.models import HuggingFaceModel
from composer.models import huggingface as composer_hf

from foundryx.errors import ConfigError
from foundryx.models.layers.loss import IGNORE_INDEX, causal_lm_loss


class CausalLMBase(HuggingFaceModel):
    """A HuggingFaceModel whose wrapped model is a causal LM (labels shifted by one)."""

    def __init__(self, **kwargs: Any):
        scan = composer_hf._is_registered_causal_lm
        composer_hf._is_registered_causal_lm = lambda model: True
        try:
            super().__init__(shift_labels=True, **kwargs)
        finally:
            composer_hf._is_registered_causal_lm = scan


class FusedLossLM(CausalLMBase):
    """A causal LM whose training step may return its loss fused with the output projection
    (``outputs.logits`` None). Subclasses implement ``_forward(batch, fused)`` and set
    ``fuses_loss`` (whether a training step fuses)."""

    fuses_loss = True

    def forward(self, batch: Mapping[str, Any]):
        """A training step (training mode, gradients on) returns the loss fused with the output
        projection and no logits when the model fuses; any other call returns the logits."""
        return self._forward(batch, fused=self.fuses_loss and self.training
                             and torch.is_grad_enabled())

    def _forward(self, batch: Mapping[str, Any], fused: bool):
        raise NotImplementedError

    def loss(self, outputs, batch: Mapping[str, Any]) -> torch.Tensor:
        """Token-mean next-token cross entropy; -100 labels are ignored. In a fused training
        step the forward has already computed it (``outputs.logits`` is then None)."""
        if outputs.logits is None or getattr(outputs, "loss", None) is not None:
            return outputs.loss
        return causal_lm_loss(outputs.logits, labels_of(batch))

    def eval_forward(self, batch: dict[str, Any], outputs: Any = None):
        """Logits (batch, seq, vocab); the shifted labels are kept for ``update_metric``.
        Given a fused training step's outputs (no logits), returns them: the training metric
        is updated from their loss (``update_metric``), without building the logits."""
        if outputs is not None and outputs.logits is None:
            return outputs
        if "labels" not in batch:
            batch = {**batch, "labels": labels_of(batch)}
        return super().eval_forward(batch, outputs or self._forward(batch, fused=False))

    def update_metric(self, batch: Any, outputs: Any, metric: Any) -> dict:
        """As Composer's, and for a fused training step the training cross entropy from its
        token-mean loss (the same number, weighted by the step's counted tokens)."""
        if getattr(outputs, "logits", True) is not None:
            return super().update_metric(batch, outputs, metric)
        if not isinstance(metric, LanguageCrossEntropy):
            raise ConfigError([f"training metric {type(metric).__name__}: a fused training step "
                               "computes the loss without logits, so only LanguageCrossEntropy "
                               "can be tracked during training; evaluate the others"])
        n = (labels_of(batch)[:, 1:] != IGNORE_INDEX).sum()
        metric.sum_loss += outputs.loss.detach().float() * n
        metric.total_items += n
        return {}


def labels_of(batch: Mapping[str, Any]) -> torch.Tensor:
    """``batch["labels"]``, else input_ids with padding (attention_mask == 0) set to -100."""
    if batch.get("labels") is not None:
        return batch["labels"]
    mask = batch.get("attention_mask")
    ids = batch["input_ids"]
    return ids if mask is None else ids.masked_fill(mask == 0, IGNORE_INDEX)

