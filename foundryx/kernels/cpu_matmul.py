"""fp32 matrix products on the CPU through oneDNN instead of torch's BLAS.

On CPUs where the BLAS torch links (Intel's MKL) does not take its fastest path, oneDNN's fp32
GEMM is much faster with the same fp32 arithmetic: 260-480 GFLOP/s against MKL's 180-210 on
the 2-core AMD EPYC (AVX-512) benchmark VM for the products of a small MPT's training step
(benchmarks/cpu_matmul.py), with errors of fp32 rounding against a float64 product. torch
reaches oneDNN for fp32 only through ``torch.ops.mkldnn._linear_pointwise``, the op Inductor emits for frozen
inference graphs; :func:`mm` wraps it as a custom op (``foundryx::onednn_mm``) with its own
gradient, so eager autograd and ``torch.compile`` (as an opaque call) both work.

Nothing here is on unless :func:`set_backend` turns it on: :func:`mm` is ``torch.mm`` by
default. Training on a CPU sets the backend at start (``cpu_matmul`` in the run config, see
``foundryx.parallel.parallelize.resolve_cpu_matmul``).
"""

from __future__ import annotations

import platform

import torch

BACKENDS = ("onednn", "blas")
_state = {"backend": "blas"}


def onednn_available() -> bool:
    """This torch has oneDNN and the dense fp32 linear op that reaches it."""
    return (torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


def resolve(choice: str) -> tuple[str, str | None]:
    """The backend ``choice`` (auto, onednn, blas) means on this machine, and for ``auto`` that
    stays on BLAS, why: ``auto`` is oneDNN on x86-64 where this torch has it (measured there;
    other architectures are not)."""
    if choice != "auto":
        return choice, None
    arch = platform.machine().lower()
    if not onednn_available():
        return "blas", "this torch has no oneDNN"
    if arch not in ("x86_64", "amd64"):
        return "blas", f"not measured on {arch}"
    return "onednn", None


def set_backend(backend: str) -> None:
    """``onednn``: :func:`mm` on fp32 CPU tensors goes through oneDNN; ``blas``: ``torch.mm``."""
    if backend not in BACKENDS:
        raise ValueError(f"cpu matmul backend {backend!r}: one of {', '.join(BACKENDS)}")
    if backend == "onednn" and not onednn_available():
        raise RuntimeError("this torch has no oneDNN (torch.backends.mkldnn is unavailable)")
    _state["backend"] = backend


def backend() -> str:
    return _state["backend"]


def _onednn_ok(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.device.type == "cpu" and a.dtype == torch.float32 and b.dtype == torch.float32
            and type(a) in (torch.Tensor, torch.nn.Parameter)
            and type(b) in (torch.Tensor, torch.nn.Parameter) and a.numel() > 0 and b.numel() > 0)


def mm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` for 2-D ``a`` and ``b``: oneDNN when that backend is set and both are fp32 CPU
    tensors, else ``torch.mm``. Differentiable either way (without ``out``). With ``out`` the
    product is written there (oneDNN: computed, then copied) and ``out`` is returned."""
    if uses_onednn(a, b):
        return onednn_mm(a, b) if out is None else out.copy_(onednn_mm(a, b))
    return torch.mm(a, b, out=out)


def uses_onednn(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether :func:`mm` of these operands goes through oneDNN."""
    return _state["backend"] == "onednn" and _onednn_ok(a, b)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, its product through oneDNN when :func:`uses_onednn` says
    so; otherwise ``F.linear`` itself (a tensor subclass weight, a bf16 input, a GPU)."""
    if not uses_onednn(x, weight):
        return torch.nn.functional.linear(x, weight, bias)
    y = onednn_mm(x.reshape(-1, x.shape[-1]), weight.t()).view(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


def _strided(t: torch.Tensor) -> torch.Tensor:
    # oneDNN takes row- or column-major 2-D operands (a transpose is a view); anything else is
    # copied once
    return t if t.stride(-1) == 1 or t.stride(-2) == 1 else t.contiguous()


@torch.library.custom_op("foundryx::onednn_mm", mutates_args=())
def onednn_mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` by oneDNN's fp32 GEMM (``linear(a, b.T)``; the transpose is a view)."""
    return torch.ops.mkldnn._linear_pointwise(_strided(a), _strided(b.t()), None, "none", [], "")


@onednn_mm.register_fake
def _(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return a.new_empty((a.shape[0], b.shape[1]))


def _setup(ctx, inputs, output) -> None:
    a, b = inputs
    ctx.save_for_backward(a if ctx.needs_input_grad[1] else None,
                          b if ctx.needs_input_grad[0] else None)


def _backward(ctx, grad):
    a, b = ctx.saved_tensors
    grad_a = onednn_mm(grad, b.t()) if ctx.needs_input_grad[0] else None
    grad_b = onednn_mm(a.t(), grad) if ctx.needs_input_grad[1] else None
    return grad_a, grad_b


onednn_mm.register_autograd(_backward, setup_context=_setup)
