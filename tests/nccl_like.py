"""A process-group backend that behaves as NCCL does on the device boundary, for CPU ranks:
registered for ``cuda`` tensors only, so a host (CPU) tensor given to a group made with it alone
fails as on a GPU node ("No backend type associated with device type cpu"), and a group made as
a GPU run makes its own (``cpu:gloo,cuda:nccl_like``) routes host tensors to gloo. Underneath it
is gloo: no GPU is needed to register it, and none is used.

``tests/distributed.py`` registers it in each rank when the backend string names it.
"""

from __future__ import annotations

import torch.distributed as tdist

NAME = "nccl_like"


def _create(store, rank: int, size: int, timeout):
    return tdist.ProcessGroupGloo(store, rank, size, timeout)


def register() -> None:
    """Register the backend under :data:`NAME` (once per process) for CUDA devices only."""
    if NAME.upper() not in tdist.Backend.__dict__:
        tdist.Backend.register_backend(NAME, _create, devices=["cuda"])
