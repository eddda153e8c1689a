"""The first call of a fused operator's kernel on a device, checked against its torch reference
before a model is given the operator (``fused_ops``: foundryx.parallel.fused_ops).

A small input in bfloat16, forward and backward, on the device: any exception (Triton missing,
a compiler or launch failure) or a result further from the reference than bfloat16 rounding
allows is the reason given, in one line, for keeping the unfused path.
"""

from __future__ import annotations

import functools

import torch

from foundryx.kernels import nf4_dequant_op, rms_norm_op, rope_op, swiglu_op


def _far(got: torch.Tensor, want: torch.Tensor, what: str) -> str | None:
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item() or 1.0
    return None if err <= 2 ** -6 * scale else f"{what} off by {err:.3g} (of {scale:.3g})"


def _rms_norm(device: torch.device) -> str | None:
    gen = torch.Generator(device="cpu").manual_seed(0)
    x = torch.randn(5, 300, generator=gen).to(device, torch.bfloat16)
    w = torch.randn(300, generator=gen).to(device, torch.bfloat16)
    dy = torch.randn(5, 300, generator=gen).to(device, torch.bfloat16)
    y, rstd = torch.ops.foundryx.rms_norm(x, w, 1e-6)
    dx, dw = torch.ops.foundryx.rms_norm_backward(dy, x, w, rstd, True, True)
    ry, rr = rms_norm_op.rms_norm_eager(x, w, 1e-6)
    rdx, rdw = rms_norm_op.rms_norm_backward_eager(dy, x, w, rr, True, True)
    return (_far(y, ry, "y") or _far(rstd, rr, "rstd") or _far(dx, rdx, "dx")
            or _far(dw, rdw, "dweight"))


def _swiglu(device: torch.device) -> str | None:
    gen = torch.Generator(device="cpu").manual_seed(0)
    g, u, dy = (torch.randn(5, 700, generator=gen).to(device, torch.bfloat16) for _ in range(3))
    y = torch.ops.foundryx.swiglu(g, u)
    dg, du = torch.ops.foundryx.swiglu_backward(dy, g, u)
    rdg, rdu = swiglu_op.swiglu_backward_eager(dy, g, u)
    return (_far(y, swiglu_op.swiglu_eager(g, u), "y") or _far(dg, rdg, "dgate")
            or _far(du, rdu, "dup"))


def _rope(device: torch.device) -> str | None:
    gen = torch.Generator(device="cpu").manual_seed(0)
    q, dq = (torch.randn(2, 5, 4, 64, generator=gen).to(device, torch.bfloat16).transpose(1, 2)
             for _ in range(2))
    k, dk = (torch.randn(2, 5, 2, 64, generator=gen).to(device, torch.bfloat16).transpose(1, 2)
             for _ in range(2))
    cos, sin = (torch.randn(1, 5, 64, generator=gen).to(device, torch.bfloat16) for _ in range(2))
    qo, ko = torch.ops.foundryx.rope(q, k, cos, sin)
    rq, rk = rope_op.rope_eager(q, k, cos, sin)
    gq, gk = torch.ops.foundryx.rope_backward(dq, dk, cos, sin)
    rgq, rgk = rope_op.rope_backward_eager(dq, dk, cos, sin)
    return (_far(qo, rq, "q") or _far(ko, rk, "k") or _far(gq, rgq, "dq")
            or _far(gk, rgk, "dk"))


def _nf4_dequantize(device: torch.device) -> str | None:
    """NF4 parts made up as torchao lays them out (70 blocks of 64, scaler groups of 7; the
    NF4 dtype bfloat16, then float32), decoded into bfloat16: the torch ops' bits exactly."""
    gen = torch.Generator(device="cpu").manual_seed(0)
    for nf4_dtype in (torch.bfloat16, torch.float32):
        data = torch.randint(0, 256, (70 * 32,), dtype=torch.uint8, generator=gen)
        scalers = torch.randint(-128, 128, (70,), dtype=torch.int8, generator=gen)
        factors = (torch.rand(10, generator=gen) * 100 + 1).to(nf4_dtype)
        mean = torch.tensor(0.03, dtype=nf4_dtype)
        levels = torch.linspace(-1, 1, 16).to(nf4_dtype)
        args = [t.to(device) for t in (data, scalers, factors, mean, levels)] + [64, 7]
        got = torch.ops.foundryx.nf4_dequantize(*args, torch.bfloat16, 0)
        want = nf4_dequant_op.nf4_dequantize_eager(*args, torch.bfloat16)
        differ = (got.view(torch.int16) != want.view(torch.int16)).sum().item()
        if differ:
            return f"{differ} of {want.numel()} values differ from the torch ops ({nf4_dtype})"
    return None


CHECKS = {"rms_norm": _rms_norm, "swiglu": _swiglu, "rope": _rope,
          "nf4_dequantize": _nf4_dequantize}


@functools.cache
def first_call_problem(key: str, device: torch.device) -> str | None:
    """Why the ``key`` operator's kernel cannot serve on ``device`` (see the module doc), or
    None; once a process and device."""
    try:
        return CHECKS[key](device)
    except Exception as e:  # noqa: BLE001  (whatever stops the kernel is the reason said)
        text = str(e).strip().splitlines()
        return f"{type(e).__name__}: {text[0][:200] if text else ''}"
