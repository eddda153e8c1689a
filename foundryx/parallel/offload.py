"""Offloaded frozen weights (``frozen_base.offload_fraction``), applied from outside the model:
each layer's weight in host memory, row-sharded over the ranks (under tensor parallelism: over
the data-parallel ranks that hold the same TP block), copied to the device and all-gathered in
its low precision when the layer runs, the next offloaded layer's copy started meanwhile. The
layer (``models.peft.frozen_base.LowPrecisionLinear``) only reads its weight through
``layer.offload.take(device, backward)``.

This module holds the source a layer reads (:class:`Offloaded`) and which layers are offloaded
(``offload_choice``, ``offload_layers``); beside it, one job each: ``offload_pack`` (all of a
rank's shards in one exact-size host buffer, pinned), ``offload_copy`` (the copy stream and its
events), ``offload_prefetch`` (the prefetch chain), ``offload_gather`` (the row shards and
their all-gather), ``tp_offload`` (the re-cut for tensor parallelism). The storages' row and
column cuts are the model's (``models.peft.parts.STORAGE_ROWS``), handed in by the builder:
this part may not import models/.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from foundryx.parallel import dist
from foundryx.parallel.offload_copy import copy_to, wait_for
from foundryx.parallel.offload_gather import StorageRows, gather_rows, offload_rows
from foundryx.parallel.offload_pack import pack_offloaded
from foundryx.parallel.offload_prefetch import PrefetchLink, chain
from foundryx.parallel.pinning import HostPin


class Offloaded(PrefetchLink):
    """One layer's frozen weight kept in host memory (``host``; with ``rows`` set: this rank's
    row shard of it; a meta placeholder until a loader fills it, :func:`pack_offloaded` moves
    it into the shared host buffer); :meth:`take` gives the whole weight on the device (from
    the copy prefetched, else a fresh one, all-gathered when sharded) and starts the copy of
    the next layer's.

    Under tensor parallelism (``tp_offload.split_for_tp``) the weight is this rank's TP block
    instead (rows of a column-wise layer, columns of a row-wise one), sharded by rows over the
    data-parallel ranks that share the block, and :meth:`take` gives it as a DTensor."""

    def __init__(self, host: torch.Tensor, formats: StorageRows, rows: int | None = None,
                 world: int = 1, name: str = "") -> None:
        super().__init__()
        self.rows, self.world = rows, world  # rows None: host is the whole weight
        self.formats = formats  # the storage's row and column cuts
        self.name = name  # the layer's, for messages
        self.group: object = None  # the process group the rows are split over (None: all ranks)
        self.row_offset = 0  # under TP, column-wise: the whole weight's row the block starts at
        self.columns: tuple[int, int] | None = None  # under TP, row-wise: the block's columns
        self.placed: tuple[DeviceMesh, tuple, torch.Size] | None = None  # under TP: the DTensor
        self.host = host
        self.buffer: torch.Tensor | None = None  # the host buffer host's bytes live in, once packed
        self.pin: HostPin | None = None  # that buffer's pinning, shared by the layers in it
        self.copies = 0  # host -> device copies made (tests count them)

    def shard_range(self) -> tuple[int, int]:
        """The rows of the whole weight this rank holds (of its columns, under TP row-wise)."""
        if self.rows is None:
            return 0, self.host.shape[0]
        rank = dist.rank() if self.group is None else torch.distributed.get_rank(self.group)
        start, stop = offload_rows(self.rows, rank, self.world)
        return self.row_offset + start, self.row_offset + stop

    def _copy(self, device: torch.device) -> tuple[torch.Tensor, object]:
        self.copies += 1
        return copy_to(self.host, device)

    def take(self, device: torch.device, backward: bool = False) -> torch.Tensor:
        w, event = self.claim(device, backward)
        wait_for(event, device)
        if self.rows is not None:
            w = gather_rows(w, self.rows, self.world, self.formats, self.group)
        if self.placed is not None:
            mesh, placements, shape = self.placed
            w = DTensor.from_local(w, mesh, placements, run_check=False, shape=shape,
                                   stride=(shape[1], 1))
        neighbour = self.following(backward)
        if neighbour is not None:
            neighbour.prefetch(device)
        return w


def offload_choice(layers: list, fraction: float) -> list:
    """The ``fraction`` of ``layers`` (in forward order) that is offloaded, spread evenly over
    the model."""
    count = round(fraction * len(layers))
    return [layers[(i * len(layers)) // count] for i in range(count)] if count else []


def offload_layers(layers: list[nn.Module], fraction: float, formats: StorageRows,
                   device: torch.device | str) -> list[nn.Module]:
    """Move :func:`offload_choice` of the frozen ``layers`` (``LowPrecisionLinear``) to host
    memory, each rank keeping its row shard of each (a meta weight stays a placeholder for a
    loader to fill), and chain them for prefetching; the offloaded layers. ``formats``: the
    storages' cuts (``models.peft.parts.STORAGE_ROWS``); ``device``: the run's, which the
    weights are copied to (:func:`pack_offloaded` pins for a GPU only)."""
    chosen = offload_choice(layers, fraction)
    world = dist.world_size()
    for layer in chosen:
        whole = layer.weight.detach()
        del layer._parameters["weight"]
        layer.weight = None  # a plain attribute now: not a parameter, not in the state dict
        rows = whole.shape[0] if world > 1 else None
        layer.offload = Offloaded(whole, formats, rows, world, layer.name)
        if rows is not None and not whole.is_meta:
            layer.offload.host = formats.take_rows(whole, *layer.offload.shard_range())
        del whole
    chain([layer.offload for layer in chosen])
    if chosen and not any(layer.offload.host.is_meta for layer in chosen):
        pack_offloaded(chosen, device)
    return chosen
