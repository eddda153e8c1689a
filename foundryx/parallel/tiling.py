"""The MLP tiled along the sequence (``tiling.mlp``), applied from outside the model.

A block's MLP is token-wise: ``down(act(gate(x)) * up(x))`` of each token depends only on that
token. At long sequences its hidden-width tensors are the largest of a block (Llama-3.1-8B:
14,336 wide, 3.5 x the residual stream; at 512K tokens each is 14 GiB in bf16, and autograd
keeps four of them). :func:`tile_mlp` replaces such a module's forward with one that runs it
``tokens`` tokens at a time under ``no_grad`` and keeps only its input for backward; backward
runs each tile again with autograd on and takes its gradients (input and trainable parameters)
before the next tile: only one tile's hidden-width tensors exist at any time. The cost is one
more forward of the MLP per step (ALST's TiledMLP, arXiv 2506.13996, which this follows in
design; written here on ``torch.autograd.Function`` and ``torch.autograd.grad``).

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
