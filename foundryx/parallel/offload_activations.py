"""Offloaded activations (``activation_checkpointing.cpu_offload``), applied from outside the
model: what a block's forward saves for backward is kept in host memory, pinned on a GPU. With
activation checkpointing that is each block's input only (the checkpoint saves its inputs
through the hooks around it, PyTorch's non-reentrant ``checkpoint``); without, everything the
block saves.

The copies overlap compute (as torchtune's and ALST's offloaded checkpoints do). On a GPU each
device-to-host copy runs on a side stream after an event of the compute stream, and the device
tensor is handed to the caching allocator with ``record_stream``, so its memory is reused only
once the copy is done; the compute stream goes on with the next block meanwhile. In backward,
taking a tensor back starts the host-to-device copy of the one saved before it (the previous
block's, whose recompute comes next) on the side stream, and the compute stream waits only
for the copy it reads. At most two blocks' inputs are on the device at once.

Without checkpointing, tensors below ``min_bytes`` (1 MiB: masks, scales, a norm's per-token
statistics) stay where they are: their copies would cost more than they hold; with it, every
block input goes (``parallelize`` sets 0). Parameters always stay. On a CPU device
the host copy is a real copy (so the path runs in CPU tests), made at once.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any

import torch
from torch import nn

from foundryx.parallel.offload_copy import copy_stream

MIN_BYTES = 2**20


class _Saved:
    """One offloaded tensor: its host copy, the event its device-to-host copy is done at, and
    the device copy being brought back (prefetched), if any."""

    __slots__ = ("host", "device", "done", "back", "back_done", "index", "__weakref__")

    def __init__(self, host: torch.Tensor, device: torch.device, done: Any, index: int) -> None:
        self.host, self.device, self.done, self.index = host, device, done, index
        self.back: torch.Tensor | None = None
        self.back_done: Any = None


class ActivationOffload:
    """``saved_tensors_hooks`` pack/unpack that keep saved tensors in host memory (see the
    module doc); one per model, shared by its blocks so that backward can prefetch across
    them."""

    def __init__(self, device: torch.device | str, pin: bool, min_bytes: int = MIN_BYTES) -> None:
        self.device = torch.device(device)
        self.pin, self.min_bytes = pin, min_bytes
        self.saved: list[weakref.ref] = []  # this forward's, in order
        self.taken = False  # a tensor was taken back since the last save: a new forward starts
        self.offloaded_bytes = 0  # this forward's bytes in host memory (tests, the plan)

    # -- forward: to the host ----------------------------------------------------------------
    def pack(self, t: torch.Tensor) -> Any:
        if isinstance(t, nn.Parameter) or t.nbytes < self.min_bytes or t.device.type == "meta" \
                or type(t) is not torch.Tensor and not _is_fake(t):
            return t
        if self.taken:
            self.saved, self.taken, self.offloaded_bytes = [], False, 0
        host, done = self._to_host(t)
        entry = _Saved(host, t.device, done, len(self.saved))
        self.saved.append(weakref.ref(entry))
        self.offloaded_bytes += t.nbytes
        return entry

    def _to_host(self, t: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """``t``'s host copy and the event it is done at (None: done now)."""
        host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=self.pin)
        if t.device.type != "cuda":
            return host.copy_(t), None
        stream = copy_stream(t.device)
        stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(stream):
            host.copy_(t, non_blocking=True)
            t.record_stream(stream)  # its memory is reused only after the copy
        done = torch.cuda.Event()
        done.record(stream)
        return host, done

    # -- backward: back to the device ------------------------------------------------------
    def unpack(self, entry: Any) -> torch.Tensor:
        if not isinstance(entry, _Saved):
            return entry
        self.taken = True
        self._bring_back(entry)
        if entry.index > 0:  # the one saved before it is needed next: its copy starts now
            before = self.saved[entry.index - 1]() if entry.index - 1 < len(self.saved) else None
            if before is not None:
                self._bring_back(before)
        t, done = entry.back, entry.back_done
        entry.back = entry.back_done = None
        if done is not None:
            torch.cuda.current_stream(t.device).wait_event(done)
            t.record_stream(torch.cuda.current_stream(t.device))
        return t

    def _bring_back(self, entry: _Saved) -> None:
        if entry.back is not None:
            return
        entry.back, entry.back_done = self._to_device(entry)

    def _to_device(self, entry: _Saved) -> tuple[torch.Tensor, Any]:
        """``entry``'s device copy and the event it is done at (None: done now)."""
        if entry.device.type != "cuda":
            return torch.empty(entry.host.shape, dtype=entry.host.dtype,
                               device=entry.device).copy_(entry.host), None
        stream = copy_stream(entry.device)
        if entry.done is not None:
            stream.wait_event(entry.done)
        with torch.cuda.stream(stream):
            t = entry.host.to(entry.device, non_blocking=True)
        done = torch.cuda.Event()
        done.record(stream)
        return t, done

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)


def _is_fake(t: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor  # a fake step traces through here

    return isinstance(t, FakeTensor)


def offload_activations(module: nn.Module, offload: ActivationOffload) -> None:
    """Keep what ``module``'s forward saves for backward in host memory through ``offload``
    (wrapped around a checkpoint wrapper: the checkpoint's inputs)."""
    inner = module.forward

    @functools.wraps(inner)
    def forward(*args: Any, **kwargs: Any) -> Any:
        with offload.hooks():
            return inner(*args, **kwargs)

    module.forward = forward
    module._foundryx_activation_offload = offload
