"""The per-row FP8 quantization kernel (foundryx.kernels.fp8_rows) and its operator
(``torch.ops.foundryx.fp8_quantize_rows``): the torch ops' bits exactly, the definition against
float64, NaN rows, the operator's fake and CPU forms, and which one a frozen FP8 layer runs.

Without a GPU the kernel runs in Triton's interpreter (tests/conftest.py sets
TRITON_INTERPRET=1); with one, on the GPU (the run book runs this file there)."""

from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("triton")

import fp8_reference  # noqa: E402

from foundryx.kernels import fp8_rows  # noqa: E402
from foundryx.kernels.fp8_rows_op import quantize_rows_eager  # noqa: E402
from foundryx.models.peft import fp8_gemm  # noqa: E402
from foundryx.models.peft.frozen_base import LowPrecisionLinear  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
E4M3 = torch.float8_e4m3fn
FNUZ = getattr(torch, "float8_e4m3fnuz", None)


def _interpreter_has(dtype: torch.dtype) -> bool:
    try:
        fp8_rows.quantize_rows(torch.ones(1, 16, device=DEVICE), dtype)
    except Exception as e:  # noqa: BLE001  (triton 3.3's interpreter: "fail to convert fp8e4b8")
        return "fail to convert" not in str(e)
    return True


FORMATS = [E4M3] + ([pytest.param(FNUZ, marks=pytest.mark.skipif(
    not _interpreter_has(FNUZ), reason="this Triton's interpreter has no e4m3fnuz "
    "(Triton 3.3, torch 2.7; 3.9 has it: the modern leg)"))] if FNUZ is not None else [])


def rows(dtype: torch.dtype, k: int) -> torch.Tensor:
    """Rows of every magnitude (1e-8 to 1e4), a zero row, and a row whose scale is exactly 1
    holding ties of e4m3's steps (136 between 128 and 144, 336), its smallest subnormals, a
    half-step tie that rounds to -0, an underflow and -0."""
    torch.manual_seed(0)
    x = torch.randn(37, k) * torch.logspace(-8, 4, 37)[:, None]
    x[3] = 0
    fmax = torch.finfo(dtype).max
    x[4] = torch.rand(k) * 100
    edge = [fmax, 136, 336, -136, 2.0**-9, 3 * 2.0**-10, -(2.0**-10), 1e-30, -0.0]
    x[4, :len(edge)] = torch.tensor(edge)
    return x.to(DEVICE)


