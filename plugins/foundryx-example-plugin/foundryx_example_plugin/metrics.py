"""An ICL metric plugin: multiple-choice accuracy counting the gold answer among the model's
two likeliest choices (top-2).

Registered under ``foundryx_metrics`` as ``icl_mc_top2_accuracy``; an ICL task names it::

    icl_tasks:
      - label: facts_mc
        icl_task_type: multiple_choice
        metric: icl_mc_top2_accuracy
"""

from __future__ import annotations

import torch

from foundryx.eval.metrics import ICLMultipleChoiceAccuracy


class ICLMCTop2Accuracy(ICLMultipleChoiceAccuracy):
    """Correct when at most one choice has a lower mean continuation loss than the gold one
    (ties go to the lower choice index, as in the top-1 metric)."""

    def outcomes(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r = self._rows()
        ids, inverse = torch.unique(r["example_id"], return_inverse=True)
        n = len(ids)
        gold = torch.zeros(n, dtype=torch.long, device=ids.device).scatter(
            0, inverse, r["gold"].long())
        is_gold = r["choice"].long() == gold[inverse]
        gold_loss = torch.full((n,), float("inf"), dtype=r["loss"].dtype, device=ids.device)
        gold_loss = gold_loss.scatter(0, inverse[is_gold], r["loss"][is_gold])
        ahead = (r["loss"] < gold_loss[inverse]) | (
            (r["loss"] == gold_loss[inverse]) & (r["choice"].long() < gold[inverse]))
        rank = torch.zeros(n, dtype=torch.long, device=ids.device).index_add_(
            0, inverse, ahead.long())
        category = torch.zeros(n, dtype=torch.long, device=ids.device).scatter(
            0, inverse, r["category"].long())
        return ids, rank < 2, category
