"""Normalisation layers, registered in ``foundryx.registry.norms`` as ``layernorm`` and ``rmsnorm``.

Both take ``(dim, eps=..., bias=...)`` and offer ``reset_parameters()`` (weight 1, bias 0),
which model weight init calls.
"""

from __future__ import annotations

import torch
from torch import nn


class LayerNorm(nn.LayerNorm):
    """Layer normalisation over the last dimension, with an optional bias."""

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True):
        super().__init__(dim, eps=eps, bias=bias)


class RMSNorm(nn.Module):
    """Root-mean-square normalisation (no mean subtraction), computed in at least float32."""

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = False):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.bias = nn.Parameter(torch.empty(dim)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(torch.promote_types(x.dtype, torch.float32))
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = h.to(x.dtype) * self.weight.to(x.dtype)
        return h if self.bias is None else h + self.bias.to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, bias={self.bias is not None}"
