"""What the eval's greedy generation loops share (transformers' one in
:mod:`foundryx.eval.generate`, the native Llama's in :mod:`foundryx.eval.native_lm`), free of
transformers: per-row stop-sequence checks, positions from an attention mask, and the
decoding of the new tokens into the texts the metrics score."""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["StopChecker", "decode_generations", "greedy_next", "mask_positions"]


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


def greedy_next(logits: torch.Tensor) -> torch.Tensor:
    """Each row's greedy token: the argmax of ``logits`` (rows, vocabulary) in float32, the
    first of equal maxima, a NaN counted as the largest (as ``torch.argmax``). On a CPU it is
    numpy's argmax, vectorised where torch's is not: 0.02 against 0.42 ms for 26 rows of 8,192
    (a tenth of a small model's decoding step; benchmarks/RESULTS.md, issue 55)."""
    rows = logits.to(torch.float32)
    if rows.device.type != "cpu":
        return rows.argmax(-1)
    return torch.from_numpy(rows.detach().numpy().argmax(-1))


def mask_positions(mask: torch.Tensor) -> torch.Tensor:
    """Each token's position from a 2D attention mask, padding at 0 (transformers 5's
    ``_prepare_position_ids_for_generation``; 4.57 puts padding at 1, which no real token
    sees)."""
    return (mask.long().cumsum(-1) - 1).masked_fill(mask == 0, 0)


def decode_generations(tokenizer: Any, tokens: list[list[int]]) -> list[str]:
    """The texts ICL metrics score, decoded as Composer's ``eval_forward`` decodes them
    (special tokens skipped; a leading space for tokenizers that do not fold one into the
    next token)."""
    texts = tokenizer.batch_decode(tokens, skip_special_tokens=True)
    if len(tokenizer(" a", add_special_tokens=False)["input_ids"]) == 1:
        return texts
    return [" " + t for t in texts]
