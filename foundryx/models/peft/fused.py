"""LoRA on row slices of a fused projection: MPT's ``Wqkv`` adapted on ``q`` and ``v`` only.

A fused linear layer computes several projections at once (``Wqkv``: the q, k and v rows of
one weight). ``FusedLoraLinear`` holds the original layer as ``base_layer`` and one LoRA pair
per chosen slice (``lora_A.<slice>``, ``lora_B.<slice>``); its output is the base output with
``scaling * B_s A_s x`` added to slice ``s``'s rows only, so the other slices are exactly the
base model's. Each pair is what PEFT puts on a separate projection (``q_proj``'s
``lora_A`` / ``lora_B``), which is how an export names it.

Adapter weights are initialised as PEFT does (A: Kaiming-uniform with a = sqrt(5), B: zero)
but from a generator seeded by the run's seed and the parameter's name
(:func:`init_adapter`), so every rank, and a meta-device model initialised after sharding,
gets the same adapters as a model built on the CPU.
"""

from __future__ import annotations

import math
import zlib

import torch
from torch import nn


def adapter_seed(name: str) -> int:
    """The seed of the adapter layer called ``name``: the run's seed (``torch.initial_seed``,
    the same on every rank after ``seed_all``) mixed with the name."""
    return (torch.initial_seed() * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def init_adapter(layer: nn.Linear, is_a: bool, seed: int) -> None:
    """PEFT's default LoRA init on one adapter linear: A Kaiming-uniform (a = sqrt(5)), B zero.
    Drawn on the CPU from ``seed`` and copied, so it does not depend on the global RNG or the
    device."""
    with torch.no_grad():
        if not is_a:
            layer.weight.zero_()
            return
        values = torch.empty(layer.weight.shape, dtype=torch.float32)
        nn.init.kaiming_uniform_(values, a=math.sqrt(5),
                                 generator=torch.Generator().manual_seed(seed))
        layer.weight.copy_(values.to(layer.weight.dtype))


def attach_init(layer: nn.Linear, is_a: bool, seed: int) -> None:
    """Initialise ``layer`` now (unless on meta) and give it a ``param_init_fn`` that repeats
    the same init, which foundryx.parallel's meta-device materialisation calls after
    sharding."""
    def param_init_fn(module: nn.Module) -> None:
        init_adapter(module, is_a, seed)

    layer.param_init_fn = param_init_fn
    if not layer.weight.is_meta:
        init_adapter(layer, is_a, seed)


class FusedLoraLinear(nn.Module):
    """``base_layer`` (a fused ``nn.Linear`` whose output rows are ``slices``, in order) with
    LoRA adapters on the slices named in ``chosen``."""

    def __init__(self, base_layer: nn.Linear, slices: dict[str, int], chosen: list[str], *,
                 r: int, lora_alpha: float, lora_dropout: float, use_rslora: bool, name: str):
        super().__init__()
        self.base_layer = base_layer
        self.slice_names = tuple(slices)
        self.slice_sizes = tuple(slices.values())
        self.scaling = lora_alpha / (math.sqrt(r) if use_rslora else r)
        self.lora_dropout = nn.Dropout(lora_dropout) if lora_dropout > 0 else nn.Identity()
        device, dtype = base_layer.weight.device, base_layer.weight.dtype
        self.lora_A = nn.ModuleDict({
            s: nn.Linear(base_layer.in_features, r, bias=False, device=device, dtype=dtype)
            for s in chosen})
        self.lora_B = nn.ModuleDict({
            s: nn.Linear(r, slices[s], bias=False, device=device, dtype=dtype) for s in chosen})
        for s in chosen:
            attach_init(self.lora_A[s], True, adapter_seed(f"{name}.lora_A.{s}"))
            attach_init(self.lora_B[s], False, adapter_seed(f"{name}.lora_B.{s}"))

    @property
    def in_features(self) -> int:
        return self.base_layer.in_features

    @property
    def out_features(self) -> int:
        return self.base_layer.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base_layer(x)
        h = self.lora_dropout(x)
        parts = list(out.split(self.slice_sizes, dim=-1))
        for i, s in enumerate(self.slice_names):
            if s in self.lora_A:
                parts[i] = parts[i] + self.lora_B[s](self.lora_A[s](h)) * self.scaling
        return torch.cat(parts, dim=-1)

    @torch.no_grad()
    def merge(self) -> nn.Linear:
        """The base layer with each adapter folded into its slice's rows (``W_s += scaling B_s
        A_s``, in place), as PEFT's merge does for a whole layer."""
        weight, start = self.base_layer.weight, 0
        for s, size in zip(self.slice_names, self.slice_sizes):
            if s in self.lora_A:
                delta = self.lora_B[s].weight @ self.lora_A[s].weight * self.scaling
                weight[start:start + size] += delta.to(weight.dtype)
            start += size
        return self.base_layer

    def extra_repr(self) -> str:
        return f"slices={dict(zip(self.slice_names, self.slice_sizes))}, adapted={list(self.lora_A)}"
