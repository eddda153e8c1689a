"""ICL accuracy metrics (``metrics`` registry): the rules of :mod:`foundryx.eval.icl_rows`
with their rows as torchmetrics states.

Composer's ``HuggingFaceModel.update_metric`` calls ``update(batch=..., outputs=..., labels=...)``
on metrics with ``needs_batch``. States are concatenated across ranks (``dist_reduce_fx="cat"``),
so the result does not depend on the number of processes (padding rows are not primary).
``foundryx eval`` on one process runs the same rules on plain lists
(:class:`foundryx.eval.icl_rows.LocalRows`) and does not import this module.
"""

from __future__ import annotations

from typing import Any

import torch
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat

from foundryx.eval.icl_rows import (  # noqa: F401  (re-exported: the rules' helpers)
    GenerationRule,
    LanguageModelingRule,
    LMEvalRule,
    MultipleChoiceRule,
    RowRule,
    clean_output,
    keep_primary,
    macro_average,
    normalize_answer,
)


class ICLMetric(RowRule, Metric):
    """Base: rows of (example_id, category, primary, ...) as torchmetrics states; subclasses
    (a rule first) decide correctness."""

    needs_batch = True
    full_state_update = False
    higher_is_better = True

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self.last_update: dict[str, list] = {}  # per-row details of the last update (for dumps)
        for name in ("example_id", "category", "primary", *self.extra_states):
            self.add_state(name, default=[], dist_reduce_fx="cat")

    def _add(self, batch: dict[str, Any], **values: torch.Tensor) -> None:
        for name in ("example_id", "category", "primary"):
            getattr(self, name).append(batch[name].detach().to(self.device))
        for name, v in values.items():
            getattr(self, name).append(v.detach().to(self.device))

    def _rows(self) -> dict[str, torch.Tensor]:
        return keep_primary({n: dim_zero_cat(getattr(self, n))
                             for n in ("example_id", "category", "primary", *self.extra_states)})

    def compute(self) -> torch.Tensor:
        return torch.tensor(macro_average(self.category_scores()), dtype=torch.float64)


class ICLLanguageModelingAccuracy(LanguageModelingRule, ICLMetric):
    """Correct when every continuation token is the model's argmax."""


class ICLMultipleChoiceAccuracy(MultipleChoiceRule, ICLMetric):
    """The row with the lowest mean per-token loss of the continuation wins; ties go to the
    lowest index."""


class ICLLMEvalAccuracy(LMEvalRule, ICLMetric):
    """lm-eval-harness's ``acc`` (``compute``) and ``acc_norm`` (``scoring: lm_eval``)."""


class ICLGenerationAccuracy(GenerationRule, ICLMetric):
    """Correct when the cleaned greedy output starts with the cleaned answer or an alias."""
