"""The few collective helpers foundryx.parallel and the pretrained loader need, over
torch.distributed; each also works in a single process without a process group."""

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


def all_gather_rows(part: torch.Tensor, start: int, group: Any = None) -> torch.Tensor:
    """The whole of a 1-D tensor split by ranges over ``group``'s ranks, in order: each rank
    sends its ``part`` and where it starts (``start``), and each range is taken once, in the
    order of the starts (ranks that hold the same range, replicas or a tensor-parallel group,
    send it alike). ``part`` itself when ``group`` is None or has one rank. Two all-gathers on
    ``part``'s device: a host ``part`` needs a group that carries host tensors."""
    if group is None or tdist.get_world_size(group) <= 1:
        return part
    n = tdist.get_world_size(group)
    parts = [torch.empty_like(part) for _ in range(n)]
    tdist.all_gather(parts, part, group=group)
    mine = torch.tensor([start], device=part.device)
    starts = [torch.empty_like(mine) for _ in range(n)]
    tdist.all_gather(starts, mine, group=group)
    first = {int(s): p for s, p in reversed(list(zip(starts, parts)))}
    return torch.cat([first[s] for s in sorted(first)])
