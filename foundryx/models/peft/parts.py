"""Rows and columns of the frozen-base storages, for offloading and tensor parallelism:
:class:`~foundryx.models.peft.rowwise.RowScaledTensor` (int8/FP8/bf16 rows, a scale per row)
and torchao's ``NF4Tensor``.

An NF4 weight is stored along its flattened elements: a 4-bit code per weight (two a byte), an
absmax scaler per block of ``block_size`` weights, stored as int8 around the whole weight's
scaler mean, and one float factor per group of ``scaler_block_size`` scalers. When a row's
columns are a whole number of such groups (``columns % (block_size * scaler_block_size) ==
0``), each row is its own codes, scalers and factors, and any rows, or any group-aligned
columns, of the weight are an NF4 tensor of their own holding the same bytes: the values it
dequantizes to are those of the same positions of the whole weight, bit for bit.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_map_only

from foundryx.errors import ConfigError
from foundryx.models.peft.frozen_options import PATH
from foundryx.models.peft.rowwise import RowScaledTensor


@functools.cache
def torchao_nf4() -> Any:
    """:mod:`foundryx.models.peft.torchao_nf4`, loaded on the first NF4 use."""
    from foundryx.models.peft import torchao_nf4 as module  # torchao: a heavy import

    return module


@functools.cache
def nf4_part_type() -> type:
    """:class:`NF4Part`'s class, made on first use (torchao is a heavy import)."""
    nf4 = torchao_nf4()
    NF4Tensor = nf4.NF4Tensor  # noqa: N806 (a class)

    class NF4Part(NF4Tensor):
        """torchao's ``NF4Tensor`` as a tensor-parallel part: the same bytes and ops (their
        results stay parts), with FSDP2's all-gather hooks completed for a DTensor parameter.
        FSDP2 refills a TP parameter's unsharded tensor in place, giving the hook the DTensor
        as ``out`` (torchao's expects the NF4 tensor inside it); and torch 2.14's FSDP2, on a
        one-rank mesh (tp = world size), copies only the first all-gather input, the
        scalers (the shard is the whole part then: the rest is copied from it)."""

        @classmethod
        def __torch_dispatch__(cls, func, types, args, kwargs=None):  # noqa: ANN001, ANN206
            out = super().__torch_dispatch__(func, types, args, kwargs)
            return tree_map_only(NF4Tensor, _as_part, out)

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN206
            out = super().__torch_function__(func, types, args, kwargs)
            return tree_map_only(NF4Tensor, _as_part, out)

        @staticmethod
        def __tensor_unflatten__(inner, metadata, outer_size, outer_stride):  # noqa: ANN001, ANN205
            return _as_part(NF4Tensor.__tensor_unflatten__(inner, metadata, outer_size, outer_stride))

        def fsdp_post_all_gather(self, outputs: tuple[torch.Tensor, ...], metadata: Any,
                                 param_dtype: torch.dtype, *, out: Any = None) -> Any:
            if out is not None:
                out = getattr(out, "_local_tensor", out)  # a tensor-parallel DTensor's part
            if len(outputs) == 1:  # the one-rank mesh: only the scalers were copied
                outputs = (outputs[0], self.quantization_factor.clone(), self.quantized_data.clone())
                if out is not None:
                    for name, t in zip(("quantized_scalers", "quantization_factor", "quantized_data"),
                                       outputs):
                        getattr(out, name).copy_(t.view_as(getattr(out, name)))
                    return None
            if out is not None:  # FSDP2 refilled the storages ``out`` already views
                return None
            full, kept = super().fsdp_post_all_gather(outputs, metadata, param_dtype)
            return _as_part(full), kept

    def _as_part(t: Any) -> Any:
        if isinstance(t, NF4Part):
            return t
        return nf4.nf4_from_parts(NF4Part, t.shape, t.dtype, t.device, block_size=t.block_size,
                                  scaler_block_size=t.scaler_block_size, **nf4.nf4_parts(t))

    return NF4Part


def column_group(t: Any) -> int:
    """Weights per factor group of an NF4 tensor: its rows and column parts align to this."""
    return t.block_size * t.scaler_block_size


def part_problem(t: Any, columns: tuple[int, int] | None = None) -> str | None:
    """Why rows / these ``columns`` of ``t`` are not an NF4 tensor of their own (None: they
    are)."""
    group = column_group(t)
    cols = t.shape[1]
    if cols % group:
        return (f"its rows of {cols} columns are not whole groups of {group} weights "
                f"({t.block_size}-weight blocks x {t.scaler_block_size} scalers)")
    if columns is not None and (columns[0] % group or columns[1] % group):
        return (f"columns {columns[0]}..{columns[1]} do not start and end on its groups of "
                f"{group} weights")
    return None


