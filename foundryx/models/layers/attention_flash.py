"""``attn_impl: flash``: the flash-attn 2 package (CUDA or ROCm build), imported lazily.

Packed documents (``sequence_id``) and padding (``key_padding_mask``) go through flash-attn's
varlen API: padding tokens are dropped and each document (a run of one sequence_id) becomes
one sequence of ``cu_seqlens``. Padding must sit at the ends of documents (left or right
padding), since distances for ALiBi and the sliding window are counted without it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from foundryx.models.layers.attention_select import autocast_inputs, flash_attn_module, require


def varlen_layout(
    batch: int,
    seq: int,
    sequence_id: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    device: torch.device,
) -> tuple[torch.Tensor, int, torch.Tensor | None]:
    """``(cu_seqlens, max_seqlen, kept)`` for flash-attn's varlen API over the flattened
    (batch * seq) tokens: ``kept`` indexes the non-padding tokens (None: all are kept)."""
    starts = torch.zeros(batch, seq, dtype=torch.bool, device=device)
    starts[:, 0] = True
    if sequence_id is not None:
        starts[:, 1:] = sequence_id[:, 1:] != sequence_id[:, :-1]
    doc = starts.flatten().cumsum(0)  # document index of each token, unique across rows
    kept = None
    if key_padding_mask is not None:
        kept = key_padding_mask.flatten().nonzero().squeeze(1)
        doc = doc[kept]
    lengths = torch.unique_consecutive(doc, return_counts=True)[1]
    cu_seqlens = F.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
    return cu_seqlens, int(lengths.max()), kept


def flash_attention(
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
    """flash-attn 2 with the arguments and shapes of ``torch_attention``; raises
    ``AttentionError`` when flash-attn is missing or cannot run the call."""
    q, k, v = autocast_inputs(q, k, v)
    require("flash", q, k, v, dropout_p)
    fa = flash_attn_module()[0]
    w = sliding_window
    opts = {
        "dropout_p": dropout_p,
        "softmax_scale": softmax_scale,
        "causal": causal,
        "window_size": (-1, -1) if w is None else (w, 0 if causal else w),
        "alibi_slopes": None if alibi_slopes is None else alibi_slopes.to(q.device, torch.float32),
    }
    if sequence_id is None and key_padding_mask is None:
        return fa.flash_attn_func(q, k, v, **opts)
    batch, seq = q.shape[:2]
    cu_seqlens, max_len, kept = varlen_layout(batch, seq, sequence_id, key_padding_mask, q.device)
    q, k, v = (t.flatten(0, 1) for t in (q, k, v))
    if kept is not None:
        q, k, v = q[kept], k[kept], v[kept]
    out = fa.flash_attn_varlen_func(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, **opts)
    if kept is not None:  # padding rows of the output are zeros
        out = out.new_zeros(batch * seq, *out.shape[1:]).index_copy(0, kept, out)
    return out.view(batch, seq, *out.shape[1:])
