"""``attn_impl: flex``: PyTorch's FlexAttention with a block mask built from the documents.

Packed documents, the sliding window, causality and padding become a ``BlockMask``: for each
block of ``BLOCK`` queries, the key blocks some query of it sees, split into *full* blocks
(every pair kept: no mask is evaluated there) and *partial* ones (the mask function decides
pair by pair); every other block is skipped. The mask is built from the document boundaries
directly (each query sees an interval of keys: document ∩ causal ∩ window), never as a
``seq x seq`` tensor: its size is ``batch x (seq / BLOCK)²`` entries, not ``batch x seq²``.
At 512K tokens a dense boolean mask is 256 GiB; this one is four lists of 64 MiB (int32: the
partial and the full blocks, by query block and by key block) per row.
ALiBi is a score modification (``score - slope[h] * |i - j|``), GQA FlexAttention's own
``enable_gqa`` (K/V are not repeated).

Where it runs: on a GPU, ``torch.compile(flex_attention)`` (one fused Triton kernel that skips
the empty blocks and evaluates the mask only in partial ones: how FlexAttention is fast), or,
inside a compiled model block, FlexAttention itself, which that compilation fuses. On a CPU,
FlexAttention's eager implementation, which computes the dense scores of each (batch, head)
(memory ``seq²`` per head: for tests and short sequences); where this torch has no CPU
backward for it (2.15), or inside a compiled block, :func:`dense_flex`, the same mask and
score functions evaluated in plain PyTorch. Outside compiled code each is said in one log line
the first time it runs on a device type.

Semantics are those of the ``triton`` and ``flash`` implementations: a document is a run of one
``sequence_id`` value; a window ``w`` keeps keys with ``|i - j| <= w``; a padding key is never
seen; a padding query's output is unspecified (zeros where it sees no key). No attention
dropout.
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable
from typing import Any

import torch

from foundryx.models.layers.attention_select import (
    CHOOSE,
    AttentionError,
    autocast_inputs,
    flex_problem,
)

log = logging.getLogger(__name__)

BLOCK = 128  # FlexAttention's default sparse block: the compiled kernels' tiles divide it


def interval_bounds(
    batch: int, seq: int, causal: bool, sequence_id: torch.Tensor | None,
    sliding_window: int | None, device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(doc, lo, hi)``, each (batch, seq) int64: the document index of each token (a run of
    one sequence_id value) and the first and last key each query sees, padding aside."""
    idx = torch.arange(seq, device=device).expand(batch, seq)
    if sequence_id is None:
        doc = torch.zeros(batch, seq, dtype=torch.long, device=device)
        lo = torch.zeros_like(idx)
        hi = torch.full_like(idx, seq - 1)
    else:
        starts = torch.ones(batch, seq, dtype=torch.bool, device=device)
        starts[:, 1:] = sequence_id[:, 1:] != sequence_id[:, :-1]
        doc = starts.long().cumsum(1) - 1
        lo = torch.where(starts, idx, torch.zeros_like(idx)).cummax(1).values
        ends = torch.ones_like(starts)  # last token of each run
        ends[:, :-1] = starts[:, 1:]
        last = torch.where(ends, idx, torch.full_like(idx, seq - 1))
        hi = last.flip(1).cummin(1).values.flip(1)
    if causal:
        hi = idx.clone()
    if sliding_window is not None:
        lo = torch.maximum(lo, idx - sliding_window)
        hi = torch.minimum(hi, idx + sliding_window)
    return doc, lo, hi


