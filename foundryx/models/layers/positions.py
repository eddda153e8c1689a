"""Position information: rotary embeddings (RoPE), ALiBi slopes, per-document positions."""

from __future__ import annotations

import math

import torch


def token_positions(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    sequence_id: torch.Tensor | None = None,
) -> torch.Tensor:
    """Position of each token, shape (batch, seq), as int64.

    With ``sequence_id`` positions restart at 0 where the id changes (packed documents are
    contiguous runs of one id). Otherwise, with ``attention_mask``, padding is not counted,
    so a left-padded sequence starts at position 0. Otherwise ``0..seq-1``.
    """
    batch, seq = input_ids.shape
    idx = torch.arange(seq, device=input_ids.device).expand(batch, seq)
    if sequence_id is not None:
        starts = torch.ones_like(sequence_id, dtype=torch.bool)
        starts[:, 1:] = sequence_id[:, 1:] != sequence_id[:, :-1]
        first = torch.where(starts, idx, torch.zeros_like(idx)).cummax(dim=1).values
        return idx - first
    if attention_mask is not None:
        return (attention_mask.long().cumsum(dim=1) - 1).clamp(min=0)
    return idx


def rope_cos_sin(
    positions: torch.Tensor, head_dim: int, theta: float = 10000.0, dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cosines and sines for RoPE at ``positions`` (batch, seq): each (batch, seq, 1, head_dim).

    Frequencies are ``theta ** (-2i / head_dim)``; angles are computed in float32 (float64
    when ``dtype`` is float64).
    """
    dtype = dtype or torch.get_default_dtype()
    work = torch.float64 if dtype == torch.float64 else torch.float32
    exponent = torch.arange(0, head_dim, 2, device=positions.device, dtype=work)
    inv_freq = theta ** (-exponent / head_dim)
    angles = positions.to(work)[..., None] * inv_freq  # (batch, seq, head_dim / 2)
    angles = torch.cat([angles, angles], dim=-1)[:, :, None, :]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (batch, seq, heads, head_dim): pairs are (i, i + head_dim/2), as in GPT-NeoX."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


def alibi_slopes(
    n_heads: int, alibi_bias_max: float = 8, device: torch.device | str | None = None
) -> torch.Tensor:
    """ALiBi slopes (n_heads,), float32: ``2 ** (-alibi_bias_max * h / n_heads)``, h = 1..n_heads.

    When ``n_heads`` is not a power of 2 (ALiBi paper, MPT): the slopes of the power of 2
    below it, then the in-between slopes of the power of 2 above it, until n_heads are taken.
    """
    n = 2 ** math.ceil(math.log2(n_heads))
    exps = torch.arange(1, n + 1, device=device, dtype=torch.float32) * (alibi_bias_max / n)
    slopes = 2.0**-exps
    if n != n_heads:
        slopes = torch.cat([slopes[1::2], slopes[::2]])[:n_heads]
    return slopes
