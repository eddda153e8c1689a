"""Feed-forward blocks, registered in ``foundryx.registry.ffns`` as ``mlp`` and ``swiglu``.

Both take ``(d_model, hidden, bias=True)``. The projection that writes back into the
residual stream carries ``_is_residual = True``; weight init scales it down by depth.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Module):
    """``down(gelu(up(x)))``; ``approximate="tanh"`` selects the tanh form of GELU."""

    def __init__(self, d_model: int, hidden: int, bias: bool = True, approximate: str = "none"):
        super().__init__()
        self.up_proj = nn.Linear(d_model, hidden, bias=bias)
        self.act = nn.GELU(approximate=approximate)
        self.down_proj = nn.Linear(hidden, d_model, bias=bias)
        self.down_proj._is_residual = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.up_proj(x)))


class SwiGLU(nn.Module):
    """``down(silu(gate(x)) * up(x))``."""

    def __init__(self, d_model: int, hidden: int, bias: bool = True):
        super().__init__()
        self.gate_proj = nn.Linear(d_model, hidden, bias=bias)
        self.up_proj = nn.Linear(d_model, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, d_model, bias=bias)
        self.down_proj._is_residual = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))