def block_layout(
    lo: torch.Tensor, hi: torch.Tensor, key_padding_mask: torch.Tensor | None, block: int = BLOCK
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(partial, full)`` bool (batch, n_blocks, n_blocks): which (query block, key block)
    pairs hold some kept pair, and which hold only kept pairs (no mask needed there).

    ``lo`` and ``hi`` (batch, seq), each non-decreasing along the sequence (true of document ∩
    causal ∩ window intervals), bound the keys each query sees; ``key_padding_mask`` (batch,
    seq), True = real, removes keys. Cost O(batch x n_blocks² x log block); nothing is
    ``seq x seq``."""
    batch, seq = lo.shape
    n = -(-seq // block)
    pad = n * block - seq
    # rows past the end copy the last row: they add nothing to any/all over a block
    lo_b = torch.nn.functional.pad(lo, (0, pad), mode="replicate").view(batch, n, block)
    hi_b = torch.nn.functional.pad(hi, (0, pad), mode="replicate").view(batch, n, block)
    first_key = torch.arange(n, device=lo.device) * block  # c0 of each key block
    last_key = (first_key + block - 1).clamp(max=seq - 1)  # c1
    # lo is non-decreasing: the queries of a block with lo <= c1 are a prefix of it, and the
    # largest hi among them is that prefix's last. Some query meets [c0, c1] iff that hi >= c0.
    c1 = last_key.expand(batch, n, n).contiguous()
    p = torch.searchsorted(lo_b.contiguous(), c1, right=True) - 1  # (batch, q block, k block)
    meets = (p >= 0) & (hi_b.gather(2, p.clamp(min=0)) >= first_key)
    # every query of the block sees all of [c0, c1]: the largest lo <= c0, the smallest hi >= c1
    full = (lo_b[:, :, -1:] <= first_key) & (hi_b[:, :, :1] >= last_key)
    full = full & (last_key - first_key == block - 1)  # a key block cut by the end is partial
    if pad:
        full[:, -1, :] = False  # so is a query block cut by the end
    if key_padding_mask is not None:
        real = key_padding_mask.to(lo.device).bool()
        any_real = torch.nn.functional.pad(real, (0, pad), value=False).view(batch, n, block)
        all_real = torch.nn.functional.pad(real, (0, pad), value=True).view(batch, n, block)
        meets = meets & any_real.any(-1)[:, None, :]
        full = full & all_real.all(-1)[:, None, :]
    full = full & meets
    return meets & ~full, full


def _indices(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(count, indices) int32 of a (batch, n, n) bool layout, with a head dim of 1: the kept key
    blocks of each query block first, in increasing order."""
    n = blocks.shape[-1]
    upto = blocks.cumsum(-1)  # kept blocks up to and including each
    count = upto[..., -1]
    col = torch.arange(n, device=blocks.device)
    # where each block goes: a kept one at its rank among the kept, a skipped one after all the
    # kept at its rank among the skipped (a permutation, placed without sorting)
    target = torch.where(blocks, upto - 1, count[..., None] + col - upto)
    order = torch.empty_like(target).scatter_(-1, target, col.expand_as(target))
    return count.to(torch.int32)[:, None], order.to(torch.int32)[:, None]


def document_block_mask(
    batch: int, seq: int, *, causal: bool = True, sequence_id: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None, sliding_window: int | None = None,
    device: torch.device | str = "cpu", block: int = BLOCK,
):
    """The FlexAttention ``BlockMask`` of ``torch_attention``'s masking arguments (one head
    dim: the mask is the same for every head), built without a ``seq x seq`` tensor."""
    from torch.nn.attention.flex_attention import BlockMask

    device = torch.device(device)
    doc, lo, hi = interval_bounds(batch, seq, causal, sequence_id, sliding_window, device)
    partial, full = block_layout(lo, hi, key_padding_mask, block)
    real = None if key_padding_mask is None else key_padding_mask.to(device).bool()
    mask_mod = _mask_mod(doc if sequence_id is not None else None, real, causal, sliding_window)
    # both directions from the layout (the backward walks the query blocks of each key
    # block): BlockMask.from_kv_blocks would transpose the index lists through a dense
    # intermediate, 12x the time of the rest at 512K tokens on a CPU
    kv_num, kv_idx = _indices(partial)
    full_num, full_idx = _indices(full)
    q_num, q_idx = _indices(partial.transpose(1, 2))
    full_q_num, full_q_idx = _indices(full.transpose(1, 2))
    return BlockMask(seq_lengths=(seq, seq), kv_num_blocks=kv_num, kv_indices=kv_idx,
                     full_kv_num_blocks=full_num, full_kv_indices=full_idx,
                     q_num_blocks=q_num, q_indices=q_idx, full_q_num_blocks=full_q_num,
                     full_q_indices=full_q_idx, BLOCK_SIZE=(block, block), mask_mod=mask_mod)


def _mask_mod(doc: torch.Tensor | None, real: torch.Tensor | None, causal: bool,
              window: int | None) -> Callable:
    """The pair-by-pair mask of the partial blocks."""

    def mask_mod(b, h, q_idx, kv_idx):
        keep = q_idx >= 0  # a true of the right shape
        if causal:
            keep = keep & (q_idx >= kv_idx)
        if window is not None:
            keep = keep & ((q_idx - kv_idx).abs() <= window)
        if doc is not None:
            keep = keep & (doc[b, q_idx] == doc[b, kv_idx])
        if real is not None:
            keep = keep & real[b, kv_idx]
        return keep

    return mask_mod


def _alibi(slopes: torch.Tensor) -> Callable:
    def score_mod(score, b, h, q_idx, kv_idx):
        return score - slopes[h] * (q_idx - kv_idx).abs()

    return score_mod


@functools.cache
def runner(device_type: str, grad: bool = False) -> Callable:
    """FlexAttention as it runs on ``device_type``: compiled on a GPU, eager elsewhere; said in
    one line, once per device type (and per need of a gradient)."""
    from torch.nn.attention.flex_attention import flex_attention as flex

    if device_type == "cuda":
        log.info("attention: flex runs torch.compile(flex_attention) on the GPU: one fused "
                 "kernel that skips the blocks no query sees")
        return torch.compile(flex)
    if grad and not cpu_backward():
        log.info("attention: flex evaluates its mask and score functions densely on %s for "
                 "training: this torch (%s) has no FlexAttention backward there (a GPU runs "
                 "it compiled, block-sparse)", device_type, torch.__version__)
        return dense_flex
    log.info("attention: flex runs FlexAttention eagerly on %s (dense scores per head: for "
             "tests and short sequences; a GPU runs it compiled, block-sparse)", device_type)

    def eager(*args: Any, **kwargs: Any) -> torch.Tensor:
        with warnings.catch_warnings():  # the "without torch.compile" note: said above
            warnings.simplefilter("ignore", UserWarning)
            return flex(*args, **kwargs)

    return eager


def _run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Callable:
    """The function that runs FlexAttention for this call. Inside a compiled region (the
    model's blocks under ``compile``) the choice is made without probing or logging, which
    would be traced: on a GPU FlexAttention itself, which that compilation fuses into its
    kernel; on a CPU the dense evaluation, plain PyTorch that inductor compiles like any other
    (FlexAttention's CPU lowering differs between torch versions, and torch 2.15 has no CPU
    backward for it)."""
    device = q.device.type
    if torch.compiler.is_compiling():
        if device == "cpu":
            return dense_flex
        from torch.nn.attention.flex_attention import flex_attention as flex

        return flex
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    return runner(device, grad and device == "cpu")


@functools.cache
def cpu_backward() -> bool:
    """Whether this torch's FlexAttention takes a gradient on CPU (2.7 does; 2.15 refuses)."""
    from torch.nn.attention.flex_attention import flex_attention as flex

    x = torch.zeros(1, 1, 1, 16, requires_grad=True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            flex(x, x, x)
    except NotImplementedError:
        return False
    return True


def dense_flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, score_mod=None,
               block_mask=None, scale: float | None = None, enable_gqa: bool = False):
    """What FlexAttention's eager implementation computes (q, k, v (batch, heads, seq, dim)),
    in plain autograd-able PyTorch: the score and mask functions on every pair. For CPUs whose
    torch has no FlexAttention backward; zeros for a query that sees no key."""
    batch, heads, seq, dim = q.shape
    if enable_gqa:
        k, v = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (k, v))
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    scale = dim ** -0.5 if scale is None else scale
    scores = (q.to(work) @ k.to(work).transpose(-2, -1)) * scale
    b, h, i, j = (torch.arange(n, device=q.device).view([-1 if d == a else 1 for d in range(4)])
                  for a, n in enumerate((batch, heads, seq, seq)))
    if score_mod is not None:
        scores = score_mod(scores, b, h, i, j)
    keep = torch.ones(1, 1, seq, seq, dtype=torch.bool, device=q.device)
    if block_mask is not None:
        keep = block_mask.mask_mod(b, h[:, :1], i, j)
    probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)
    probs = torch.where(keep.any(-1, keepdim=True), probs, 0.0)
    return (probs @ v.to(work)).to(q.dtype)


