"""FlashAttention-2 backward kernels: recompute the probabilities from the saved logsumexp.

- :func:`flash_bwd_preprocess`: ``delta_i = sum_d dO_id * O_id`` (= rowsum(P * dP)).
- :func:`flash_bwd_dkdv_kernel`: one program per key tile of one kv head; it loops over the
  query heads of its group and the query tiles that see its keys, accumulating dK and dV in
  registers (no repeated K/V, no atomics).
- :func:`flash_bwd_dq_kernel`: one program per query tile of one head, looping over key tiles.
- :func:`flash_bwd_atomic_kernel`: FlashAttention-2's own backward in one kernel: the dK/dV
  program also adds each tile's ``dS^T K`` into a float32 dQ buffer with ``tl.atomic_add``
  (5 matmuls per tile, against 7 for the two kernels above, which recompute ``Q K^T`` and
  ``dO V^T`` for dQ). The tuning table's ``BWD`` chooses between the two per device and head
  dim (:mod:`foundryx.kernels.tuning`). Its dQ sums in an order that varies run to run.

With ``s = scale * q.k + bias`` and ``P = softmax(s)``: ``dV = P^T dO``, ``dP = dO V^T``,
``dS = P * (dP - delta)``, ``dQ = scale * dS K``, ``dK = scale * dS^T Q``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from foundryx.kernels.flash_common import (
    alibi_slope,
    bias_and_mask,
    load_tile,
    query_key_scores,
    store_tile,
    tile_spans,
)

# Kernel argument lists are grouped by hand; the formatter would put one per line.
# fmt: off

@triton.jit
def flash_bwd_preprocess(
    Out, DO, DELTA, stride_ob, stride_os, stride_oh, stride_dob, stride_dos, stride_doh, S, H,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    """Grid (cdiv(S, BLOCK_M), batch * H); DELTA is (batch, H, S) float32."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    row0 = pid_m * BLOCK_M
    o = load_tile(
        Out + b * stride_ob + h * stride_oh, row0, stride_os, S, BLOCK_M, HEAD_DIM, BLOCK_D, True
    )
    do = load_tile(
        DO + b * stride_dob + h * stride_doh, row0, stride_dos, S, BLOCK_M, HEAD_DIM, BLOCK_D, True
    )
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    offs_m = row0 + tl.arange(0, BLOCK_M)
    tl.store(DELTA + pid_bh.to(tl.int64) * S + offs_m, delta, mask=offs_m < S)


