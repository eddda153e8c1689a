"""FlashAttention-2 forward kernel: tiles of queries, online softmax over key tiles.

One program computes ``BLOCK_M`` query rows of one (batch, head): it streams the key/value
tiles that some row sees, keeps the running row maximum ``m`` and sum ``l`` (log2 units), and
writes the output and the row logsumexp (``m + log2 l``) that the backward recomputes from.
K/V of query head ``h`` are kv head ``h // GROUP`` (grouped- and multi-query attention).
"""

from __future__ import annotations

import triton
import triton.language as tl

from foundryx.kernels.flash_common import (
    alibi_slope,
    load_tile,
    query_key_scores,
    store_tile,
    tile_spans,
)

# Kernel argument lists are grouped by hand; the formatter would put one per line.
# fmt: off

@triton.jit
def _fwd_loop(
    acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, kpm_base, offs_m, lo, hi, slope,
    qk_scale, S, start, end,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    HAS_KPM: tl.constexpr, HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    for start_n in range(start, end, BLOCK_N):
        _, s = query_key_scores(
            q, k_base, start_n, stride_ks, kpm_base, offs_m, lo, hi, slope, qk_scale, S,
            HEAD_DIM, BLOCK_D, BLOCK_N, MASKED, HAS_KPM, HAS_ALIBI, DOT_PRECISION,
        )
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = load_tile(v_base, start_n, stride_vs, S, BLOCK_N, HEAD_DIM, BLOCK_D, MASKED)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def flash_fwd_kernel(
    Q, K, V, Out, LSE, DOC_START, DOC_END, KPM, SLOPES,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_ob, stride_os, stride_oh, stride_docb, stride_kpmb,
    S, H, GROUP, qk_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_KPM: tl.constexpr, HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid (cdiv(S, BLOCK_M), batch * H). ``qk_scale`` = softmax scale * log2(e); ALiBi
    slopes are in natural units; LSE is (batch, H, S) float32 in log2 units."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    hk = h // GROUP
    q_base = Q + b * stride_qb + h * stride_qh
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    kpm_base = KPM + b * stride_kpmb
    row0 = pid_m * BLOCK_M
    offs_m = row0 + tl.arange(0, BLOCK_M)

    lo, hi, start, full_lo, full_hi, end = tile_spans(
        offs_m, S, DOC_START + b * stride_docb, DOC_END + b * stride_docb, window, BLOCK_N,
        HAS_DOCS, CAUSAL, HAS_WINDOW, HAS_KPM, True,
    )
    slope = alibi_slope(SLOPES, h, HAS_ALIBI)
    q = load_tile(q_base, row0, stride_qs, S, BLOCK_M, HEAD_DIM, BLOCK_D, True)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - 1.0e30  # finite: no inf - inf before a hit
    # masked blocks before the middle, unmasked middle, masked blocks after it
    acc, l_i, m_i = _fwd_loop(
        acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, kpm_base, offs_m, lo, hi, slope,
        qk_scale, S, start, full_lo, HEAD_DIM, BLOCK_D, BLOCK_N, True, HAS_KPM, HAS_ALIBI,
        DOT_PRECISION,
    )
    acc, l_i, m_i = _fwd_loop(
        acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, kpm_base, offs_m, lo, hi, slope,
        qk_scale, S, full_lo, full_hi, HEAD_DIM, BLOCK_D, BLOCK_N, False, HAS_KPM, HAS_ALIBI,
        DOT_PRECISION,
    )
    acc, l_i, m_i = _fwd_loop(
        acc, l_i, m_i, q, k_base, v_base, stride_ks, stride_vs, kpm_base, offs_m, lo, hi, slope,
        qk_scale, S, full_hi, end, HEAD_DIM, BLOCK_D, BLOCK_N, True, HAS_KPM, HAS_ALIBI,
        DOT_PRECISION,
    )
    acc = acc / l_i[:, None]
    o_base = Out + b * stride_ob + h * stride_oh
    store_tile(o_base, row0, stride_os, S, acc.to(Out.dtype.element_ty), BLOCK_M, HEAD_DIM, BLOCK_D)
    tl.store(LSE + pid_bh.to(tl.int64) * S + offs_m, m_i + tl.log2(l_i), mask=offs_m < S)
