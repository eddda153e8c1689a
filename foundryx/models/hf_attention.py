"""Packed documents in Hugging Face models: ``attn_implementation: foundryx_flex``, and how a
packed batch reaches the model.

A packed batch (``sequence_id``) reaches a Hugging Face model as transformers' own flattening
collator (``DataCollatorWithFlattening``) hands it over: ``position_ids`` that restart at 0 at
each document, and no ``attention_mask`` (padding is a document of its own, with no loss). The
attention reads the documents from the position ids:

- ``foundryx_flex`` (registered with transformers' ``AttentionInterface`` by foundryx): foundryx's
  FlexAttention implementation (``attn_impl: flex``), whose block mask is built from the
  documents: no ``seq x seq`` mask anywhere (a GPU runs it compiled);
- transformers' own ``flash_attention_2``/``3`` (varlen from the position ids) and ``sdpa``,
  ``eager``, ``flex_attention`` (``masking_utils`` finds the documents from the position ids and
  builds a mask: dense, ``batch x seq²``, for sdpa and eager), in models written on
  transformers' attention interface (``_supports_attention_backend``).

Any other attention cannot keep the documents apart: :func:`packing_problem` says so.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from foundryx.errors import ConfigError
from foundryx.models.layers.attention_flex import flex_attention

HF_FLEX = "foundryx_flex"
HONOURS_POSITION_IDS = frozenset({HF_FLEX, "flash_attention_2", "flash_attention_3", "sdpa",
                                  "eager", "flex_attention"})


@functools.cache
def register_hf_attention() -> None:
    """Register ``foundryx_flex`` with transformers (its attention, and as its mask the 2-D
    padding mask, or None, as for flash-attn). Once per process."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register(HF_FLEX, hf_flex_attention)
    AttentionMaskInterface.register(HF_FLEX, flash_attention_mask)


def documents_of(position_ids: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    """Document index (batch, seq) of each token from position ids: a new document wherever a
    position is not the previous one plus 1 (transformers' rule); None when ``position_ids``
    is None or holds one document per row."""
    if position_ids is None:
        return None
    pos = position_ids.expand(batch, -1)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[:, 1:] = pos[:, 1:] != pos[:, :-1] + 1
    if not starts[:, 1:].any():
        return None
    return starts.long().cumsum(1)


def hf_flex_attention(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                      value: torch.Tensor, attention_mask: torch.Tensor | None,
                      scaling: float | None = None, dropout: float = 0.0,
                      sliding_window: int | None = None, softcap: float | None = None,
                      position_ids: torch.Tensor | None = None, **_: Any):
    """transformers' attention signature (q, k, v: (batch, heads, seq, head_dim)) over
    foundryx's ``flex``: documents from ``position_ids``, padding from the 2-D mask.
    Returns ``(output (batch, seq, heads, head_dim), None)``."""
    if dropout:
        raise ConfigError([f"model.attn_implementation: {HF_FLEX} has no attention dropout "
                           f"(the model's attention_dropout is {dropout}); set "
                           "model.config_overrides.attention_dropout: 0 or another "
                           "attn_implementation"])
    if softcap is not None:
        raise ConfigError([f"model.attn_implementation: {HF_FLEX} does not soft-cap attention "
                           f"logits ({type(module).__name__} does, at {softcap}); use "
                           "attn_implementation: eager or flex_attention"])
    batch = query.shape[0]
    padding = None
    if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2:
        padding = attention_mask.bool()
    elif attention_mask is not None:
        raise ConfigError([f"model.attn_implementation: {HF_FLEX} takes a 2-D padding mask; "
                           f"{type(module).__name__} gave one of shape "
                           f"{tuple(attention_mask.shape)}; use attn_implementation: sdpa"])
    # transformers keeps |i - j| < w (w keys including itself); foundryx's window is |i - j| <= w
    window = None if sliding_window is None else sliding_window - 1
    out = flex_attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
                         causal=getattr(module, "is_causal", True),
                         sequence_id=documents_of(position_ids, batch),
                         key_padding_mask=padding, softmax_scale=scaling, sliding_window=window)
    return out.contiguous(), None


def packed_positions(sequence_id: torch.Tensor, attention_mask: torch.Tensor | None
                     ) -> torch.Tensor:
    """``position_ids`` (batch, seq) restarting at 0 at each document: where ``sequence_id``
    changes, and where ``attention_mask`` does (padding is a document of its own)."""
    starts = torch.ones_like(sequence_id, dtype=torch.bool)
    starts[:, 1:] = sequence_id[:, 1:] != sequence_id[:, :-1]
    if attention_mask is not None:
        starts[:, 1:] |= attention_mask[:, 1:] != attention_mask[:, :-1]
    idx = torch.arange(sequence_id.shape[1], device=sequence_id.device).expand_as(sequence_id)
    first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(1).values
    return idx - first


def packing_problem(model: torch.nn.Module) -> str | None:
    """Why ``model`` (a transformers model) cannot keep packed documents apart, or None."""
    attn = getattr(model.config, "_attn_implementation", None)
    if attn == HF_FLEX:
        return None
    if attn not in HONOURS_POSITION_IDS:
        return f"its attention {attn!r} does not read documents from position ids"
    if not getattr(model, "_supports_attention_backend", False):
        return (f"{type(model).__name__} is not written on transformers' attention interface, "
                "which reads documents from position ids")
    try:
        from transformers.masking_utils import find_packed_sequence_indices  # noqa: F401
    except ImportError:
        import transformers

        return (f"transformers {transformers.__version__} does not find documents from position "
                "ids (4.53 and later do)")
    return None
