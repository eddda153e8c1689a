"""``torch.ops.foundryx.rms_norm`` and ``rms_norm_backward``: an RMS norm as one operator each
way, with autograd.

Custom operators (``torch.library.custom_op``) so that what looks at a step op by op sees one
op where a GPU runs one kernel: FakeTensorMode and torch's memory tracker (the fake
implementations), benchmarks/op_census.py, activation checkpointing (which recomputes the
forward op) and ``torch.compile`` (which keeps them whole). On a GPU (CUDA or ROCm) they run
:mod:`foundryx.kernels.rms_norm`'s Triton kernels; on any other device :func:`rms_norm_eager`
and :func:`rms_norm_backward_eager`, the torch ops of Hugging Face's LlamaRMSNorm (float32
math) whose results the kernels reproduce to float32 rounding (tests/test_fused_ops.py).

:func:`rms_norm` is the entry: ``y`` for ``x`` and the weight, differentiable in both; backward
keeps ``x``, the weight and the float32 ``rstd`` (one a row), never a float32 copy of ``x``.
"""

from __future__ import annotations

import torch


def rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor,
                                                                               torch.Tensor]:
    """``(y, rstd)``: LlamaRMSNorm's forward (``x`` upcast to float32, normalized, cast back,
    times the weight) and the float32 reciprocal RMS of each row."""
    h = x.to(torch.float32)
    rstd = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (h * rstd).to(x.dtype), rstd.squeeze(-1)


def rms_norm_backward_eager(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                            rstd: torch.Tensor, want_dx: bool,
                            want_dw: bool) -> list[torch.Tensor]:
    """``[dx]``, ``[dweight]`` or both (what is wanted, in that order) of
    :func:`rms_norm_eager`, in float32 math."""
    r = rstd.unsqueeze(-1)
    normed = x.to(torch.float32) * r
    g = dy.to(torch.float32)
    out = []
    if want_dx:  # d(normed)/dx = rstd (I - normed normedᵀ / N), applied to dy * w
        gw = g * weight.to(torch.float32)
        dot = (gw * normed).mean(-1, keepdim=True)
        out.append(((gw - normed * dot) * r).to(x.dtype))
    if want_dw:  # y = w * normed.to(x.dtype)
        prod = g * normed.to(x.dtype).to(torch.float32)
        out.append(prod.reshape(-1, x.shape[-1]).sum(0).to(weight.dtype))
    return out


def _out_dtype(x: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    return torch.promote_types(x.dtype, weight.dtype)


@torch.library.custom_op("foundryx::rms_norm", mutates_args=())
def rms_norm_op(x: torch.Tensor, weight: torch.Tensor, eps: float) -> tuple[torch.Tensor,
                                                                            torch.Tensor]:
    """:func:`rms_norm_eager` on a device without the kernel."""
    y, rstd = rms_norm_eager(x, weight, eps)
    return y.contiguous(), rstd.contiguous()


@rms_norm_op.register_kernel("cuda")
def _forward_on_a_gpu(x: torch.Tensor, weight: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    from foundryx.kernels import rms_norm  # Triton (heavy): imported on a GPU's first call only

    return rms_norm.forward(x, weight, eps)


@rms_norm_op.register_fake
def _fake_forward(x: torch.Tensor, weight: torch.Tensor,
                  eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty(x.shape, dtype=_out_dtype(x, weight), device=x.device),
            torch.empty(x.shape[:-1], dtype=torch.float32, device=x.device))


@torch.library.custom_op("foundryx::rms_norm_backward", mutates_args=())
def rms_norm_backward_op(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                         rstd: torch.Tensor, want_dx: bool, want_dw: bool) -> list[torch.Tensor]:
    """:func:`rms_norm_backward_eager` on a device without the kernel."""
    return rms_norm_backward_eager(dy, x, weight, rstd, want_dx, want_dw)


@rms_norm_backward_op.register_kernel("cuda")
def _backward_on_a_gpu(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                       rstd: torch.Tensor, want_dx: bool, want_dw: bool) -> list[torch.Tensor]:
    from foundryx.kernels import rms_norm  # Triton: see _forward_on_a_gpu

    dx, dw = rms_norm.backward(dy, x, weight, rstd, want_dx, want_dw)
    return [t for t in (dx, dw) if t is not None]


@rms_norm_backward_op.register_fake
def _fake_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor,
                   want_dx: bool, want_dw: bool) -> list[torch.Tensor]:
    return ([torch.empty(x.shape, dtype=x.dtype, device=x.device)] if want_dx else []) + (
        [torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)] if want_dw else [])


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
    x, weight, _ = inputs
    ctx.save_for_backward(x, weight, output[1])
    ctx.set_materialize_grads(False)  # rstd's gradient stays None (no kernel for its zeros)


def _backward(ctx, dy: torch.Tensor, _drstd: torch.Tensor | None):  # noqa: ANN001, ANN202
    x, weight, rstd = ctx.saved_tensors
    want_dx, want_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    if dy is None or not (want_dx or want_dw):
        return None, None, None
    got = iter(rms_norm_backward_op(dy.contiguous(), x, weight, rstd, want_dx, want_dw))
    return (next(got) if want_dx else None), (next(got) if want_dw else None), None


rms_norm_op.register_autograd(_backward, setup_context=_setup_context)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm's ``weight * (x_f32 * rsqrt(mean(x_f32²) + eps)).to(x.dtype)`` as one
    operator each way (see the module doc)."""
    return rms_norm_op(x, weight, float(eps))[0]
