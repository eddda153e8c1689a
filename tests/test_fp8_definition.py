"""foundryx's eager FP8 row quantizers, bit for bit against the float64 definition written in
tests/fp8_reference.py (not foundryx's code): the activations' and gradients' quantizer
(``quantize_rows_eager``, ``fp8_gemm.quantize`` both ways, the operator on a CPU) and the
frozen weights' (``rowwise.quantize_rows``). A scale off by one part in 448, a rounding that
breaks ties away from zero or a lost sign of zero is a failure here. Needs no Triton."""

from __future__ import annotations

import pytest
import torch
from fp8_reference import E4M3, FNUZ, fmax, quantize_rows, round_codes, sample_rows

from foundryx.kernels.fp8_rows_op import quantize_rows_eager
from foundryx.models.peft import fp8_gemm
from foundryx.models.peft.rowwise import MIN_SCALE
from foundryx.models.peft.rowwise import quantize_rows as quantize_weight_rows

FORMATS = [E4M3] + ([FNUZ] if FNUZ is not None else [])


def same(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    (q, s), (want_q, want_s) = got, want
    assert q.dtype == want_q.dtype and s.dtype == torch.float32 and q.shape == want_q.shape
    assert torch.equal(s, want_s), (s - want_s).abs().max()
    bad = (q.view(torch.uint8) != want_q.view(torch.uint8)).nonzero().tolist()
    assert not bad, f"{len(bad)} of {q.numel()} codes differ, first at {bad[:3]}: " \
                    f"{q[tuple(bad[0])].item()} != {want_q[tuple(bad[0])].item()}"


def test_the_reference_knows_e4m3():
    """The yardstick itself, against facts of the formats (OCP FP8; torch's own values)."""
    assert fmax(E4M3) == 448 == torch.finfo(E4M3).max
    ties = torch.tensor([136.0, -136.0, 19.0, 2.0**-9 * 1.5, -(2.0**-11), 447.9, -0.0],
                        dtype=torch.float64)
    want = torch.tensor([128.0, -128.0, 20.0, 2.0**-8, -0.0, 448.0, -0.0])
    got = round_codes(ties, E4M3).view(E4M3).float()
    assert torch.equal(got, want) and torch.equal(got.signbit(), want.signbit())
    # every code's value is torch's value of that byte
    codes = torch.arange(127, dtype=torch.uint8)
    assert torch.equal(round_codes(codes.view(E4M3).double(), E4M3), codes)
    if FNUZ is not None:
        assert fmax(FNUZ) == 240 == torch.finfo(FNUZ).max
        assert torch.equal(round_codes(codes.view(FNUZ).double(), FNUZ), codes)
        assert round_codes(torch.tensor([-1e-30], dtype=torch.float64), FNUZ).item() == 0


@pytest.mark.parametrize("dtype", FORMATS, ids=str)
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("col", [False, True], ids=["x", "x*col"])
def test_the_activation_quantizer_is_the_definition(dtype, x_dtype, col):
    x = sample_rows().to(x_dtype)
    col_scale = torch.rand(x.shape[1], generator=torch.Generator().manual_seed(1)) + 0.5 \
        if col else None
    want = quantize_rows(x, dtype, col_scale, MIN_SCALE)
    same(quantize_rows_eager(x, dtype, col_scale, MIN_SCALE), want)
    same(fp8_gemm.quantize(x, dtype, col_scale), want)
    same(fp8_gemm.quantize(x, dtype, col_scale, op=True), want)  # the operator's CPU form
    same(torch.ops.foundryx.fp8_quantize_rows(x, col_scale, dtype, MIN_SCALE), want)


def test_a_zero_row_keeps_the_smallest_scale_and_stays_zero():
    q, s = quantize_rows_eager(torch.zeros(2, 32), E4M3, None, MIN_SCALE)
    assert torch.equal(s, torch.full((2,), MIN_SCALE, dtype=torch.float32))
    assert not q.view(torch.uint8).any()


def test_the_frozen_weights_quantizer_is_the_definition():
    w = sample_rows(k=64, seed=2)
    same(quantize_weight_rows(w, "fp8"), quantize_rows(w, E4M3, None, MIN_SCALE))