@triton.jit
def _dkdv_loop(
    dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_dos, offs_n, lo, hi,
    slope, key_ok, qk_scale, S, start, end,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
    HAS_KPM: tl.constexpr, HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    for start_m in range(start, end, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = load_tile(q_base, start_m, stride_qs, S, BLOCK_M, HEAD_DIM, BLOCK_D, MASKED)
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale  # (keys, queries)
        s_t = bias_and_mask(s_t, offs_n, offs_m, lo, hi, slope, key_ok, MASKED, HAS_KPM, HAS_ALIBI)
        lse = tl.load(lse_base + offs_m, mask=offs_m < S, other=0.0)
        p_t = tl.exp2(s_t - lse[None, :])
        do = load_tile(do_base, start_m, stride_dos, S, BLOCK_M, HEAD_DIM, BLOCK_D, MASKED)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        delta = tl.load(delta_base + offs_m, mask=offs_m < S, other=0.0)
        ds_t = p_t * (dp_t - delta[None, :])
        dk = tl.dot(ds_t.to(q.dtype), q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def _key_block(
    DOC_START, DOC_END, stride_docb, window, S, KV_H,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_DOCS: tl.constexpr, CAUSAL: tl.constexpr,
    HAS_WINDOW: tl.constexpr, HAS_KPM: tl.constexpr,
):
    """This program's key tile (grid (cdiv(S, BLOCK_N), batch * KV_H)): its batch, kv head,
    first key and key offsets, and the query spans that see its keys (tile_spans)."""
    pid_n = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // KV_H).to(tl.int64)
    hk = pid_bh % KV_H
    col0 = pid_n * BLOCK_N
    offs_n = col0 + tl.arange(0, BLOCK_N)
    lo, hi, start, full_lo, full_hi, end = tile_spans(
        offs_n, S, DOC_START + b * stride_docb, DOC_END + b * stride_docb, window, BLOCK_M,
        HAS_DOCS, CAUSAL, HAS_WINDOW, HAS_KPM, False,
    )
    return b, hk, col0, offs_n, lo, hi, start, full_lo, full_hi, end


@triton.jit
def _key_tile(
    K, V, KPM, b, hk, col0, offs_n, S, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_kpmb,
    HAS_KPM: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """The BLOCK_N keys and values of kv head ``hk`` from ``col0``, which of them the key
    padding mask keeps (0 without one), and the zeroed float32 dK, dV accumulators: the start
    of both backwards' key-tile kernels."""
    key_ok = 0
    if HAS_KPM:
        key_ok = tl.load(KPM + b * stride_kpmb + offs_n, mask=offs_n < S, other=0)[:, None] != 0
    k = load_tile(
        K + b * stride_kb + hk * stride_kh, col0, stride_ks, S, BLOCK_N, HEAD_DIM, BLOCK_D, True
    )
    v = load_tile(
        V + b * stride_vb + hk * stride_vh, col0, stride_vs, S, BLOCK_N, HEAD_DIM, BLOCK_D, True
    )
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    return key_ok, k, v, dk, dv


@triton.jit
def flash_bwd_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DOC_START, DOC_END, KPM, SLOPES,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
    stride_docb, stride_kpmb,
    S, H, KV_H, GROUP, qk_scale, sm_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_KPM: tl.constexpr, HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid (cdiv(S, BLOCK_N), batch * KV_H): dK, dV of BLOCK_N keys of one kv head."""
    b, hk, col0, offs_n, lo, hi, start, full_lo, full_hi, end = _key_block(
        DOC_START, DOC_END, stride_docb, window, S, KV_H, BLOCK_M, BLOCK_N, HAS_DOCS, CAUSAL,
        HAS_WINDOW, HAS_KPM,
    )
    key_ok, k, v, dk, dv = _key_tile(
        K, V, KPM, b, hk, col0, offs_n, S, stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_kpmb, HAS_KPM, BLOCK_N, HEAD_DIM, BLOCK_D,
    )
    for g in range(GROUP):
        h = hk * GROUP + g
        slope = alibi_slope(SLOPES, h, HAS_ALIBI)
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        lse_base = LSE + (b * H + h) * S
        delta_base = DELTA + (b * H + h) * S
        # masked blocks before the middle, unmasked middle, masked blocks after it
        dk, dv = _dkdv_loop(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_dos, offs_n, lo,
            hi, slope, key_ok, qk_scale, S, start, full_lo, HEAD_DIM, BLOCK_D, BLOCK_M, True,
            HAS_KPM, HAS_ALIBI, DOT_PRECISION,
        )
        dk, dv = _dkdv_loop(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_dos, offs_n, lo,
            hi, slope, key_ok, qk_scale, S, full_lo, full_hi, HEAD_DIM, BLOCK_D, BLOCK_M, False,
            HAS_KPM, HAS_ALIBI, DOT_PRECISION,
        )
        dk, dv = _dkdv_loop(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, stride_qs, stride_dos, offs_n, lo,
            hi, slope, key_ok, qk_scale, S, full_hi, end, HEAD_DIM, BLOCK_D, BLOCK_M, True, HAS_KPM,
            HAS_ALIBI, DOT_PRECISION,
        )
    dk = dk * sm_scale
    dk_base = DK + b * stride_dkb + hk * stride_dkh
    dv_base = DV + b * stride_dvb + hk * stride_dvh
    store_tile(dk_base, col0, stride_dks, S, dk.to(DK.dtype.element_ty), BLOCK_N, HEAD_DIM, BLOCK_D)
    store_tile(dv_base, col0, stride_dvs, S, dv.to(DV.dtype.element_ty), BLOCK_N, HEAD_DIM, BLOCK_D)


@triton.jit
def _dq_loop(
    dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_vs, kpm_base, offs_m, lo, hi, slope,
    qk_scale, S, start, end,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
    HAS_KPM: tl.constexpr, HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    for start_n in range(start, end, BLOCK_N):
        k, s = query_key_scores(
            q, k_base, start_n, stride_ks, kpm_base, offs_m, lo, hi, slope, qk_scale, S,
            HEAD_DIM, BLOCK_D, BLOCK_N, MASKED, HAS_KPM, HAS_ALIBI, DOT_PRECISION,
        )
        p = tl.exp2(s - lse[:, None])
        v = load_tile(v_base, start_n, stride_vs, S, BLOCK_N, HEAD_DIM, BLOCK_D, MASKED)
        dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
        ds = p * (dp - delta[:, None])
        dq = tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)
    return dq


@triton.jit
def flash_bwd_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, DOC_START, DOC_END, KPM, SLOPES,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
    stride_dqb, stride_dqs, stride_dqh, stride_docb, stride_kpmb,
    S, H, GROUP, qk_scale, sm_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_KPM: tl.constexpr, HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid (cdiv(S, BLOCK_M), batch * H): dQ of BLOCK_M queries of one head."""
    pid_m = tl.program_id(0)
    pid_bh = tl.program_id(1)
    b = (pid_bh // H).to(tl.int64)
    h = pid_bh % H
    hk = h // GROUP
    row0 = pid_m * BLOCK_M
    offs_m = row0 + tl.arange(0, BLOCK_M)
    lo, hi, start, full_lo, full_hi, end = tile_spans(
        offs_m, S, DOC_START + b * stride_docb, DOC_END + b * stride_docb, window, BLOCK_N,
        HAS_DOCS, CAUSAL, HAS_WINDOW, HAS_KPM, True,
    )
    slope = alibi_slope(SLOPES, h, HAS_ALIBI)
    q = load_tile(
        Q + b * stride_qb + h * stride_qh, row0, stride_qs, S, BLOCK_M, HEAD_DIM, BLOCK_D, True
    )
    do = load_tile(
        DO + b * stride_dob + h * stride_doh, row0, stride_dos, S, BLOCK_M, HEAD_DIM, BLOCK_D, True
    )
    lse = tl.load(LSE + pid_bh.to(tl.int64) * S + offs_m, mask=offs_m < S, other=0.0)
    delta = tl.load(DELTA + pid_bh.to(tl.int64) * S + offs_m, mask=offs_m < S, other=0.0)
    k_base = K + b * stride_kb + hk * stride_kh
    v_base = V + b * stride_vb + hk * stride_vh
    kpm_base = KPM + b * stride_kpmb
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    # masked blocks before the middle, unmasked middle, masked blocks after it
    dq = _dq_loop(
        dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_vs, kpm_base, offs_m, lo, hi,
        slope, qk_scale, S, start, full_lo, HEAD_DIM, BLOCK_D, BLOCK_N, True, HAS_KPM, HAS_ALIBI,
        DOT_PRECISION,
    )
    dq = _dq_loop(
        dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_vs, kpm_base, offs_m, lo, hi,
        slope, qk_scale, S, full_lo, full_hi, HEAD_DIM, BLOCK_D, BLOCK_N, False, HAS_KPM, HAS_ALIBI,
        DOT_PRECISION,
    )
    dq = _dq_loop(
        dq, q, do, lse, delta, k_base, v_base, stride_ks, stride_vs, kpm_base, offs_m, lo, hi,
        slope, qk_scale, S, full_hi, end, HEAD_DIM, BLOCK_D, BLOCK_N, True, HAS_KPM, HAS_ALIBI,
        DOT_PRECISION,
    )
    dq = dq * sm_scale
    dq_base = DQ + b * stride_dqb + h * stride_dqh
    store_tile(dq_base, row0, stride_dqs, S, dq.to(DQ.dtype.element_ty), BLOCK_M, HEAD_DIM, BLOCK_D)


@triton.jit
def _atomic_loop(
    dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base, stride_qs, stride_dos,
    stride_dqs, offs_n, lo, hi, slope, key_ok, qk_scale, sm_scale, S, start, end,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr,
    HAS_KPM: tl.constexpr, HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    cols = tl.arange(0, BLOCK_D)
    for start_m in range(start, end, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        q = load_tile(q_base, start_m, stride_qs, S, BLOCK_M, HEAD_DIM, BLOCK_D, MASKED)
        s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION) * qk_scale  # (keys, queries)
        s_t = bias_and_mask(s_t, offs_n, offs_m, lo, hi, slope, key_ok, MASKED, HAS_KPM, HAS_ALIBI)
        lse = tl.load(lse_base + offs_m, mask=offs_m < S, other=0.0)
        p_t = tl.exp2(s_t - lse[None, :])
        do = load_tile(do_base, start_m, stride_dos, S, BLOCK_M, HEAD_DIM, BLOCK_D, MASKED)
        dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
        dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
        delta = tl.load(delta_base + offs_m, mask=offs_m < S, other=0.0)
        ds_t = (p_t * (dp_t - delta[None, :])).to(q.dtype)
        dk = tl.dot(ds_t, q, dk, input_precision=DOT_PRECISION)
        dq = tl.dot(tl.trans(ds_t), k, input_precision=DOT_PRECISION) * sm_scale
        rows = tl.arange(0, BLOCK_M)
        ptrs = dq_base + tl.cast(start_m, tl.int64) * stride_dqs + rows[:, None] * stride_dqs
        ptrs = ptrs + cols[None, :]
        if MASKED:
            tl.atomic_add(ptrs, dq, mask=(offs_m[:, None] < S) & (cols[None, :] < HEAD_DIM),
                          sem="relaxed")
        elif BLOCK_D != HEAD_DIM:
            tl.atomic_add(ptrs, dq, mask=cols[None, :] < HEAD_DIM, sem="relaxed")
        else:
            tl.atomic_add(ptrs, dq, sem="relaxed")
    return dk, dv


@triton.jit
def flash_bwd_atomic_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ, DOC_START, DOC_END, KPM, SLOPES,
    stride_qb, stride_qs, stride_qh, stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh, stride_dob, stride_dos, stride_doh,
    stride_dkb, stride_dks, stride_dkh, stride_dvb, stride_dvs, stride_dvh,
    stride_dqb, stride_dqs, stride_dqh, stride_docb, stride_kpmb,
    S, H, KV_H, GROUP, qk_scale, sm_scale, window,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, HAS_DOCS: tl.constexpr, HAS_WINDOW: tl.constexpr,
    HAS_KPM: tl.constexpr, HAS_ALIBI: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """Grid (cdiv(S, BLOCK_N), batch * KV_H): dK, dV of BLOCK_N keys of one kv head, as
    :func:`flash_bwd_dkdv_kernel`, and their share of dQ (``sm_scale * dS^T K``) of every
    query head of the group added into DQ, float32 and zeroed before the launch."""
    b, hk, col0, offs_n, lo, hi, start, full_lo, full_hi, end = _key_block(
        DOC_START, DOC_END, stride_docb, window, S, KV_H, BLOCK_M, BLOCK_N, HAS_DOCS, CAUSAL,
        HAS_WINDOW, HAS_KPM,
    )
    # The last key tile: its rows past S (zeros) go through the masked loop, where their
    # probabilities are 0, so nothing of theirs reaches dQ (the unmasked loop would give them
    # exp2(bias - lse), not 0, which overflows to inf for a row of very negative scores).
    partial = col0 + BLOCK_N > S
    full_lo = tl.where(partial, end, full_lo)
    full_hi = tl.where(partial, end, full_hi)
    key_ok, k, v, dk, dv = _key_tile(
        K, V, KPM, b, hk, col0, offs_n, S, stride_kb, stride_ks, stride_kh,
        stride_vb, stride_vs, stride_vh, stride_kpmb, HAS_KPM, BLOCK_N, HEAD_DIM, BLOCK_D,
    )
    for g in range(GROUP):
        h = hk * GROUP + g
        slope = alibi_slope(SLOPES, h, HAS_ALIBI)
        q_base = Q + b * stride_qb + h * stride_qh
        do_base = DO + b * stride_dob + h * stride_doh
        dq_base = DQ + b * stride_dqb + h * stride_dqh
        lse_base = LSE + (b * H + h) * S
        delta_base = DELTA + (b * H + h) * S
        # masked blocks before the middle, unmasked middle, masked blocks after it
        dk, dv = _atomic_loop(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base, stride_qs, stride_dos,
            stride_dqs, offs_n, lo, hi, slope, key_ok, qk_scale, sm_scale, S, start, full_lo,
            HEAD_DIM, BLOCK_D, BLOCK_M, True, HAS_KPM, HAS_ALIBI, DOT_PRECISION,
        )
        dk, dv = _atomic_loop(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base, stride_qs, stride_dos,
            stride_dqs, offs_n, lo, hi, slope, key_ok, qk_scale, sm_scale, S, full_lo, full_hi,
            HEAD_DIM, BLOCK_D, BLOCK_M, False, HAS_KPM, HAS_ALIBI, DOT_PRECISION,
        )
        dk, dv = _atomic_loop(
            dk, dv, k, v, q_base, do_base, lse_base, delta_base, dq_base, stride_qs, stride_dos,
            stride_dqs, offs_n, lo, hi, slope, key_ok, qk_scale, sm_scale, S, full_hi, end,
            HEAD_DIM, BLOCK_D, BLOCK_M, True, HAS_KPM, HAS_ALIBI, DOT_PRECISION,
        )
    dk = dk * sm_scale
    dk_base = DK + b * stride_dkb + hk * stride_dkh
    dv_base = DV + b * stride_dvb + hk * stride_dvh
    store_tile(dk_base, col0, stride_dks, S, dk.to(DK.dtype.element_ty), BLOCK_N, HEAD_DIM, BLOCK_D)
    store_tile(dv_base, col0, stride_dvs, S, dv.to(DV.dtype.element_ty), BLOCK_N, HEAD_DIM, BLOCK_D)
