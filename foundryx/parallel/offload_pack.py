"""The host storage of offloaded frozen weights: every offloaded shard's bytes moved into one
exact-size host buffer (``pack_offloaded``), pinned in place for a GPU run
(:class:`foundryx.parallel.pinning.HostPin`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from foundryx.parallel.pinning import HostPin

ALIGN = 64  # each tensor's bytes start at a multiple of this in the buffer


def inner_tensors(t: torch.Tensor) -> tuple[list[str], object]:
    """The names of a storage subclass's inner tensors and its metadata (none: a plain tensor)."""
    return t.__tensor_flatten__() if hasattr(t, "__tensor_flatten__") else ([], None)


def _padded(t: torch.Tensor) -> int:
    return -(-t.nbytes // ALIGN) * ALIGN


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
    total = sum(_padded(getattr(o.host, n)) for o in hosts for n in inner_tensors(o.host)[0])
    buffer = torch.empty(total, dtype=torch.uint8)
    at = 0
    for o in hosts:
        names, meta = inner_tensors(o.host)
        o.buffer = buffer  # keeps it alive
        if not names:
            continue
        views = {}
        for n in names:
            t = getattr(o.host, n)
            views[n] = buffer[at:at + t.nbytes].view(t.dtype).view(t.shape)
            views[n].copy_(t)
            at += _padded(t)
        del t
        o.host = type(o.host).__tensor_unflatten__(views, meta, o.host.shape, o.host.stride())
        if release is not None:
            release()
    pin = HostPin(buffer, device)  # holds the buffer: unregistered before it can be freed
    for o in hosts:
        o.pin = pin
    return total
