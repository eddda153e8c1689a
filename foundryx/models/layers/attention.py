"""Attention: the PyTorch SDPA implementation (``torch`` in the attention_implementations
registry).

A model resolves its implementation once, by name (``attn_config.attn_impl``), from
``foundryx.registry.attention_implementations``, so a plugin or a kernel can provide another
with the signature of :func:`torch_attention`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F


def torch_attention(
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
    """Scaled dot-product attention with ``F.scaled_dot_product_attention``.

    Shapes: q (batch, seq, n_heads, head_dim); k, v (batch, seq, kv_n_heads, head_dim) with
    n_heads a multiple of kv_n_heads (grouped-query attention). Returns q's shape.

    - ``causal``: query i sees keys j <= i.
    - ``sequence_id`` (batch, seq) ints: a query sees only keys with its id (packed documents).
    - ``alibi_slopes`` (n_heads,): adds ``-slope * |i - j|`` to the scores.
    - ``key_padding_mask`` (batch, seq) bool, True = real token: padding keys are not seen.
    - ``softmax_scale``: defaults to ``1 / sqrt(head_dim)``.
    - ``sliding_window`` w: a query sees only keys with ``|i - j| <= w``.

    Pure causal (or unmasked) attention passes no mask, so SDPA can pick its fused kernels.
    With a mask, every query also sees itself, so no row is fully masked (a padding query
    would otherwise produce NaN); rows of real tokens are unaffected.
    """
    n_heads, kv_n_heads = q.shape[2], k.shape[2]
    if n_heads % kv_n_heads:
        raise ValueError(f"n_heads {n_heads} is not a multiple of kv_n_heads {kv_n_heads}")
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # (batch, heads, seq, head_dim)
    mask = _attn_mask(q, causal, sequence_id, alibi_slopes, key_padding_mask, sliding_window)
    gqa = {}
    if n_heads != kv_n_heads:
        # SDPA's enable_gqa runs on its flash and math kernels only; the memory-efficient
        # kernel (the one for explicit masks) needs the K/V heads repeated.
        if mask is None and _sdpa_has_enable_gqa():
            gqa = {"enable_gqa": True}
        else:
            k = k.repeat_interleave(n_heads // kv_n_heads, dim=1)
            v = v.repeat_interleave(n_heads // kv_n_heads, dim=1)
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=dropout_p,
        is_causal=causal and mask is None,
        scale=softmax_scale,
        **gqa,
    )
    return out.transpose(1, 2)


def _attn_mask(
    q: torch.Tensor,
    causal: bool,
    sequence_id: torch.Tensor | None,
    alibi_slopes: torch.Tensor | None,
    key_padding_mask: torch.Tensor | None,
    sliding_window: int | None,
) -> torch.Tensor | None:
    """None for plain causal/full attention; else a bool keep-mask or a float bias, both
    broadcastable to (batch, n_heads, seq, seq)."""
    if (
        sequence_id is None
        and alibi_slopes is None
        and key_padding_mask is None
        and (sliding_window is None)
    ):
        return None
    seq = q.shape[2]
    pos = torch.arange(seq, device=q.device)
    dist = pos[:, None] - pos[None, :]  # query i minus key j
    keep = torch.ones(seq, seq, dtype=torch.bool, device=q.device)
    if causal:
        keep = keep & (dist >= 0)
    if sliding_window is not None:
        keep = keep & (dist.abs() <= sliding_window)
    keep = keep[None, None]  # (1, 1, seq, seq)
    if sequence_id is not None:
        keep = keep & (sequence_id[:, None, :, None] == sequence_id[:, None, None, :])
    if key_padding_mask is not None:
        keep = keep & key_padding_mask.bool()[:, None, None, :]
    keep = keep | torch.eye(seq, dtype=torch.bool, device=q.device)
    if alibi_slopes is None:
        return keep
    bias = -alibi_slopes.to(torch.float32)[:, None, None] * dist.abs()  # (n_heads, seq, seq)
    return bias.masked_fill(~keep, float("-inf")).to(q.dtype)


@functools.cache
def _sdpa_has_enable_gqa() -> bool:
    """Whether this torch's SDPA takes ``enable_gqa`` (torch >= 2.5)."""
    x = torch.zeros(1, 2, 1, 1)
    try:
        F.scaled_dot_product_attention(x, x[:, :1], x[:, :1], enable_gqa=True)
    except TypeError:
        return False
    return True
