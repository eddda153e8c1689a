"""``attn_impl: triton``: foundryx's FlashAttention-2 Triton kernel behind the common signature."""

from __future__ import annotations

import torch

from foundryx.models.layers.attention_select import autocast_inputs, require


def triton_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    sequence_id: torch.Tensor | None = None,
    alibi_slopes: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    softmax_scale: float | None = None,
    dropout_p: float = 0.0,
    sliding_window: int | None = None,
) -> torch.Tensor:
    """:func:`foundryx.kernels.flash_attention.flash_attention` with the arguments and shapes
    of ``torch_attention``; raises ``AttentionError`` where it cannot run (e.g. on CPU)."""
    q, k, v = autocast_inputs(q, k, v)
    require("triton", q, k, v, dropout_p)
    # lazy: imports Triton, an optional heavy dependency, only when this implementation runs
    from foundryx.kernels.flash_attention import flash_attention

    return flash_attention(
        q,
        k,
        v,
        causal=causal,
        sequence_id=sequence_id,
        alibi_slopes=alibi_slopes,
        key_padding_mask=key_padding_mask,
        softmax_scale=softmax_scale,
        sliding_window=sliding_window,
    )