@pytest.mark.parametrize("dtype", FORMATS)
@pytest.mark.parametrize("k", [300, 4100])  # one block; a row longer than the 4096 block
@pytest.mark.parametrize("x_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("col", [False, True], ids=["x", "x*col"])
def test_the_kernel_gives_the_torch_ops_bits(dtype, k, x_dtype, col):
    x = rows(dtype, k).to(x_dtype)
    col_scale = (torch.rand(k) + 0.5).to(DEVICE) if col else None
    q, s = fp8_rows.quantize_rows(x, dtype, col_scale)
    want_q, want_s = quantize_rows_eager(x, dtype, col_scale)
    assert q.dtype == dtype and s.dtype == torch.float32 and q.shape == x.shape
    assert torch.equal(s, want_s)
    differ = (q.view(torch.uint8) != want_q.view(torch.uint8)).sum().item()
    assert differ == 0, f"{differ} of {q.numel()} bytes differ"


@pytest.mark.parametrize("dtype", FORMATS)
def test_the_kernel_against_the_definition_in_float64(dtype):
    """Per row ``scale = max|x'| / fmax`` and ``q * scale`` within e4m3's rounding of ``x'``
    (2^-4 relative for a normal value, half the smallest step for a subnormal one); each
    row's largest ``|q|`` is fmax, a zero row stays zero."""
    x, col_scale = rows(dtype, 300), (torch.rand(300) + 0.5).to(DEVICE)
    q, s = fp8_rows.quantize_rows(x, dtype, col_scale)
    want = x.double() * col_scale.double()
    fmax = torch.finfo(dtype).max
    amax = want.abs().amax(1)
    nonzero = amax > 0
    assert torch.allclose(s.double()[nonzero], amax[nonzero] / fmax, rtol=2.0**-22, atol=0)
    back = q.double() * s.double()[:, None]
    step = 2.0 ** (-9 if dtype == E4M3 else -10) * s.double()[:, None]
    assert ((back - want).abs() <= torch.maximum(want.abs() / 16, step / 2) * (1 + 1e-6)).all()
    assert q.double().abs().amax(1)[nonzero].eq(fmax).all()
    assert torch.equal(back[3], torch.zeros_like(back[3]))


def test_a_row_with_a_nan_gets_a_nan_scale_and_the_others_do_not():
    x = torch.randn(4, 40, device=DEVICE)
    x[1, 5] = float("nan")
    _, s = fp8_rows.quantize_rows(x, E4M3)
    _, want = quantize_rows_eager(x, E4M3)
    assert s[1].isnan() and want[1].isnan()
    assert torch.equal(s[[0, 2, 3]], want[[0, 2, 3]])


def test_bad_operands_are_refused_in_one_message():
    with pytest.raises(TypeError, match="not an e4m3 format"):
        fp8_rows.quantize_rows(torch.ones(2, 16), torch.bfloat16)
    with pytest.raises(ValueError, match="contiguous rows"):
        fp8_rows.quantize_rows(torch.ones(16, 2).t(), E4M3)


def test_the_operator_is_the_definition_on_a_cpu_and_one_op_on_fake_gpu_tensors():
    from torch._subclasses.fake_tensor import FakeTensorMode

    x, col = torch.randn(6, 32), torch.rand(32) + 0.5
    q, s = torch.ops.foundryx.fp8_quantize_rows(x, col, E4M3, 1e-12)
    want_q, want_s = fp8_reference.quantize_rows(x, E4M3, col)  # float64, not foundryx's code
    assert torch.equal(q.view(torch.uint8), want_q.view(torch.uint8)) and torch.equal(s, want_s)
    with FakeTensorMode():  # what the memory estimate and the op census trace
        fx = torch.empty(8192, 4096, dtype=torch.bfloat16, device="cuda")
        q, s = torch.ops.foundryx.fp8_quantize_rows(fx, None, E4M3, 1e-12)
        assert (q.shape, q.dtype, q.device.type) == ((8192, 4096), E4M3, "cuda")
        assert (s.shape, s.dtype) == ((8192,), torch.float32)


def test_a_layer_runs_the_operator_where_choose_said_so(monkeypatch, caplog):
    """``choose`` decides once per run: on a GPU with Triton the operator (one kernel), said
    in its line; on a CPU the torch ops, said too; ``fp8_rows: kernel`` forces the operator
    (the census), called with the layer's operands: with the float64 definition in the
    operator's place (tests/fp8_reference.py), the forced layer's outputs and input gradient
    are the torch ops' bits."""
    caplog.set_level(logging.INFO, logger=fp8_gemm.__name__)
    torch.manual_seed(0)
    layer = LowPrecisionLinear(torch.nn.Linear(64, 32, bias=False), "fp8", "l")
    monkeypatch.setattr(fp8_gemm, "device_fp8_gemm",
                        lambda d: ("float8_e4m3fn", "NVIDIA H100 80GB HBM3 (sm90)"))
    monkeypatch.setattr(fp8_gemm, "probe", lambda device, dtype: None)
    monkeypatch.setattr(fp8_gemm, "kernel_check", lambda device, dtype: None)
    fp8_gemm.choose(torch.device("cuda", 0), [layer])
    assert layer.fp8_quantize_op
    assert caplog.records[-1].getMessage().endswith(
        "; rows quantized in one pass by foundryx's Triton kernel")
    fp8_gemm.choose(torch.device("cuda", 0), [layer], rows="torch")
    assert not layer.fp8_quantize_op and caplog.records[-1].getMessage().endswith(
        "; rows quantized by torch ops (frozen_base.fp8_rows: torch)")

    fp8_gemm.choose(torch.device("cpu"), [layer], gemm="tensor_cores")
    assert not layer.fp8_quantize_op
    assert "rows quantized by torch ops (no Triton kernel on a cpu)" in caplog.text
    calls = []

    def counted(x, col_scale, dtype, min_scale):
        calls.append(x.shape)
        return fp8_reference.quantize_rows(x, dtype, col_scale, min_scale)

    results = {}
    x0, dy = torch.randn(2, 5, 64), torch.randn(2, 5, 32)
    monkeypatch.setattr(torch.ops.foundryx, "fp8_quantize_rows", counted)
    for mode in ("auto", "kernel"):
        fp8_gemm.choose(torch.device("cpu"), [layer], gemm="tensor_cores", rows=mode)
        x = x0.clone().requires_grad_()
        y = layer(x)
        y.backward(dy)
        results[mode] = (y.detach(), x.grad)
    assert caplog.records[-1].getMessage().endswith(
        "rows quantized by torch.ops.foundryx.fp8_quantize_rows (frozen_base.fp8_rows: kernel; "
        "its torch ops on a cpu)")
    assert calls == [(10, 64), (10, 32)]  # forward's x, backward's dy: with "kernel" only
    assert torch.equal(results["auto"][0], results["kernel"][0])
    assert torch.equal(results["auto"][1], results["kernel"][1])


def test_a_kernel_that_fails_its_check_leaves_the_torch_ops_and_says_why(monkeypatch, caplog):
    """``choose`` tries the kernel once per device on a small sample against the torch ops:
    an error or a differing bit keeps the torch ops, in the same one line."""
    caplog.set_level(logging.INFO, logger=fp8_gemm.__name__)
    check = fp8_gemm.kernel_check.__wrapped__
    assert check("cpu", E4M3) is None  # the operator's CPU form: the torch ops themselves
    real = torch.ops.foundryx.fp8_quantize_rows

    def off_by_one(*args):
        q, s = real(*args)
        return (q.view(torch.uint8) ^ 1).view(q.dtype), s

    def broken(*args):
        raise RuntimeError("PassManager::run failed\nmore")

    monkeypatch.setattr(torch.ops.foundryx, "fp8_quantize_rows", off_by_one)
    assert check("cpu", E4M3) == "the Triton kernel's bits differ from the torch ops' on cpu"
    monkeypatch.setattr(torch.ops.foundryx, "fp8_quantize_rows", broken)
    assert check("cpu", E4M3) == ("the Triton kernel failed on cpu: RuntimeError: "
                                  "PassManager::run failed")

    layer = LowPrecisionLinear(torch.nn.Linear(64, 32, bias=False), "fp8", "l")
    monkeypatch.setattr(fp8_gemm, "device_fp8_gemm",
                        lambda d: ("float8_e4m3fn", "NVIDIA H100 80GB HBM3 (sm90)"))
    monkeypatch.setattr(fp8_gemm, "probe", lambda device, dtype: None)
    monkeypatch.setattr(fp8_gemm, "kernel_check", lambda device, dtype: check("cpu", dtype))
    fp8_gemm.choose(torch.device("cuda", 0), [layer])
    assert layer.fp8_gemm == E4M3 and not layer.fp8_quantize_op
    [line] = [r.getMessage() for r in caplog.records]
    assert line.endswith("; rows quantized by torch ops (the Triton kernel failed on cpu: "
                         "RuntimeError: PassManager::run failed)")
