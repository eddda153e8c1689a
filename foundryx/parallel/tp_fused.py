"""Fused projections under tensor parallelism in full state dicts: the row orders TP gave them
(:func:`foundryx.parallel.tp_styles.interleaved_rows`), and a full state dict put in TP's order
or back in the logical order a model at tp 1 holds."""

from __future__ import annotations

import torch
from torch import nn

from foundryx.parallel.materialize import TP_ROWS_ATTR as ROWS_ATTR


def fused_row_orders(model: nn.Module) -> dict[str, torch.Tensor]:
    """``{state-dict key: row order}`` of the parameters TP reordered (a fused layer's weight
    and bias): the parameter's rows are its logical rows taken in that order. (foundryx's
    checkpointing and compile wrap no module, so module names are the state dict's.)"""
    out: dict[str, torch.Tensor] = {}
    for name, module in model.named_modules():
        order = getattr(module, ROWS_ATTR, None)
        if order is None:
            continue
        for p in ("weight", "bias"):
            if getattr(module, p, None) is not None:
                out[f"{name}.{p}" if name else p] = order
    return out


def permute_full_state(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """Reorder a full (unsharded) state dict's fused rows as TP reordered the model's."""
    for key, order in fused_row_orders(model).items():
        if full.get(key) is not None:
            full[key] = full[key][order]


def unpermute_full_state(model: nn.Module, full: dict[str, torch.Tensor]) -> None:
    """The inverse of :func:`permute_full_state`: a full state dict of the TP model with its
    fused rows back in their logical order (what a model at tp 1 holds)."""
    for key, order in fused_row_orders(model).items():
        if full.get(key) is not None:
            full[key] = full[key][torch.argsort(order)]