def nf4_part(t: Any, rows: slice | torch.Tensor | None = None,
             columns: tuple[int, int] | None = None) -> Any:
    """The NF4 tensor of ``t[rows][:, columns[0]:columns[1]]`` (rows: a slice or an index
    tensor; None: all), its bytes copied from ``t``'s. Raises ValueError where the blocks do
    not allow it (:func:`part_problem`)."""
    problem = part_problem(t, columns)
    if problem is not None:
        raise ValueError(f"NF4 weight of shape {tuple(t.shape)}: {problem}")
    n_rows, cols = t.shape
    group = column_group(t)
    parts = [(t.quantized_data, 2), (t.quantized_scalers, t.block_size), (t.quantization_factor, group)]
    out = []
    for inner, per in parts:
        view = inner.view(n_rows, cols // per)
        if rows is not None:
            view = view[rows]
        if columns is not None:
            view = view[:, columns[0] // per:columns[1] // per]
        out.append(view.clone(memory_format=torch.contiguous_format).view(-1))  # its own bytes
    data, scalers, factors = out
    width = cols if columns is None else columns[1] - columns[0]
    shape = (data.numel() * 2 // width, width)
    return torchao_nf4().nf4_from_parts(
        nf4_part_type(), shape, t.dtype, t.device, block_size=t.block_size,
        scaler_block_size=t.scaler_block_size, quantized_data=data, quantized_scalers=scalers,
        quantization_factor=factors, scaler_mean=t.scaler_mean, nf4=t.nf4)


def take_rows(storage: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """A copy (not a view) of rows ``[start, stop)`` of a frozen-base storage tensor."""
    if isinstance(storage, RowScaledTensor):
        return RowScaledTensor(storage.qdata[start:stop].clone(), storage.scale[start:stop].clone(),
                               dtype=storage.dtype)
    per = stop - start  # NF4: rows split evenly (to_nf4 checked it)
    part = storage.split(per)[start // per]
    out = torch.empty_like(part)
    out.copy_(part)  # torchao's NF4 copy_ returns None
    return out


def checked_nf4_part(storage: torch.Tensor, name: str, **where: Any) -> torch.Tensor:
    """:func:`nf4_part` of layer ``name``'s weight; a ConfigError where its blocks do not allow
    it."""
    try:
        return nf4_part(storage, **where)
    except ValueError as e:  # to_nf4 aligns the blocks for TP; a model built without it
        raise ConfigError([f"{PATH}.dtype: nf4: tensor parallelism cannot split {name!r}: {e}; "
                           "use dtype: int8 or fp8, or tp: 1"]) from None


def index_rows(storage: torch.Tensor, order: torch.Tensor, name: str = "") -> torch.Tensor:
    """A low-precision weight's rows in ``order``."""
    if not isinstance(storage, RowScaledTensor):
        return checked_nf4_part(storage, name, rows=order)
    q = storage.qdata  # float8 has no CPU index kernel: its bytes are reordered
    q = q.view(torch.uint8)[order].view(q.dtype) if q.element_size() == 1 else q[order]
    return RowScaledTensor(q, storage.scale[order], dtype=storage.dtype)


def take_columns(storage: torch.Tensor, start: int, stop: int, name: str = "") -> torch.Tensor:
    """A copy of columns ``[start, stop)`` of a low-precision weight (each row's scale whole:
    a row's scale comes from all of its columns; NF4: whole groups of blocks)."""
    if not isinstance(storage, RowScaledTensor):
        return checked_nf4_part(storage, name, columns=(start, stop))
    return RowScaledTensor(storage.qdata[:, start:stop].clone(), storage.scale.clone(),
                           dtype=storage.dtype)


def join_rows(local: torch.Tensor, rows: int, world: int,
              gather: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The whole weight (``rows`` rows) from the row shards of ``world`` ranks, ``local``
    being this rank's: ``gather(t)`` is every rank's ``t`` concatenated along dim 0 in rank
    order, a collective the caller runs (foundryx.parallel.offload_gather); this only takes the
    storage apart and puts it together. Row-scaled shards are padded to equal size (the last
    ranks may hold fewer rows); NF4 shards are equal (to_nf4 checked it)."""
    if isinstance(local, RowScaledTensor):
        per, n = -(-rows // world), local.qdata.shape[0]
        q, sc = local.qdata, local.scale
        if n < per:
            q = torch.cat([q, q.new_zeros(per - n, *q.shape[1:])])
            sc = torch.cat([sc, sc.new_zeros(per - n)])
        return RowScaledTensor(gather(q)[:rows], gather(sc)[:rows], dtype=local.dtype)
    nf4 = torchao_nf4()
    return nf4.nf4_from_parts(nf4.NF4Tensor, (rows, *local.shape[1:]), local.dtype,
                              local.device, block_size=local.block_size,
                              scaler_block_size=local.scaler_block_size,
                              quantized_data=gather(local.quantized_data),
                              quantized_scalers=gather(local.quantized_scalers),
                              quantization_factor=gather(local.quantization_factor),
                              scaler_mean=local.scaler_mean, nf4=local.nf4)


class StorageRows:
    """The row and column cuts of frozen-base storages (row-scaled and NF4), as the offload
    runtime (foundryx.parallel.offload, which may not import models/) is handed them."""

    take_rows = staticmethod(take_rows)
    take_columns = staticmethod(take_columns)
    index_rows = staticmethod(index_rows)
    join_rows = staticmethod(join_rows)


STORAGE_ROWS = StorageRows()
