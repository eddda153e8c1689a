"""The host-to-device copy of an offloaded weight: on a GPU, made on a side stream (one per
device) and finished by an event the compute stream waits on before it reads the copy; on the
CPU, a real copy made at once."""

from __future__ import annotations

import torch

_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream offloaded weights are copied on to ``device`` (made once)."""
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


def copy_to(host: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, object]:
    """``host`` copied to ``device``, and the event the copy is done at (None: done now)."""
    if device.type == "cuda":
        stream = copy_stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):
            w = host.to(device, non_blocking=True)
        event = torch.cuda.Event()
        event.record(stream)
        return w, event
    # On CPU "the device" is host memory too: still a real copy, dropped after use. Copied
    # into an empty tensor of the same layout, not clone()d: torchao's NF4Tensor.clone()
    # dequantizes the whole weight and quantizes it again (~10x its fp32 size, and slow).
    if device == host.device:
        return torch.empty_like(host).copy_(host), None
    return host.to(device), None


def wait_for(event: object, device: torch.device) -> None:
    """Make ``device``'s compute stream wait for a copy's ``event`` (None: nothing to wait)."""
    if event is not None:
        torch.cuda.current_stream(device).wait_event(event)