def flex_attention(
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
    """FlexAttention with the arguments and shapes of ``torch_attention``; raises
    ``AttentionError`` where it cannot run (attention dropout; a torch without it)."""
    q, k, v = autocast_inputs(q, k, v)
    problem = flex_problem(dropout_p)
    if problem:
        fix = "set model.attn_config.attn_pdrop: 0, or " if dropout_p else ""
        raise AttentionError(f"attn_impl 'flex' cannot run here: {problem}. Fix: {fix}"
                             + CHOOSE.format(others="torch or flash") + ".")
    batch, seq, n_heads, _ = q.shape
    kv_n_heads = k.shape[2]
    if n_heads % kv_n_heads:
        raise ValueError(f"n_heads {n_heads} is not a multiple of kv_n_heads {kv_n_heads}")
    if k.shape[1] != seq:
        raise AttentionError(f"attn_impl 'flex' cannot run here: query length {seq} differs "
                             f"from key length {k.shape[1]}. Fix: " + CHOOSE.format(others="torch")
                             + ".")
    block_mask = None
    if causal or sequence_id is not None or key_padding_mask is not None \
            or sliding_window is not None:
        block_mask = document_block_mask(batch, seq, causal=causal, sequence_id=sequence_id,
                                         key_padding_mask=key_padding_mask,
                                         sliding_window=sliding_window, device=q.device)
    score_mod = None
    if alibi_slopes is not None:
        work = torch.float64 if q.dtype == torch.float64 else torch.float32
        score_mod = _alibi(alibi_slopes.to(q.device, work))
    out = _run(q, k, v)(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), score_mod=score_mod,
        block_mask=block_mask, scale=softmax_scale, enable_gqa=n_heads != kv_n_heads)
    return out.transpose(1, 2)
