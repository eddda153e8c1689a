"""What the eval's greedy generation loops share (transformers' one in
:mod:`foundryx.eval.generate`, the native Llama's in :mod:`foundryx.eval.native_lm`), free of
transformers: per-row stop-sequence checks and positions from an attention mask."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["StopChecker", "mask_positions"]


class StopChecker:
    """Per-row stop-sequence checks on the decoded new text (as the collator's
    ``StopOnSequences`` does for ``generate``)."""

    def __init__(self, tokenizer: Any, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, [s for s in stops if s]

    def done(self, tokens: list[int]) -> bool:
        if not self.stops:
            return False
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        return any(s in text for s in self.stops)


def mask_positions(mask: torch.Tensor) -> torch.Tensor:
    """Each token's position from a 2D attention mask, padding at 0 (transformers 5's
    ``_prepare_position_ids_for_generation``; 4.57 puts padding at 1, which no real token
    sees)."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)
