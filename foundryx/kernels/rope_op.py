"""``torch.ops.foundryx.rope`` and ``rope_backward``: RoPE of the queries and keys as one
operator each way, with autograd.

Custom operators, as :mod:`foundryx.kernels.rms_norm_op` (whose module doc says why): on a GPU
(CUDA or ROCm) :mod:`foundryx.kernels.rope`'s Triton kernel, on any other device
:func:`rope_eager` (Hugging Face's ``apply_rotary_pos_emb`` in float32) and its transpose.
The outputs keep the inputs' strides (``[b, h, s, d]`` views of ``[b, s, h, d]`` memory, as the
model's attention makes them). Backward keeps only ``cos`` and ``sin``.
"""

from __future__ import annotations

import torch


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _half_swap(x: torch.Tensor) -> torch.Tensor:  # the transpose of rotate_half
    half = x.shape[-1] // 2
    return torch.cat((x[..., half:], -x[..., :half]), dim=-1)


def _like(src: torch.Tensor, value: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    out = torch.empty_like(src, dtype=dtype)
    return out.copy_(value)


def rope_eager(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
               sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x * cos + rotate_half(x) * sin`` for q and k (``cos``, ``sin``: ``[b or 1, s, d]``,
    unsqueezed over the heads) in float32, rounded once; the outputs in the inputs' strides."""
    c, s = cos.unsqueeze(1).float(), sin.unsqueeze(1).float()
    out = []
    for x in (q, k):
        xf = x.float()
        out.append(_like(x, xf * c + _rotate_half(xf) * s, torch.promote_types(x.dtype,
                                                                                cos.dtype)))
    return out[0], out[1]


def rope_backward_eager(dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor,
                        sin: torch.Tensor) -> list[torch.Tensor]:
    """``[dq_in, dk_in]`` from the outputs' gradients (the transposed rotation), float32."""
    c, s = cos.unsqueeze(1).float(), sin.unsqueeze(1).float()
    return [_like(g, g.float() * c + _half_swap(g.float() * s), g.dtype) for g in (dq, dk)]


@torch.library.custom_op("foundryx::rope", mutates_args=())
def rope_op(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
            sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`rope_eager` on a device without the kernel."""
    return rope_eager(q, k, cos, sin)


@rope_op.register_kernel("cuda")
def _forward_on_a_gpu(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                      sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from foundryx.kernels import rope  # Triton (heavy): imported on a GPU's first call only

    return rope.rotate(q, k, cos, sin)


@rope_op.register_fake
def _fake_forward(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return (torch.empty_like(q, dtype=torch.promote_types(q.dtype, cos.dtype)),
            torch.empty_like(k, dtype=torch.promote_types(k.dtype, cos.dtype)))


@torch.library.custom_op("foundryx::rope_backward", mutates_args=())
def rope_backward_op(dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor,
                     sin: torch.Tensor) -> list[torch.Tensor]:
    """:func:`rope_backward_eager` on a device without the kernel."""
    return rope_backward_eager(dq, dk, cos, sin)


@rope_backward_op.register_kernel("cuda")
def _backward_on_a_gpu(dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor,
                       sin: torch.Tensor) -> list[torch.Tensor]:
    from foundryx.kernels import rope  # Triton: see _forward_on_a_gpu

    return list(rope.rotate(dq, dk, cos, sin, backward=True))


@rope_backward_op.register_fake
def _fake_backward(dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor,
                   sin: torch.Tensor) -> list[torch.Tensor]:
    return [torch.empty_like(dq), torch.empty_like(dk)]


def _setup_context(ctx, inputs, output) -> None:  # noqa: ANN001
    q, k, cos, sin = inputs
    ctx.save_for_backward(cos, sin)
    ctx.dtypes = (q.dtype, k.dtype)


def _backward(ctx, dq: torch.Tensor, dk: torch.Tensor):  # noqa: ANN001, ANN202
    cos, sin = ctx.saved_tensors
    dq_in, dk_in = rope_backward_op(dq, dk, cos, sin)
    return dq_in.to(ctx.dtypes[0]), dk_in.to(ctx.dtypes[1]), None, None


rope_op.register_autograd(_backward, setup_context=_setup_context)


def rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor,
         sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Hugging Face Llama's ``apply_rotary_pos_emb(q, k, cos, sin)`` as one operator each way
    (see the module doc)."""
    return rope_op(q, k, cos, sin)
