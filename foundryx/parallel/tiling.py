"""The MLP and the RMS norms tiled along the sequence (``tiling``), applied from outside the
model.

A block's MLP is token-wise: ``down(act(gate(x)) * up(x))`` of each token depends only on that
token. At long sequences its hidden-width tensors are the largest of a block (Llama-3.1-8B:
14,336 wide, 3.5 x the residual stream; at 512K tokens each is 14 GiB in bf16, and autograd
keeps four of them). :func:`tile_mlp` replaces such a module's forward with one that runs it
``tokens`` tokens at a time under ``no_grad`` and keeps only its input for backward; backward
runs each tile again with autograd on and takes its gradients (input and trainable parameters)
before the next tile: only one tile's hidden-width tensors exist at any time. The cost is one
more forward of the MLP per step (ALST's TiledMLP, arXiv 2506.13996, which this follows in
design; written here on ``torch.autograd.Function`` and ``torch.autograd.grad``).

An RMS norm (Hugging Face's ``LlamaRMSNorm`` and its copies in other families: the input
upcast to float32, normalized, cast back, times the weight) keeps its float32 input for
backward, and its backward makes four more float32 tensors of the input's size: 10 float32
copies of the residual stream at once (at 512K tokens, 8 GiB each for Llama-3.1-8B) were the
largest part of a checkpointed block's backward. :func:`tile_rms_norm` computes the same
function ``tokens`` at a time, keeping only its input (in its own dtype) and a float32
reciprocal RMS per token, and its backward recomputes each tile's normalized input: only one
tile is ever in float32 (Liger-Kernel's and Unsloth's RMS norm kernels keep the same two
tensors; written here with torch ops).

The trainable parameters (LoRA's adapters, or every weight in full fine-tuning) are inputs of
the autograd function, so their gradients reach them through the autograd engine as any other
(accumulation, FSDP2's reduce-scatter and gradient hooks unchanged). Dropout inside the MLP
(LoRA's) draws the same masks in the backward's rerun as in the forward: the random state is
saved before the first tile and restored for the rerun, as activation checkpointing does.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn


class _Tiled(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, tokens, x, *params):  # noqa: ANN001, ANN205, D102
        device = x.device.type
        ctx.fn, ctx.tokens, ctx.n_params = fn, tokens, len(params)
        ctx.saved_params = params  # leaves (parameters): no cycle through the graph
        ctx.autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.devices = [x.device] if device == "cuda" else []
        ctx.rng = _rng_state(ctx.devices)
        flat = x.reshape(-1, x.shape[-1])
        out = None
        # autocast's cast cache off: a weight's cast made here without grad must not be the
        # one backward's rerun finds (when backward runs inside the same autocast region)
        with torch.no_grad(), torch.autocast(device, ctx.autocast[1], enabled=ctx.autocast[0],
                                             cache_enabled=False):
            for start in range(0, flat.shape[0], tokens):
                y = fn(flat[start:start + tokens])
                if out is None:  # its width and dtype are the MLP's (autocast's)
                    out = y.new_empty((flat.shape[0], y.shape[-1]))
                out[start:start + y.shape[0]] = y
                del y
        ctx.save_for_backward(x)
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205, D102
        (x,) = ctx.saved_tensors
        flat = x.reshape(-1, x.shape[-1])
        g_flat = grad.reshape(-1, grad.shape[-1])
        want_x = ctx.needs_input_grad[2]
        wanted = [i for i, need in enumerate(ctx.needs_input_grad[3:]) if need]
        inputs = ctx.saved_params
        grad_x = torch.empty_like(flat) if want_x else None
        grads: list[torch.Tensor | None] = [None] * ctx.n_params
        enabled, dtype = ctx.autocast
        with torch.random.fork_rng(devices=ctx.devices, enabled=True):
            _set_rng_state(ctx.rng, ctx.devices)
            for start in range(0, flat.shape[0], ctx.tokens):
                xt = flat[start:start + ctx.tokens].detach().requires_grad_(want_x)
                with torch.enable_grad(), torch.autocast(x.device.type, dtype, enabled=enabled,
                                                         cache_enabled=False):
                    yt = ctx.fn(xt)
                wrt = ([xt] if want_x else []) + [inputs[i] for i in wanted]
                got = torch.autograd.grad(yt, wrt, g_flat[start:start + yt.shape[0]],
                                          allow_unused=True)
                del yt
                if want_x:
                    grad_x[start:start + xt.shape[0]] = got[0]
                    got = got[1:]
                for i, g in zip(wanted, got):
                    if g is not None:
                        grads[i] = g if grads[i] is None else grads[i].add_(g)
        gx = grad_x.view(x.shape) if grad_x is not None else None
        return (None, None, gx, *grads)


def _rng_state(devices: list[torch.device]) -> tuple[Any, list[Any]]:
    return torch.get_rng_state(), [torch.cuda.get_rng_state(d) for d in devices]


def _set_rng_state(state: tuple[Any, list[Any]], devices: list[torch.device]) -> None:
    torch.set_rng_state(state[0])
    for d, s in zip(devices, state[1]):
        torch.cuda.set_rng_state(s, d)


@torch.compiler.disable  # a compiled block leaves it out (its loop would be unrolled per tile)
def tiled(fn: Any, x: torch.Tensor, tokens: int, params: list[nn.Parameter]) -> torch.Tensor:
    """``fn(x)`` for a token-wise ``fn``, run ``tokens`` tokens at a time (see the module doc);
    ``params``: the trainable parameters ``fn`` uses."""
    return _Tiled.apply(fn, tokens, x, *params)


def tile_mlp(module: nn.Module, tokens: int) -> None:
    """Run ``module`` (a token-wise MLP taking one tensor) ``tokens`` tokens at a time when its
    input holds more than that; its parameters, names and state dict are unchanged."""
    if tokens < 1:
        raise ValueError(f"tile_mlp: tokens must be >= 1, got {tokens}")
    inner = module.forward

    @functools.wraps(inner)
    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.shape[:-1].numel() <= tokens:
            return inner(x)
        params = [p for p in module.parameters() if p.requires_grad]
        return tiled(inner, x, tokens, params)

    module.forward = forward
    module._foundryx_mlp_tokens = tokens


class _TiledRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, tokens):  # noqa: ANN001, ANN205, D102
        flat = x.reshape(-1, x.shape[-1])
        out = torch.empty(flat.shape, dtype=torch.promote_types(weight.dtype, x.dtype),
                          device=x.device)
        rstd = torch.empty(flat.shape[0], dtype=torch.float32, device=x.device)
        with torch.autocast(x.device.type, enabled=False):
            for start in range(0, flat.shape[0], tokens):
                h = flat[start:start + tokens].to(torch.float32, copy=True)
                r = torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
                rstd[start:start + tokens] = r.squeeze(-1)
                torch.mul(weight, h.mul_(r).to(x.dtype), out=out[start:start + tokens])
        ctx.save_for_backward(x, weight, rstd)
        ctx.tokens = tokens
        return out.view(*x.shape[:-1], out.shape[-1])

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205, D102
        x, weight, rstd = ctx.saved_tensors
        flat, g_flat = x.reshape(-1, x.shape[-1]), grad.reshape(-1, grad.shape[-1])
        want_x, want_w = ctx.needs_input_grad[:2]
        dx = torch.empty_like(flat) if want_x else None
        dw = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if want_w else None
        with torch.autocast(x.device.type, enabled=False):
            for start in range(0, flat.shape[0], ctx.tokens):
                sl = slice(start, start + ctx.tokens)
                r = rstd[sl].unsqueeze(-1)
                n = flat[sl].to(torch.float32, copy=True).mul_(r)  # normalized, float32
                g = g_flat[sl]
                if want_w:  # y = w * n.to(x.dtype): dw = sum over tokens of g * n in x's dtype
                    dw += (g * n.to(x.dtype)).float().sum(0)
                if want_x:  # d(n)/dx = r (I - n nᵀ / d), applied to g * w
                    gn = (g * weight).float()
                    dot = (gn * n).mean(-1, keepdim=True)
                    dx[sl] = gn.sub_(n.mul_(dot)).mul_(r).to(x.dtype)
        return (dx.view(x.shape) if want_x else None,
                dw.to(weight.dtype) if want_w else None, None, None)


def tile_rms_norm(module: nn.Module, tokens: int) -> None:
    """Run the RMS norm ``module`` (``weight`` and ``variance_epsilon`` or ``eps``: Hugging
    Face's LlamaRMSNorm and its copies) ``tokens`` tokens at a time, keeping only its input
    and a float32 reciprocal RMS per token for backward (see the module doc)."""
    inner = module.forward
    eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))

    @functools.wraps(inner)
    def forward(x: torch.Tensor) -> torch.Tensor:
        if x.shape[:-1].numel() <= tokens:
            return inner(x)
        return tiled_rms_norm(x, module.weight, eps, tokens)

    module.forward = forward
    module._foundryx_norm_tokens = tokens


@torch.compiler.disable
def tiled_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, tokens: int) -> torch.Tensor:
    return _TiledRMSNorm.apply(x, weight, eps, tokens)


# Hugging Face norms that compute exactly ``weight * (x.float() * rsqrt(mean(x²) + eps)).to(
# x.dtype)`` (checked against each release's source: OLMo-2 multiplies before the cast and
# Gemma by 1 + weight, so neither is here)
RMS_NORMS = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm",
                       "Phi3RMSNorm"})


def rms_norm_modules(model: nn.Module) -> list[nn.Module]:
    """The model's RMS norms that :func:`tile_rms_norm` computes exactly (``RMS_NORMS``)."""
    return [m for m in model.modules() if type(m).__name__ in RMS_NORMS
            and not getattr(m, "_foundryx_norm_tokens", 0)]


def mlp_modules(model: nn.Module, blocks: list[nn.Module],
                class_names: list[str] | None = None) -> list[nn.Module]:
    """The MLPs inside ``blocks``: modules of ``class_names``, or (None) each block's modules
    whose class name ends in ``MLP`` (LlamaMLP, Qwen2MLP, MistralMLP, MPTMLP, ...)."""
    found = []
    for block in blocks:
        for m in block.modules():
            name = type(m).__name__
            if (name in class_names) if class_names else name.endswith("MLP"):
                found.append(m)
    return found
