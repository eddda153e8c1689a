"""Scored rows (multiple choice, schema, language modeling) with vocabulary logits only where a
metric reads them.

Composer's ``eval_forward`` returns the logits of every position of every row: rows x width x
vocabulary numbers, of which a metric reads only the positions that predict a continuation
token (a few per row; the context, often hundreds to thousands of tokens of few-shot
examples, is read by nobody). For a small model the output projection and those logits are
most of a scoring forward's time and memory. Here the model's own forward runs with
``logits_to_keep`` set to the positions some row of the batch scores (the union of the rows'
continuation spans), and the batch handed to the metric is re-indexed to those positions: the
metric sees the same logits of the same tokens, the rest of the work is not done.

The model's layers see the same inputs, so the kept logits are the ones ``eval_forward`` would
give (tests/test_icl_invariance.py compares the two paths). Scoring batches are padded on the
right, so for a :func:`~foundryx.eval.plain_causal.plain_causal` model causal attention alone
already keeps every real token from seeing padding: those batches go with an attention mask of
all ones, so SDPA runs causal alone and skips the masked half of its work instead of the model
building a boolean mask of width x width that SDPA turns into an additive one in every layer
(the same logits, bit for bit). Models whose forward has no
``logits_to_keep`` argument, and metrics other than the built-in ICL ones, keep
``eval_forward``.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from foundryx.eval.plain_causal import plain_causal, right_padded


def kept_positions(batch: dict[str, Any]) -> torch.Tensor:
    """Sorted positions t whose logits predict a continuation token t + 1 of some row."""
    starts, ends = batch["cont_start"] - 1, batch["cont_end"] - 1
    width = batch["input_ids"].shape[1]
    pos = torch.arange(width - 1, device=starts.device)
    wanted = ((pos >= starts[:, None]) & (pos < ends[:, None])).any(0)
    return pos[wanted]


def compact_batch(batch: dict[str, Any], keep: torch.Tensor) -> dict[str, Any]:
    """``batch`` re-indexed so that column j holds position ``keep[j]``'s logits' target: the
    metrics' span arithmetic (position t predicts token t + 1 inside [cont_start, cont_end))
    holds on logits of shape (rows, len(keep) + 1, vocabulary)."""
    ids = batch["input_ids"]
    compact = ids.new_zeros((ids.shape[0], len(keep) + 1))
    compact[:, 1:] = ids[:, keep + 1]
    start = torch.searchsorted(keep, batch["cont_start"] - 1) + 1
    return {**batch, "input_ids": compact, "cont_start": start,
            "cont_end": start + (batch["cont_end"] - batch["cont_start"])}


def scoring_forward(hf: Any) -> Any:
    """A function batch -> (logits at the kept positions plus one unread column, the compact
    batch) for ``hf``, or None where its forward cannot keep chosen positions."""
    try:
        params = inspect.signature(hf.forward).parameters
    except (TypeError, ValueError):
        return None
    if "logits_to_keep" not in params:
        return None
    use_cache = {"use_cache": False} if "use_cache" in params else {}
    plain = plain_causal(hf)

    def forward(batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
        keep = kept_positions(batch)
        mask = batch["attention_mask"]
        if plain and right_padded(mask):  # padding after every real token: causal alone hides it
            # all ones rather than None: without a mask transformers looks for packed sequences
            # and then builds the full mask anyway
            mask = torch.ones_like(mask)
        out = hf(input_ids=batch["input_ids"], attention_mask=mask,
                 logits_to_keep=keep, return_dict=True, **use_cache)
        logits = out.logits
        pad = logits.new_zeros((logits.shape[0], 1, logits.shape[2]))  # the metrics drop the last column
        return torch.cat([logits, pad], dim=1), compact_batch(batch, keep)

    return forward
