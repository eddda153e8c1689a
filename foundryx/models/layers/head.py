"""The output projection of a language model: hidden states -> vocabulary logits.

Single-device code. Tensor parallelism can split the weight by vocabulary rows; the model then
runs :func:`output_logits` through ``foundryx.parallel.vocab_rows``, applied from outside,
which gathers the logits whole.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def output_logits(h: torch.Tensor, weight: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """``(h @ weight.T) * scale``."""
    logits = F.linear(h, weight)
    return logits if scale is None else logits * scale
