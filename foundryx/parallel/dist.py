"""The few collective helpers foundryx.parallel needs, over torch.distributed; each also works
in a single process without a process group."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as tdist


def initialized() -> bool:
    return tdist.is_available() and tdist.is_initialized()


def rank() -> int:
    return tdist.get_rank() if initialized() else 0


def world_size() -> int:
    return tdist.get_world_size() if initialized() else 1


def local_world_size() -> int:
    """Processes on this node, as every launcher (composer, torchrun) sets it."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", world_size()))


def all_gather_object(obj: Any) -> list[Any]:
    if not initialized():
        return [obj]
    out: list[Any] = [None] * world_size()
    tdist.all_gather_object(out, obj)
    return out


def broadcast(tensor: torch.Tensor, src: int = 0) -> None:
    if initialized():
        tdist.broadcast(tensor, src=src)
