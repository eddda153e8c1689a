"""The row gathers of offloaded frozen weights: which rows of a weight each rank holds
(``offload_rows``, torch.chunk's split) and the all-gather that joins the row shards into the
whole weight in its low precision (``gather_rows``). How a storage is cut and put together is
the model's (``models.peft.parts.STORAGE_ROWS``, :class:`StorageRows` here), handed in by the
builder: this part may not import models/."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch


class StorageRows(Protocol):
    """Rows and columns of a frozen-base storage tensor (``models.peft.parts.StorageRows``)."""

    def take_rows(self, t: torch.Tensor, start: int, stop: int) -> torch.Tensor: ...
    def take_columns(self, t: torch.Tensor, start: int, stop: int, name: str) -> torch.Tensor: ...
    def index_rows(self, t: torch.Tensor, order: torch.Tensor, name: str) -> torch.Tensor: ...
    def join_rows(self, local: torch.Tensor, rows: int, world: int,
                  gather: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor: ...


def offload_rows(rows: int, rank: int, world: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a ``rows``-row offloaded weight that ``rank`` of ``world``
    holds (torch.chunk's split, as FSDP2's)."""
    per = -(-rows // world)
    return min(rank * per, rows), min((rank + 1) * per, rows)


def all_gather(t: torch.Tensor, world: int, group: object = None) -> torch.Tensor:
    """Every rank's ``t`` (the same shape on all) concatenated along dim 0, in rank order of
    ``group`` (None: every rank); one-byte float types travel as bytes (gloo has no float8)."""
    if world == 1:
        return t
    as_bytes = t.dtype.itemsize == 1 and t.dtype != torch.uint8 and t.dtype != torch.int8
    send = (t.view(torch.uint8) if as_bytes else t).contiguous()
    parts = [torch.empty_like(send) for _ in range(world)]
    torch.distributed.all_gather(parts, send, group=group)
    out = torch.cat(parts)
    return out.view(t.dtype) if as_bytes else out


def gather_rows(local: torch.Tensor, rows: int, world: int, formats: StorageRows,
                group: object = None) -> torch.Tensor:
    """The whole weight (under TP: this rank's block of it) from the row shards (``local``, on
    the device) of the ``world`` ranks of ``group``, all-gathered in its low-precision form."""
    return formats.join_rows(local, rows, world, lambda t: all_gather(t, world, group))
