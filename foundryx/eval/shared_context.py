"""Scoring with each context computed once for the rows that share it (multiple choice).

A multiple-choice example is scored as one row per choice: the same context (the few-shot
examples and the question, often hundreds of tokens) followed by each choice's continuation.
Whole rows run the context through the model once per choice. Here, in a batch where rows
share their context, each distinct context runs once and keeps its keys and values; every row
then runs only its continuation's tokens over its context's cache. The logits a metric reads
are those of the same tokens at the same positions: the position before the continuation (from
the context's run) and the continuation's own (from the second run). For four choices and a
long context this is about a quarter of the work.

The numbers are not the whole rows' bit for bit: the second run's attention sums a row's keys
in another order (a mask over the context cache instead of causal attention over the row) and
the matrix products run on other shapes, so logits differ in their last bits (~1e-5 in float32;
a near tie between two choices could fall the other way). ``share_context: false`` (eval
config) scores whole rows, exactly as transformers does. Batches whose rows share no context
(schema, language modeling, one choice) are scored as whole rows either way.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from foundryx.eval.score import compact_batch, kept_positions
from foundryx.models.llama.model import LlamaLM

__all__ = ["context_groups", "shared_context_forward"]


def context_groups(ids: list[list[int]], starts: list[int]) -> tuple[list[int], list[int]]:
    """``(group, first)``: for each row the index of its context among the distinct ones (a
    row's context: its tokens before ``starts[row]``), and for each distinct context the first
    row that has it."""
    seen: dict[tuple[int, ...], int] = {}
    group, first = [], []
    for row, (tokens, start) in enumerate(zip(ids, starts)):
        key = tuple(tokens[:start])
        if key not in seen:
            seen[key] = len(first)
            first.append(row)
        group.append(seen[key])
    return group, first


def shared_context_forward(model: LlamaLM, whole_rows: Callable[[dict[str, Any]], Any]) -> Any:
    """A function batch -> (logits at the kept positions plus one unread zero column, the
    compact batch), as ``whole_rows`` (:func:`foundryx.eval.native_lm.native_scoring_forward`)
    gives, computing each distinct context of the batch once; a batch without a shared
    context goes to ``whole_rows``."""

    @torch.inference_mode()
    def forward(batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
        ids = batch["input_ids"]
        starts, ends = batch["cont_start"].tolist(), batch["cont_end"].tolist()
        group, first = context_groups(ids.tolist(), starts)
        if len(first) == len(group):
            return whole_rows(batch)
        keep = kept_positions(batch)
        rows, device = ids.shape[0], ids.device
        length = max(starts[r] for r in first)
        last = [starts[r] - 1 for r in first]  # each context's last position: the first score
        news = [end - start - 1 for start, end in zip(starts, ends)]  # tokens after that
        more = max(news)
        cache = model.new_cache(length + more)
        context_ids = ids[first, :length]  # right padded: causal attention hides the padding
        at = sorted(set(last))
        context_logits = model(context_ids, torch.arange(length, device=device)[None],
                               cache=cache, keep=torch.tensor(at, device=device))
        out = context_logits.new_zeros((rows, len(keep) + 1, context_logits.shape[-1]))
        column = torch.searchsorted(keep, batch["cont_start"] - 1).tolist()
        index = {p: i for i, p in enumerate(at)}
        out[torch.arange(rows), column] = context_logits[
            torch.tensor(group), torch.tensor([index[last[g]] for g in group])]
        if more > 0:
            cont_ids = ids.new_zeros((rows, more))
            for r in range(rows):
                cont_ids[r, :news[r]] = ids[r, starts[r]:starts[r] + news[r]]
            steps = torch.arange(more, device=device)
            positions = batch["cont_start"][:, None] + steps[None]
            cache.select(torch.tensor(group, device=device))
            keys = torch.arange(length, device=device)
            mask = torch.empty((rows, 1, more, length + more), dtype=torch.bool, device=device)
            mask[:, 0, :, :length] = (keys[None] < batch["cont_start"][:, None])[:, None]
            mask[:, 0, :, length:] = steps[None] <= steps[:, None]
            cont_logits = model(cont_ids, positions, cache=cache, attn_mask=mask)
            for r in range(rows):
                out[r, column[r] + 1:column[r] + 1 + news[r]] = cont_logits[r, :news[r]]
        return out, compact_batch(batch, keep)

    return forward
