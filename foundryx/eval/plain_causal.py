"""Models whose attention foundryx may set up itself for speed: the Hugging Face decoder types
whose positions come from ``position_ids`` (rotary; no token types, no position-dependent
scaling), whose attention is causal over the whole sequence unless their config asks for a
sliding window, and that use a given 4D mask as it is, with SDPA or eager attention.

Two uses, each giving the same logits as the model's own mask building (tests compare them
bit for bit):
- greedy generation's decoding steps pass the prompt's padding as one additive 4D mask
  (:mod:`foundryx.eval.generate`);
- scoring batches whose padding is all on the right pass an all-ones mask, so SDPA runs
  causal alone and skips the masked half of its work (:mod:`foundryx.eval.score`).
"""

from __future__ import annotations

from typing import Any

import torch

PLAIN_CAUSAL_MODELS = frozenset({"llama", "mistral", "qwen2", "qwen3", "olmo", "olmo2", "gemma",
                                 "granite"})


def plain_causal(hf: Any) -> bool:
    """Whether ``hf`` is one of :data:`PLAIN_CAUSAL_MODELS` with SDPA or eager attention."""
    cfg = getattr(hf, "config", None)
    return (getattr(cfg, "model_type", None) in PLAIN_CAUSAL_MODELS
            and getattr(cfg, "_attn_implementation", None) in ("sdpa", "eager"))


def right_padded(mask: torch.Tensor) -> bool:
    """Whether every row of a 2D attention mask is its real tokens followed by padding."""
    ones = torch.arange(mask.shape[1], device=mask.device)[None, :] < mask.sum(1, keepdim=True)
    return bool(torch.equal(mask.bool(), ones))
