"""Offloaded frozen weights (``frozen_base.offload_fraction``), applied from outside the model:
each layer's weight in host memory, row-sharded over the ranks (under tensor parallelism: over
the data-parallel ranks that hold the same TP block), copied to the device and all-gathered in
its low precision when the layer runs, the next offloaded layer's copy started meanwhile; all of
a rank's shards in one exact-size host buffer. The layer (``models.peft.frozen_base
.LowPrecisionLinear``) only reads its weight through ``layer.offload.take(device, backward)``;
the copies, streams, pinning and gathers are here. The storages' row and column cuts are the
model's (``models.peft.parts.STORAGE_ROWS``), handed in by the builder: this part may not
import models/.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from foundryx.parallel.pinning import HostPin

log = logging.getLogger(__name__)


class StorageRows(Protocol):
    """Rows and columns of a frozen-base storage tensor (``models.peft.parts.StorageRows``)."""

    def take_rows(self, t: torch.Tensor, start: int, stop: int) -> torch.Tensor: ...
    def take_columns(self, t: torch.Tensor, start: int, stop: int, name: str) -> torch.Tensor: ...
    def index_rows(self, t: torch.Tensor, order: torch.Tensor, name: str) -> torch.Tensor: ...
    def join_rows(self, local: torch.Tensor, rows: int, world: int,
                  gather: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor: ...


def process_world_size() -> int:
    """The number of processes (1 without a process group)."""
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def offload_rows(rows: int, rank: int, world: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a ``rows``-row offloaded weight that ``rank`` of ``world``
    holds (torch.chunk's split, as FSDP2's)."""
    per = -(-rows // world)
    return min(rank * per, rows), min((rank + 1) * per, rows)


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _all_gather(t: torch.Tensor, world: int, group: object = None) -> torch.Tensor:
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


def _gather_rows(local: torch.Tensor, rows: int, world: int, formats: StorageRows,
                 group: object = None) -> torch.Tensor:
    """The whole weight (under TP: this rank's block of it) from the row shards (``local``, on
    the device) of the ``world`` ranks of ``group``, all-gathered in its low-precision form."""
    return formats.join_rows(local, rows, world, lambda t: _all_gather(t, world, group))


class Offloaded:
    """One layer's frozen weight kept in host memory (with ``rows`` set: this rank's row
    shard of it); :meth:`take` gives the whole weight on the device (from the copy prefetched,
    else a fresh one, all-gathered when sharded) and starts the copy of the next layer's.

    Under tensor parallelism (:meth:`split_for_tp`) the weight is this rank's TP block instead
    (rows of a column-wise layer, columns of a row-wise one), sharded by rows over the
    data-parallel ranks that share the block, and :meth:`take` gives it as a DTensor."""

    def __init__(self, host: torch.Tensor, formats: StorageRows, rows: int | None = None,
                 world: int = 1, name: str = "") -> None:
        self.rows, self.world = rows, world  # rows None: host is the whole weight
        self.formats = formats  # the storage's row and column cuts
        self.name = name  # the layer's, for messages
        self.group: object = None  # the process group the rows are split over (None: all ranks)
        self.row_offset = 0  # under TP, column-wise: the whole weight's row the block starts at
        self.columns: tuple[int, int] | None = None  # under TP, row-wise: the block's columns
        self.placed: tuple[DeviceMesh, tuple, torch.Size] | None = None  # under TP: the DTensor
        self.host = host
        self.set_host(host)
        self.buffer: torch.Tensor | None = None  # the host buffer host's bytes live in, once packed
        self.pin: HostPin | None = None  # that buffer's pinning, shared by the layers in it
        self.next: Offloaded | None = None
        self.prev: Offloaded | None = None
        self.backward_task = -1  # the autograd graph task whose backward last took the weight
        self.pending: tuple[torch.device, torch.Tensor, object] | None = None
        self.copies = 0  # host -> device copies made (tests count them)
        self.prefetches = 0  # copies started ahead of use (numbers them)

    def set_host(self, host: torch.Tensor) -> None:
        """Hold ``host`` (this rank's rows when sharded; a meta placeholder until a loader
        fills it; :func:`pack_offloaded` moves it into the shared host buffer)."""
        self.host = host

    def shard_range(self) -> tuple[int, int]:
        """The rows of the whole weight this rank holds (of its columns, under TP row-wise)."""
        if self.rows is None:
            return 0, self.host.shape[0]
        rank = _rank() if self.group is None else torch.distributed.get_rank(self.group)
        start, stop = offload_rows(self.rows, rank, self.world)
        return self.row_offset + start, self.row_offset + stop

    def split_for_tp(self, mesh: DeviceMesh, placement: Any, group: object,
                     order: torch.Tensor | None = None) -> None:
        """Keep this rank's tensor-parallel block of the weight (``placement`` over ``mesh``:
        Shard(0), rows, for a column-wise layer, in ``order`` when TP reorders a fused layer's
        rows; Shard(1), columns, for a row-wise one, each row's scale whole; Replicate: all of
        it), its rows split over ``group``, the data-parallel ranks that hold the same block.
        A weight already in host memory is gathered whole once to be cut again (a meta
        placeholder: the loader reads the new rows)."""
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape = torch.Size((self.rows or self.host.shape[0], *self.host.shape[1:]))
        whole = None
        if not self.host.is_meta:
            whole = self.host if self.rows is None else \
                _gather_rows(self.host, self.rows, self.world, self.formats)
            if order is not None:
                whole = self.formats.index_rows(whole, order, self.name)
        local, offset = compute_local_shape_and_global_offset(shape, mesh, [placement])
        self.group, self.world = group, torch.distributed.get_world_size(group)
        self.placed = (mesh, (placement,), shape)
        if not placement.is_shard():  # replicated over the TP ranks: the whole weight
            self.rows = shape[0]
        elif placement.dim == 0:
            self.rows, self.row_offset = local[0], offset[0]
        else:
            self.rows, self.columns = shape[0], (offset[1], offset[1] + local[1])
        if whole is not None:
            start, stop = self.shard_range()
            part = self.formats.take_rows(whole, start, stop)
            self.set_host(part if self.columns is None
                          else self.formats.take_columns(part, *self.columns, self.name))

    def _copy(self, device: torch.device) -> tuple[torch.Tensor, object]:
        self.copies += 1
        if device.type == "cuda":
            stream = _copy_stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                w = self.host.to(device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
            return w, event
        # On CPU "the device" is host memory too: still a real copy, dropped after use. Copied
        # into an empty tensor of the same layout, not clone()d: torchao's NF4Tensor.clone()
        # dequantizes the whole weight and quantizes it again (~10x its fp32 size, and slow).
        if device == self.host.device:
            return torch.empty_like(self.host).copy_(self.host), None
        return self.host.to(device), None

    def prefetch(self, device: torch.device) -> None:
        """Start the copy :meth:`take` will use. One started inside backward is dropped when
        that backward ends if nothing took it (the first layer's weight, whose backward needs
        no input gradient): no copy waits through the optimizer step."""
        if self.pending is not None:
            return
        self.pending = (device, *self._copy(device))
        self.prefetches += 1
        if torch._C._current_graph_task_id() != -1:
            # the callback names the copy by its number: a closure holding the copy itself
            # would keep every copy made in backward alive until backward ends (the flagship
            # estimate saw it: all offloaded weights on the device at once)
            number = self.prefetches
            torch.autograd.Variable._execution_engine.queue_callback(lambda: self._drop(number))

    def _drop(self, number: int) -> None:
        if self.pending is not None and self.prefetches == number:
            self.pending = None

    def take(self, device: torch.device, backward: bool = False) -> torch.Tensor:
        if self.pending is not None and self.pending[0] == device:
            _, w, event = self.pending
        else:
            w, event = self._copy(device)
        self.pending = None
        if backward:
            self.backward_task = torch._C._current_graph_task_id()
        if event is not None:
            torch.cuda.current_stream(device).wait_event(event)
        if self.rows is not None:
            w = _gather_rows(w, self.rows, self.world, self.formats, self.group)
        if self.placed is not None:
            mesh, placements, shape = self.placed
            w = DTensor.from_local(w, mesh, placements, run_check=False, shape=shape,
                                   stride=(shape[1], 1))
        neighbour = self.following(backward)
        if neighbour is not None:
            neighbour.prefetch(device)
        return w

    def following(self, backward: bool) -> Offloaded | None:
        """The layer whose weight is wanted next, to prefetch: backward runs the layers
        reversed (``prev``); a forward runs them in order (``next``). A checkpointed block's
        forward run again inside backward (a recompute) wants ``next`` only when that layer's
        backward has not run yet in this backward pass: a layer with nothing saved for
        backward (a frozen layer without an adapter) runs its backward before the block is
        recomputed, and the blocks after this one are done."""
        if backward:
            return self.prev
        task = torch._C._current_graph_task_id()
        if task == -1:  # a forward pass proper
            return self.next
        return self.next if self.next is not None and self.next.backward_task != task else None


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


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
    world = process_world_size()
    chain: list[Offloaded] = []
    for layer in chosen:
        whole = layer.weight.detach()
        del layer._parameters["weight"]
        layer.weight = None  # a plain attribute now: not a parameter, not in the state dict
        rows = whole.shape[0] if world > 1 else None
        layer.offload = Offloaded(whole, formats, rows, world, layer.name)
        if rows is not None and not whole.is_meta:
            layer.offload.set_host(formats.take_rows(whole, *layer.offload.shard_range()))
        del whole
        chain.append(layer.offload)
    for a, b in zip(chain, chain[1:]):
        a.next, b.prev = b, a
    if chosen and not any(layer.offload.host.is_meta for layer in chosen):
        pack_offloaded(chosen, device)
    return chosen


def _inner(t: torch.Tensor) -> tuple[list[str], object]:
    return t.__tensor_flatten__() if hasattr(t, "__tensor_flatten__") else ([], None)


def pack_offloaded(layers: list[nn.Module], device: torch.device | str,
                   release: Callable[[], None] | None = None) -> int:
    """Move every offloaded shard's bytes into one exact-size host buffer (pinned in place
    with ``cudaHostRegister`` when ``device``, the run's, is a GPU, once filled:
    :class:`HostPin`, which says once when the host refuses); its size in bytes. A layer's old
    tensors are dropped as soon as its bytes are in the buffer, whose pages become resident
    only as they are filled, so the move holds the buffer plus one layer, not two copies of
    every offloaded weight (``release``, when given, runs after each layer: the loader hands
    freed memory back to the OS with it). Packing again (tensor parallelism cut the shards
    anew) unregisters the old buffer before the layers let go of it (and before the new one is
    filled)."""
    hosts = [layer.offload for layer in layers if layer.offload is not None]
    for old in {id(o.pin): o.pin for o in hosts if o.pin is not None}.values():
        old.unpin()  # a re-pack: unregistered first, then freed (now, unless a host views it)
    for o in hosts:
        o.buffer = o.pin = None
    align = 64

    def padded(t: torch.Tensor) -> int:
        return -(-t.nbytes // align) * align

    total = sum(padded(getattr(o.host, n)) for o in hosts for n in _inner(o.host)[0])
    buffer = torch.empty(total, dtype=torch.uint8)
    at = 0
    for o in hosts:
        names, meta = _inner(o.host)
        o.buffer = buffer  # keeps it alive
        if not names:
            continue
        views = {}
        for n in names:
            t = getattr(o.host, n)
            views[n] = buffer[at:at + t.nbytes].view(t.dtype).view(t.shape)
            views[n].copy_(t)
            at += padded(t)
        del t
        o.host = type(o.host).__tensor_unflatten__(views, meta, o.host.shape, o.host.stride())
        if release is not None:
            release()
    pin = HostPin(buffer, device)  # holds the buffer: unregistered before it can be freed
    for o in hosts:
        o.pin = pin
    return total
