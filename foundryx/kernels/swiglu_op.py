"""``torch.ops.foundryx.swiglu`` and ``swiglu_backward``: SwiGLU's ``silu(gate) * up`` as one
operator each way, with autograd.

Custom operators, as :mod:`foundryx.kernels.rms_norm_op` (whose module doc says why): on a GPU
(CUDA or ROCm) :mod:`foundryx.kernels.swiglu`'s Triton kernels, on any other device
:func:`swiglu_eager` and :func:`swiglu_backward_eager` (float32 math). Backward keeps ``gate``
and ``up`` only and recomputes ``silu(gate)``.
"""

from __future__ import annotations

import torch


def swiglu_eager(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in float32, rounded once to the inputs' dtype."""
    g = gate.to(torch.float32)
    return (torch.nn.functional.silu(g) * up.to(torch.float32)).to(
        torch.promote_types(gate.dtype, up.dtype))


def swiglu_backward_eager(dy: torch.Tensor, gate: torch.Tensor,
                          up: torch.Tensor) -> list[torch.Tensor]:
    """``[dgate, dup]`` of :func:`swiglu_eager`, in float32 math."""
    g, u, d = gate.to(torch.float32), up.to(torch.float32), dy.to(torch.float32)
    s = torch.sigmoid(g)
    return [(d * u * s * (1 + g * (1 - s))).to(gate.dtype), (d * g * s).to(up.dtype)]


@torch.library.custom_op("foundryx::swiglu", mutates_args=())
def swiglu_op(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """:func:`swiglu_eager` on a device without the kernel."""
    return swiglu_eager(gate, up)


@swiglu_op.register_kernel("cuda")
def _forward_on_a_gpu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    from foundryx.kernels import swiglu  # Triton (heavy): imported on a GPU's first call only

    return swiglu.forward(gate, up)


@swiglu_op.register_fake
def _fake_forward(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.empty(gate.shape, dtype=torch.promote_types(gate.dtype, up.dtype),
                       device=gate.device)


@torch.library.custom_op("foundryx::swiglu_backward", mutates_args=())
def swiglu_backward_op(dy: torch.Tensor, gate: torch.Tensor,
                       up: torch.Tensor) -> list[torch.Tensor]:
    """:func:`swiglu_backward_eager` on a device without the kernel."""
    return swiglu_backward_eager(dy, gate, up)


@swiglu_backward_op.register_kernel("cuda")
def _backward_on_a_gpu(dy: torch.Tensor, gate: torch.Tensor,
                       up: torch.Tensor) -> list[torch.Tensor]:
    from foundryx.kernels import swiglu  # Triton: see _forward_on_a_gpu

    return list(swiglu.backward(dy, gate, up))


@swiglu_backward_op.register_fake
def _fake_backward(dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> list[torch.Tensor]:
    return [torch.empty(gate.shape, dtype=gate.dtype, device=gate.device),
            torch.empty(up.shape, dtype=up.dtype, device=up.device)]


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
    ctx.save_for_backward(*inputs)


def _backward(ctx, dy: torch.Tensor):  # noqa: ANN001, ANN202
    gate, up = ctx.saved_tensors
    dg, du = swiglu_backward_op(dy.contiguous(), gate, up)
    return (dg if ctx.needs_input_grad[0] else None), (du if ctx.needs_input_grad[1] else None)


swiglu_op.register_autograd(_backward, setup_context=_setup_context)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` as one operator each way (see the module doc)."""
    return swiglu_op(gate, up)
