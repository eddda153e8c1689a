"""The Triton FlashAttention-2 kernel against a dense float64 reference: outputs and dq/dk/dv.

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1 before any test runs); with one, on the GPU at larger sizes. Its bf16 path
runs on a CPU too, in the interpreter made to multiply and round bf16 as a GPU does, within a
bound derived from its roundings (test_bf16_on_a_cpu_within_its_roundings).
"""

from __future__ import annotations

import itertools
import math

import pytest
import torch

pytest.importorskip("triton")

from foundryx.kernels import flash_attention as fa  # noqa: E402
from foundryx.kernels import tuning  # noqa: E402
from foundryx.kernels.flash_attention import flash_attention  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning")  # numpy, in padded tile rows

GPU = torch.cuda.is_available()
DEVICE = "cuda" if GPU else "cpu"
SCALE = 8 if GPU else 1  # sequence lengths grow on a GPU
TOL = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}
GRAD_TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 6e-2}


def reference(
    q,
    k,
    v,
    causal=True,
    sequence_id=None,
    alibi_slopes=None,
    key_padding_mask=None,
    softmax_scale=None,
    sliding_window=None,
    probs_too=False,
):
    """Dense float64 attention with every mask written from its definition (``probs_too``:
    also the probabilities, (batch, heads, query, key))."""
    q, k, v = (t.double() for t in (q, k, v))
    _, seq, n_heads, head_dim = q.shape
    group = n_heads // k.shape[2]
    k, v = k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)
    scale = softmax_scale if softmax_scale is not None else 1 / math.sqrt(head_dim)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    i = torch.arange(seq, device=q.device)[:, None]
    j = torch.arange(seq, device=q.device)[None, :]
    keep = torch.ones(seq, seq, dtype=torch.bool, device=q.device)[None, None]
    if causal:
        keep = keep & (j <= i)
    if sliding_window is not None:
        keep = keep & ((i - j).abs() <= sliding_window)
    if sequence_id is not None:  # a document is a run of one id
        run = torch.cumsum(torch.nn.functional.pad(sequence_id.diff(dim=1) != 0, (1, 0)), 1)
        keep = keep & (run[:, None, :, None] == run[:, None, None, :])
    if key_padding_mask is not None:
        keep = keep & (key_padding_mask.bool()[:, None, None, :] | (i == j))
    if alibi_slopes is not None:
        scores = scores - alibi_slopes.double()[None, :, None, None] * (i - j).abs()
    probs = scores.masked_fill(~keep, float("-inf")).softmax(-1)
    out = torch.einsum("bhij,bjhd->bihd", probs, v)
    return (out, probs) if probs_too else out


def make_inputs(batch, seq, n_heads, kv_heads, head_dim, dtype, seed=0):
    """q, k, v as views of one fused projection, like MPTAttention's (non-contiguous heads)."""
    g = torch.Generator(device=DEVICE).manual_seed(seed)
    width = (n_heads + 2 * kv_heads) * head_dim
    fused = torch.randn(batch, seq, width, generator=g, device=DEVICE, dtype=torch.float32)
    fused = fused.to(dtype).requires_grad_()
    q, k, v = fused.split([n_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], -1)
    return fused, (
        q.view(batch, seq, n_heads, head_dim),
        k.view(batch, seq, kv_heads, head_dim),
        v.view(batch, seq, kv_heads, head_dim),
    )


