"""Which dtype a loaded weight is kept in: the model's (float32, the dtype rule of
docs/finetuning.md), except the frozen weights of an FSDP2 unit that holds nothing else.

torch 2.7's FSDP2 wants one original dtype per unit, and trainable weights train in float32,
so a unit with a trainable parameter keeps every parameter float32. Under LoRA the unit of the
model's top level (the input embedding, the final norm, the output projection) is all frozen
and read from the files: those weights keep the checkpoint's dtype (bf16: half the bytes of
float32, and no conversion while loading). FSDP2's mixed-precision policy gathers them in its
``param_dtype`` for the forward, so the compute sees what float32 parameters would give (bf16
to float32 is exact). One process under ``precision: amp_bf16`` keeps them too (issue 46:
the flagship's fp32 embedding and head held 2 GiB more than the peer's, and its fp32 residual
stream twice the checkpointed activations): there is no FSDP2 there, and the compute sees the
bf16 weights, as an FSDP2 run's does after its gather (autocast computes the head in bf16
either way; the embedding's output, and so the residual stream, is bf16 as in a multi-rank
run). With no FSDP2 unit to keep uniform, every frozen weight read in bf16 keeps it there, the
norms inside the blocks too (a float32 norm weight made each block's normed input float32:
LoRA's dropout copies of it twice the bytes, and every frozen layer's input cast again; the op
census). Otherwise (``mixed_precision: FULL``, fp32 precision) nothing changes.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from foundryx.loading.reader import gb
from foundryx.models.peft.frozen_base import LowPrecisionLinear
from foundryx.parallel import dist
from foundryx.parallel.fsdp import frozen_compute_dtype, unit_parameters
from foundryx.parallel.policy import blocks

log = logging.getLogger(__name__)


def keep_stored_dtype(model: nn.Module, plan: Any, parallelism: Any, precision: str) -> list[str]:
    """Before :func:`foundryx.parallel.parallelize`: give the meta parameters of each FSDP2
    unit whose parameters are all frozen and all read from the files in one floating dtype
    that dtype (see the module doc); returns their names, logged in one line."""
    target_of = {(id(m), n): t for t in plan.targets if t.kind == "param" for m, n in t.holders}

    def stored(places: list) -> torch.dtype | None:
        targets = [target_of.get((id(m), n)) for m, n in places]
        dtypes = {t.entry.dtype for t in targets if t is not None}
        return dtypes.pop() if None not in targets and len(dtypes) == 1 else None

    return keep_dtype(model, stored, parallelism, precision)


def keep_dtype(model: nn.Module, stored: Any, parallelism: Any, precision: str) -> list[str]:
    """:func:`keep_stored_dtype` for any source of dtypes: ``stored(places)`` gives the dtype
    a unit's weights are read in (None: not one)."""
    compute = frozen_compute_dtype(parallelism, precision, dist.world_size())
    if compute is None:
        return []
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    kept, nbytes = [], 0
    for places in _groups(model):
        params = [m._parameters[n] for m, n in places]
        dtype = stored(places) if places else None
        if (dtype is None or any(isinstance(m, LowPrecisionLinear) for m, _ in places)
                or any(p.requires_grad or not p.is_meta for p in params)):
            continue
        if not dtype.is_floating_point or all(p.dtype == dtype for p in params):
            continue
        new: dict[int, nn.Parameter] = {}
        for (m, n), p in zip(places, params, strict=True):
            if id(p) not in new:
                new[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=dtype, device="meta"),
                                          requires_grad=False)
                kept.append(names.get(id(p), n))
                nbytes += p.numel() * dtype.itemsize
            m._parameters[n] = new[id(p)]
    if kept and dist.rank() == 0:
        log.info("loading: %d frozen weights keep the checkpoint's %s (%s; %s in all): a unit "
                 "of frozen weights only (FSDP2's, or the model's top level on one process), "
                 "computed in %s", len(kept),
                 str(dtype).removeprefix("torch."), ", ".join(kept[:4]) + (" ..." if len(kept) > 4
                                                                         else ""),
                 gb(nbytes), str(compute).removeprefix("torch."))
    return kept


def _groups(model: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The parameters that keep one dtype together: an FSDP2 unit's (torch 2.7 wants one
    dtype per unit); on one process, with no FSDP2, each parameter alone (with every place
    that holds it), so a frozen norm beside trainable adapters keeps bf16 too."""
    units = unit_parameters(model, [m for _, m in blocks(model)])
    if dist.world_size() > 1:
        return units
    by_param: dict[int, list[tuple[nn.Module, str]]] = {}
    for places in units:
        for m, n in places:
            by_param.setdefault(id(m._parameters[n]), []).append((m, n))
    return list(by_param.values())
