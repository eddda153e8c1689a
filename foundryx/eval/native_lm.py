"""The eval's two model operations for the native Llama
(:class:`~foundryx.models.llama.model.LlamaLM`), with the semantics of the transformers paths
they stand in for, so a task's results are the same:

- :func:`native_scoring_forward`: :func:`foundryx.eval.score.scoring_forward`'s contract, batch
  -> (logits at the kept positions + one unread column, the compact batch). Scoring batches are
  right padded, so causal attention alone is exact for the real tokens (no mask at all, SDPA's
  causal kernel); any other padding gets transformers' causal-and-padding mask.
- :func:`native_greedy_generate`: :func:`foundryx.eval.generate.greedy_generate`'s contract on
  left-padded prompts: positions from the mask as ``generate`` computes them, the last
  position's logits in float32 and argmax, a row finishes at the end-of-sequence token, a stop
  sequence in its decoded new text or ``max_new_tokens``, and finished rows leave the batch and
  the KV cache. The prompt's padding is one additive mask kept for the whole generation and
  sliced to the filled length each step (as greedy_generate's ``_DirectSteps`` passes it).

Neither imports transformers (tests/test_native_llama.py checks it in a fresh process).
"""

from __future__ import annotations

from typing import Any

import torch

from foundryx.eval.decoding import StopChecker, greedy_next, mask_positions
from foundryx.eval.plain_causal import right_padded
from foundryx.eval.score import compact_batch, kept_positions
from foundryx.models.llama.model import LlamaLM, causal_padding_mask

__all__ = ["native_greedy_generate", "native_scoring_forward"]


def native_scoring_forward(model: LlamaLM) -> Any:
    """A function batch -> (logits at the kept positions plus one unread zero column, the
    compact batch) for ``model``, as :func:`~foundryx.eval.score.scoring_forward` gives for a
    transformers model."""

    @torch.inference_mode()
    def forward(batch: dict[str, Any]) -> tuple[torch.Tensor, dict[str, Any]]:
        keep = kept_positions(batch)
        ids, mask = batch["input_ids"], batch["attention_mask"]
        positions = torch.arange(ids.shape[1], device=ids.device)[None]  # transformers': no position_ids
        attn = None if right_padded(mask) else causal_padding_mask(mask)
        logits = model(ids, positions, attn_mask=attn, keep=keep)
        pad = logits.new_zeros((logits.shape[0], 1, logits.shape[2]))  # the metrics drop the last column
        return torch.cat([logits, pad], dim=1), compact_batch(batch, keep)

    return forward


@torch.inference_mode()
def native_greedy_generate(model: LlamaLM, tokenizer: Any, input_ids: torch.Tensor,
                           attention_mask: torch.Tensor, max_new_tokens: int,
                           eos_token_id: int | None = None,
                           stop_sequences: list[str] | tuple[str, ...] = ()) -> list[list[int]]:
    """The new tokens of each (left-padded) row, up to and including the token that finished
    it: :func:`foundryx.eval.generate.greedy_generate`'s tokens."""
    n, width = input_ids.shape
    out: list[list[int]] = [[] for _ in range(n)]
    if max_new_tokens <= 0 or n == 0:
        return out
    checker = StopChecker(tokenizer, list(stop_sequences))
    rows = list(range(n))  # batch position -> original row
    cache = model.new_cache(width + max_new_tokens)
    positions = mask_positions(attention_mask)
    logits = model(input_ids, positions, cache=cache,
                   attn_mask=causal_padding_mask(attention_mask), keep=1)
    pos = attention_mask.long().sum(-1) - 1  # the last prompt token's (greedy_generate's)
    # the prompt's padding for the decoding steps, as greedy_generate passes it (also where
    # nothing is padding: a mask decides how SDPA sums grouped-query attention)
    step_mask = torch.zeros((n, 1, 1, width + max_new_tokens), dtype=cache.keys[0].dtype,
                            device=input_ids.device)
    step_mask[:, 0, 0, :width].masked_fill_(attention_mask == 0, float("-inf"))
    for step in range(max_new_tokens):
        nxt = greedy_next(logits[:, -1])  # greedy_generate's float32 argmax
        tokens = nxt.tolist()
        finished = set()
        for i, tok in enumerate(tokens):
            out[rows[i]].append(tok)
            if (eos_token_id is not None and tok == eos_token_id) or checker.done(out[rows[i]]):
                finished.add(i)
        if step == max_new_tokens - 1 or len(finished) == len(tokens):
            break
        if finished:  # the finished rows leave the batch and the cache
            kept = [i for i in range(len(tokens)) if i not in finished]
            index = torch.tensor(kept, device=nxt.device)
            rows = [rows[i] for i in kept]
            nxt, pos = nxt.index_select(0, index), pos.index_select(0, index)
            cache.select(index)
            step_mask = step_mask.index_select(0, index)
        pos = pos + 1
        logits = model(nxt[:, None], pos[:, None], cache=cache,
                       attn_mask=step_mask[..., :cache.length + 1], keep=1)
    return out