def packed_ids(batch, seq):
    """Documents of uneven lengths (one of length 1), as a packing collator emits."""
    cuts = [0, seq // 5, seq // 5 + 1, seq // 2 + 3, seq]
    row = torch.cat([torch.full((b - a,), n) for n, (a, b) in enumerate(zip(cuts, cuts[1:]))])
    rows = [row, torch.zeros(seq, dtype=torch.long)]  # second row: one document
    return torch.stack([rows[r % 2] for r in range(batch)]).to(DEVICE)


def padding_mask(batch, seq):
    """Right padding in row 0, left padding in row 1."""
    m = torch.ones(batch, seq, dtype=torch.bool)
    m[0, seq - seq // 4 :] = False
    if batch > 1:
        m[1, : seq // 3] = False
    return m.to(DEVICE)


def run_both(
    batch,
    seq,
    n_heads,
    kv_heads,
    head_dim,
    dtype,
    causal=True,
    packed=False,
    alibi=False,
    window=None,
    padding=False,
    softmax_scale=None,
):
    """The kernel's output and the float64 reference's, each with dq, dk, dv for one random
    output gradient: ``{"out", "grads", "want", "want_grads", "q", "k", "v", "dout", "probs",
    "scale"}`` (the reference's inputs in float64, dq, dk, dv in the fused projection's order)."""
    fused, (q, k, v) = make_inputs(batch, seq, n_heads, kv_heads, head_dim, dtype)
    kw = {"causal": causal, "sliding_window": window, "softmax_scale": softmax_scale}
    if packed:
        kw["sequence_id"] = packed_ids(batch, seq)
    if alibi:
        kw["alibi_slopes"] = torch.tensor([2 ** -(h + 1) for h in range(n_heads)], device=DEVICE)
    if padding:
        kw["key_padding_mask"] = padding_mask(batch, seq)
    out = flash_attention(q, k, v, **kw)
    grad_out = torch.randn_like(out)
    (out * grad_out).sum().backward()

    ref_fused = fused.detach().double().requires_grad_()
    sizes = [n_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
    rq, rk, rv = (t.view(batch, seq, -1, head_dim) for t in ref_fused.split(sizes, -1))
    want, probs = reference(rq, rk, rv, **kw, probs_too=True)
    (want * grad_out.double()).sum().backward()
    assert out.dtype == dtype and out.shape == (batch, seq, n_heads, head_dim)
    return {"out": out, "grads": fused.grad.split(sizes, -1), "want": want,
            "want_grads": ref_fused.grad.split(sizes, -1), "q": rq.detach(), "k": rk.detach(),
            "v": rv.detach(), "dout": grad_out.double(), "probs": probs.detach(),
            "scale": softmax_scale or 1 / math.sqrt(head_dim)}


def check(batch, seq, n_heads, kv_heads, head_dim, dtype, **case):
    """Forward output and dq, dk, dv of the kernel against :func:`reference`."""
    r = run_both(batch, seq, n_heads, kv_heads, head_dim, dtype, **case)
    out, want = r["out"], r["want"]
    torch.testing.assert_close(out.double(), want, atol=TOL[dtype], rtol=TOL[dtype])
    for name, got, ref in zip("qkv", r["grads"], r["want_grads"]):
        atol = GRAD_TOL[dtype] * max(1.0, ref.abs().max().item())
        torch.testing.assert_close(
            got.double(), ref, atol=atol, rtol=GRAD_TOL[dtype], msg=lambda m, n=name: f"d{n}: {m}"
        )


# Every pair of (causal, grouped heads, packed, alibi, window, padding) values appears in
# some case; head dims 16/32/64 and a non-power-of-2 (40); fp32 and fp16.
CASES = {
    "causal": dict(causal=True),
    "full_gqa_packed": dict(causal=False, kv_heads=2, packed=True, head_dim=40),
    "causal_mqa_alibi_window": dict(
        kv_heads=1, alibi=True, window=5, head_dim=32, dtype=torch.float16
    ),
    "full_alibi_padding_scale": dict(
        causal=False, alibi=True, padding=True, head_dim=64, softmax_scale=0.3
    ),
    "all_features": dict(kv_heads=2, packed=True, alibi=True, window=6, padding=True, head_dim=40),
    "full_mqa_packed_window": dict(
        causal=False, kv_heads=1, packed=True, window=4, dtype=torch.float16
    ),
    "causal_packed_padding": dict(packed=True, padding=True, head_dim=64, dtype=torch.float16),
    "full_window_padding": dict(causal=False, window=9, padding=True, head_dim=32),
}


@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64_reference(case):
    kw = {"kv_heads": 4, "head_dim": 16, "dtype": torch.float32, **CASES[case]}
    check(batch=2, seq=48 * SCALE, n_heads=4, **kw)


@pytest.fixture
def atomic_backward(monkeypatch):
    """FlashAttention-2's one-kernel backward (dQ added atomically), whatever the table says;
    the split backward's dQ kernel is gone, so a test that ran it fails."""
    monkeypatch.setattr(fa, "flash_bwd_dq_kernel", None)
    with tuning.forced(bwd="atomic"):
        yield


@pytest.mark.parametrize("case", list(CASES))
def test_atomic_backward_matches_float64_reference(case, atomic_backward):
    test_matches_float64_reference(case)


def test_single_block_and_ragged_lengths():
    check(batch=1, seq=16, n_heads=2, kv_heads=1, head_dim=16, dtype=torch.float32, packed=True)
    check(batch=1, seq=37, n_heads=2, kv_heads=2, head_dim=24, dtype=torch.float16, window=3)


def test_atomic_backward_single_block_and_ragged_lengths(atomic_backward):
    test_single_block_and_ragged_lengths()
    whole = tuning.KernelConfig(64, 64)  # one key tile larger than the sequence
    with tuning.forced(bwd_atomic=whole):
        check(batch=1, seq=40, n_heads=4, kv_heads=2, head_dim=16, dtype=torch.float32,
              packed=True, window=5, alibi=True)  # fmt: skip


def test_backward_mode_is_the_tables_and_split_when_deterministic(monkeypatch, caplog):
    device = torch.device(DEVICE)
    for family, modes in tuning.BWD.items():
        assert len(modes) == len(tuning.BUCKETS) and set(modes) <= set(tuning.BWD_MODES), family
    # every family runs the split backward until a GPU has measured the atomic one
    assert {m for modes in tuning.BWD.values() for m in modes} == {"split"}
    assert tuning.bwd_mode(64, device) == "split"
    with tuning.forced(bwd="atomic"):
        assert tuning.bwd_mode(64, device) == "atomic"
        assert fa._bwd_mode(64, device) == "atomic"
        monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
        with caplog.at_level("INFO", logger=fa.__name__):
            assert fa._bwd_mode(64, device) == "split"
        assert "deterministic algorithms are on" in caplog.text
    assert tuning.bwd_mode(64, device) == "split"
    with pytest.raises(ValueError, match="unknown backward 'fused'"):
        with tuning.forced(bwd="fused"):
            pass


def test_tuning_table_and_forced_tiles():
    for family, kernels in tuning.TABLE.items():
        assert set(kernels) == set(tuning.KERNELS), family
        for cfg in (c for cfgs in kernels.values() for c in cfgs):
            assert all(b >= 16 and b & (b - 1) == 0 for b in (cfg.block_m, cfg.block_n)), family
    whole = tuning.KernelConfig(64, 64)  # one tile larger than the sequence
    with tuning.forced(fwd=whole, bwd_dkdv=whole, bwd_dq=whole):
        assert tuning.config("bwd_dq", 128, torch.device(DEVICE)) == whole
        check(
            batch=1,
            seq=40,
            n_heads=2,
            kv_heads=1,
            head_dim=16,
            dtype=torch.float32,
            packed=True,
            window=5,
        )
    assert tuning.config("fwd", 16, torch.device(DEVICE)) != whole


def test_cu_seqlens_matches_sequence_id():
    _, (q, k, v) = make_inputs(1, 40, 4, 2, 16, torch.float32, seed=3)
    sequence_id = packed_ids(1, 40)
    cu = torch.tensor([0, 8, 9, 23, 40], dtype=torch.int32, device=DEVICE)
    varlen = flash_attention(
        q[0], k[0], v[0], cu_seqlens=cu, alibi_slopes=torch.ones(4, device=DEVICE)
    )
    packed = flash_attention(
        q, k, v, sequence_id=sequence_id, alibi_slopes=torch.ones(4, device=DEVICE)
    )
    assert varlen.shape == q.shape[1:]
    torch.testing.assert_close(varlen, packed[0])
    torch.testing.assert_close(
        packed.double(),
        reference(q, k, v, sequence_id=sequence_id, alibi_slopes=torch.ones(4, device=DEVICE)),
        atol=1e-5,
        rtol=1e-5,
    )


def test_document_bounds():
    ids = torch.tensor([[0, 0, 1, 1, 1, 2], [5, 5, 5, 5, 5, 5], [0, 1, 0, 0, 7, 7]])
    start, end = fa.document_bounds(ids)
    assert start.tolist() == [[0, 0, 2, 2, 2, 5], [0] * 6, [0, 1, 2, 2, 4, 4]]
    assert end.tolist() == [[2, 2, 5, 5, 5, 6], [6] * 6, [1, 2, 4, 4, 6, 6]]


@pytest.mark.parametrize(
    "shape, dropout_p, message",
    [
        ((16, 2, 320), 0.0, "head_dim 320 is above 256"),
        ((20, 2, 16), 0.0, "query length 16 differs from key length 20"),
        ((16, 4, 16), 0.0, "n_heads 6 is not a multiple of kv_n_heads 4"),
        ((16, 2, 16), 0.1, "attention dropout is not implemented"),
    ],
)
def test_unsupported_inputs_say_why(shape, dropout_p, message):
    kv_seq, kv_heads, head_dim = shape
    q = torch.zeros(1, 16, 6, head_dim, device=DEVICE)
    k = torch.zeros(1, kv_seq, kv_heads, head_dim, device=DEVICE)
    assert message in fa.unsupported(q, k, k, dropout_p)
    if not dropout_p:  # the kernel itself takes no dropout argument
        with pytest.raises(ValueError, match=message):
            flash_attention(q, k, k)


@pytest.mark.skipif(GPU, reason="the interpreter's bf16 limit applies on CPU only")
def test_bf16_in_the_interpreter_is_refused_with_the_reason():
    q = torch.zeros(1, 16, 2, 16, dtype=torch.bfloat16)
    assert "bf16" in fa.unsupported(q, q, q)


@pytest.mark.skipif(not GPU, reason="bf16 at GPU sizes; on a CPU: test_bf16_on_a_cpu_...")
@pytest.mark.parametrize("case", ["causal", "all_features"])
def test_bf16_on_gpu(case):
    kw = {"kv_heads": 4, "head_dim": 64, **CASES[case], "dtype": torch.bfloat16}
    check(batch=2, seq=1024, n_heads=4, **kw)


# -- the bf16 path on a CPU ------------------------------------------------------------------
U_BF16 = 2.0**-8  # bf16's unit roundoff: 8 significant bits, rounded to nearest even


@pytest.fixture
def gpu_like_bf16(monkeypatch):
    """Triton's interpreter multiplies bf16 tiles as their raw bits and rounds float32 to bf16
    by truncation. A GPU multiplies bf16 exactly (a product of two fits float32) and adds in
    float32, and its conversions round to nearest even: both, here, in the interpreter, and
    the kernel's refusal of bf16 in the interpreter lifted (every other check kept)."""
    if GPU:
        pytest.skip("on a GPU the kernel runs bf16 itself (test_bf16_on_gpu)")
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    dot, trunc = builder.create_dot, builder.create_fp_trunc

    def is_bf16(h) -> bool:
        return getattr(h.dtype, "scalar", h.dtype) == tl.bfloat16

    def exact(h):  # bf16 bits -> the same values in float32
        if not is_bf16(h):
            return h
        return interpreter.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32),
                                        tl.float32)

    def nearest_even(src, dst_type):
        if not (getattr(dst_type, "scalar", dst_type) == tl.bfloat16
                and src.data.dtype == np.float32):
            return trunc(src, dst_type)
        bits = src.data.view(np.uint32).astype(np.uint64)
        top = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return interpreter.TensorHandle(top.astype(np.uint16), tl.bfloat16)

    monkeypatch.setattr(builder, "create_dot", lambda a, b, d, *rest: dot(exact(a), exact(b), d, *rest))
    monkeypatch.setattr(builder, "create_fp_trunc", nearest_even)
    real = fa.unsupported
    monkeypatch.setattr(fa, "unsupported", lambda q, k, v, dropout_p=0.0: real(
        *(t.half() for t in (q, k, v)), dropout_p))


def bf16_bounds(r: dict, kv_heads: int) -> dict[str, torch.Tensor]:
    """Elementwise bounds of the bf16 kernel's error against float64, from the roundings it
    makes (each at most ``u`` relative; its inputs are the reference's, its products exact,
    its sums float32): forward, P rounded before P V and the output stored, so ``|do| <= 2u
    (P|V|)``; backward, P rounded before P^T dO and dv stored (``2u P^T|dO|``), dS = P (dP -
    delta) rounded (``u|dS|``) with delta = rowsum(O dO) taken from the rounded output
    (``P E``, E = ``sum_d bound(O)|dO|``), then dq = scale dS K, dk = scale dS^T Q, each
    stored (``u|dq|``, ``u|dk|``); a grouped kv head sums its query heads."""
    u, p, q, do, scale = U_BF16, r["probs"], r["q"], r["dout"], r["scale"]
    group = q.shape[2] // kv_heads
    k, v = (r[n].repeat_interleave(group, 2) for n in ("k", "v"))
    b, s, h, d = q.shape

    def per_kv_head(t):  # (b, s, h, d) -> (b, s, kv_heads, d): a group's heads summed
        return t.view(b, s, kv_heads, group, d).sum(3)

    out = 2 * u * torch.einsum("bhij,bjhd->bihd", p, v.abs())
    delta = (r["want"].detach() * do).sum(-1).transpose(1, 2)  # (b, h, i)
    ds = p * (torch.einsum("bihd,bjhd->bhij", do, v) - delta[..., None])
    delta_err = (out * do.abs()).sum(-1).transpose(1, 2)
    ds_err = u * ds.abs() + p * delta_err[..., None]
    dq, dk, dv = (g.view(b, s, -1, d).abs() for g in r["want_grads"])
    return {
        "out": out,
        "q": scale * torch.einsum("bhij,bjhd->bihd", ds_err, k.abs()) + u * dq,
        "k": per_kv_head(scale * torch.einsum("bhij,bihd->bjhd", ds_err, q.abs())) + u * dk,
        "v": per_kv_head(2 * u * torch.einsum("bhij,bihd->bjhd", p, do.abs())),
    }


@pytest.mark.parametrize("case", ["causal", "all_features"])
def test_bf16_on_a_cpu_within_its_roundings(case, gpu_like_bf16):
    """The bf16 path, which only a GPU ran: the kernel's output and dq, dk, dv against the
    float64 reference, each element within the bound of :func:`bf16_bounds` (x 1.05, and
    float32's sums: 1e-5 of the largest value)."""
    kw = {"kv_heads": 2, "head_dim": 32, **CASES[case]}
    r = run_both(batch=2, seq=48, n_heads=4, dtype=torch.bfloat16, **kw)
    bounds = bf16_bounds(r, kw["kv_heads"])
    got = {"out": r["out"], **dict(zip("qkv", r["grads"]))}
    want = {"out": r["want"], **dict(zip("qkv", r["want_grads"]))}
    for name, bound in bounds.items():
        ref = want[name].detach().reshape(bound.shape)
        err = (got[name].double().reshape(bound.shape) - ref).abs()
        slack = 1.05 * bound + 1e-5 * ref.abs().max()
        worst = (err / slack).max().item()
        assert worst <= 1, f"{name}: error up to {worst:.2f} x its bound"
        assert err.max() > 0  # bf16 rounded something: the kernel ran in bf16


# The masks' features, each on or off: (name, off, on, ids). Every combination (128 with both
# backwards) runs under `make test-long`; make test runs a set covering every pair of settings
# of any two features (7 rows: a combination's bug that needs two features on at once shows).
FEATURES = (("bwd", *tuning.BWD_MODES[:2], ("split", "atomic")), ("causal", True, False, ("causal", "full")),
            ("kv_heads", 2, 1, ("mha", "mqa")), ("packed", False, True, ("", "packed")),
            ("alibi", False, True, ("", "alibi")), ("window", None, 7, ("", "window")),
            ("padding", False, True, ("", "padding")))


def pairwise(k: int) -> set[tuple[int, ...]]:
    """Rows of 0/1 over ``k`` features covering every pair of features in each of its four
    settings (greedy: the row covering most pairs not yet covered, first in product order)."""
    rows = list(itertools.product((0, 1), repeat=k))
    pairs = [(i, j) for i in range(k) for j in range(i + 1, k)]
    need = {(i, j, a, b) for i, j in pairs for a in (0, 1) for b in (0, 1)}
    chosen: set[tuple[int, ...]] = set()
    while need:
        row = max(rows, key=lambda r: sum((i, j, r[i], r[j]) in need for i, j in pairs))
        chosen.add(row)
        need -= {(i, j, row[i], row[j]) for i, j in pairs}
    return chosen


def combinations() -> list:
    covering = pairwise(len(FEATURES))
    out = []
    for row in itertools.product((0, 1), repeat=len(FEATURES)):
        values = [f[1 + bit] for f, bit in zip(FEATURES, row)]
        name = "-".join(f[3][bit] for f, bit in zip(FEATURES, row) if f[3][bit])
        marks = [pytest.mark.slow] + ([] if row in covering else [pytest.mark.long])
        out.append(pytest.param(*values, id=name, marks=marks))
    return out


def test_the_short_set_covers_every_pair_of_features():
    rows = pairwise(len(FEATURES))
    assert len(rows) <= 8
    for i, j in itertools.combinations(range(len(FEATURES)), 2):
        assert {(r[i], r[j]) for r in rows} == {(0, 0), (0, 1), (1, 0), (1, 1)}, (i, j)


@pytest.mark.parametrize(",".join(f[0] for f in FEATURES), combinations())
def test_every_combination(bwd, causal, kv_heads, packed, alibi, window, padding):
    # 2 heads: the interpreter's time grows with heads; the masks are what vary here
    with tuning.forced(bwd=bwd):  # both backwards: the split kernels and the atomic one
        check(
            batch=2,
            seq=40 * SCALE,
            n_heads=2,
            kv_heads=kv_heads,
            head_dim=32,
            dtype=torch.float32,
            causal=causal,
            packed=packed,
            alibi=alibi,
            window=window,
            padding=padding,
        )
