"""Triton helpers shared by the FlashAttention forward and backward kernels.

Every mask the kernels support is an interval per row: query i sees the keys
``lo_i <= j <= hi_i`` (its document, the causal bound and the sliding window intersected),
and key j is seen by the queries in an interval of the same form. So a tile loop only visits
the column blocks some row needs, and only blocks at the edges of the intervals need a mask.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

# Triton reads TRITON_INTERPRET when a kernel is decorated, i.e. when this module is imported.
INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"


@triton.jit
def tile_spans(
    offs,
    S,
    doc_start_ptr,
    doc_end_ptr,
    window,
    BLOCK: tl.constexpr,
    HAS_DOCS: tl.constexpr,
    CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr,
    HAS_KPM: tl.constexpr,
    ROWS_ARE_QUERIES: tl.constexpr,
):
    """For the tile rows ``offs`` (queries, or keys when ROWS_ARE_QUERIES is false): the closed
    interval ``[lo, hi]`` of columns each row pairs with (empty for rows >= S), and the column
    blocks to visit, ``[start, end)`` in steps of BLOCK, of which ``[full_lo, full_hi)`` are
    seen whole by every row and need no mask (none with padding: HAS_KPM)."""
    valid = offs < S
    if HAS_DOCS:
        lo = tl.load(doc_start_ptr + offs, mask=valid, other=0)
        hi = tl.load(doc_end_ptr + offs, mask=valid, other=0) - 1
    else:
        lo = tl.zeros_like(offs)
        hi = tl.where(valid, S - 1, -1)
    if CAUSAL:
        if ROWS_ARE_QUERIES:
            hi = tl.minimum(hi, offs)
        else:
            lo = tl.maximum(lo, offs)
    if HAS_WINDOW:
        lo = tl.maximum(lo, offs - window)
        hi = tl.minimum(hi, offs + window)
    rows = hi >= lo
    start = tl.min(tl.where(rows, lo, 1 << 30), axis=0) // BLOCK * BLOCK
    end = tl.max(tl.where(rows, hi + 1, 0), axis=0)
    full_lo = tl.cdiv(tl.max(tl.where(rows, lo, 0), axis=0), BLOCK) * BLOCK
    full_hi = tl.min(tl.where(rows, hi + 1, 1 << 30), axis=0) // BLOCK * BLOCK
    if HAS_KPM:
        full_lo = end
        full_hi = end
    else:
        empty = full_hi <= full_lo
        full_lo = tl.where(empty, end, full_lo)
        full_hi = tl.where(empty, end, full_hi)
    return lo, hi, start, full_lo, full_hi, end


@triton.jit
def alibi_slope(SLOPES, h, HAS_ALIBI: tl.constexpr):
    """Head h's ALiBi slope in log2 units (0 without ALiBi)."""
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(SLOPES + h).to(tl.float32) * 1.4426950408889634
    return slope


@triton.jit
def load_tile(
    base,
    row0,
    stride,
    S,
    BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CHECK_ROWS: tl.constexpr,
):
    """Rows ``row0 .. row0 + BLOCK`` of a (seq, head_dim) slice; zeros outside it."""
    rows = tl.arange(0, BLOCK)
    cols = tl.arange(0, BLOCK_D)
    ptrs = base + tl.cast(row0, tl.int64) * stride + rows[:, None] * stride + cols[None, :]
    if CHECK_ROWS:
        return tl.load(
            ptrs, mask=(row0 + rows[:, None] < S) & (cols[None, :] < HEAD_DIM), other=0.0
        )
    elif BLOCK_D != HEAD_DIM:
        return tl.load(ptrs, mask=cols[None, :] < HEAD_DIM, other=0.0)
    else:
        return tl.load(ptrs)


@triton.jit
def store_tile(
    base, row0, stride, S, tile, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr
):
    """Store a (BLOCK, BLOCK_D) tile at rows ``row0 ..`` of a (seq, head_dim) slice."""
    rows = tl.arange(0, BLOCK)
    cols = tl.arange(0, BLOCK_D)
    ptrs = base + tl.cast(row0, tl.int64) * stride + rows[:, None] * stride + cols[None, :]
    tl.store(ptrs, tile, mask=(row0 + rows[:, None] < S) & (cols[None, :] < HEAD_DIM))


@triton.jit
def bias_and_mask(
    s,
    rows,
    cols,
    lo,
    hi,
    slope,
    key_ok,
    MASKED: tl.constexpr,
    HAS_KPM: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
):
    """Scores (log2 units) with the ALiBi bias ``-slope * |i - j|`` and, where MASKED, -inf
    outside each row's [lo, hi] and at padding keys (``key_ok`` false) other than i == j."""
    if HAS_ALIBI:
        s = s - slope * tl.abs(rows[:, None] - cols[None, :]).to(tl.float32)
    if MASKED:
        keep = (cols[None, :] >= lo[:, None]) & (cols[None, :] <= hi[:, None])
        if HAS_KPM:
            keep = keep & (key_ok | (rows[:, None] == cols[None, :]))
        s = tl.where(keep, s, float("-inf"))
    return s


@triton.jit
def query_key_scores(
    q,
    k_base,
    start_n,
    stride_ks,
    kpm_base,
    offs_m,
    lo,
    hi,
    slope,
    qk_scale,
    S,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    HAS_KPM: tl.constexpr,
    HAS_ALIBI: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """The key tile at ``start_n`` and the (queries, keys) scores of ``q`` with it, in log2
    units, biased and masked."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    k = load_tile(k_base, start_n, stride_ks, S, BLOCK_N, HEAD_DIM, BLOCK_D, MASKED)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale
    key_ok = 0
    if HAS_KPM:
        key_ok = tl.load(kpm_base + offs_n, mask=offs_n < S, other=0)[None, :] != 0
    return k, bias_and_mask(s, offs_m, offs_n, lo, hi, slope, key_ok, MASKED, HAS_KPM, HAS_ALIBI)
