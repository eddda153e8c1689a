"""The default process group's backends: the device's own (NCCL, RCCL) for device tensors and
gloo for host tensors (:func:`process_group_backend`), set on Composer's device before the group
is made (:func:`with_host_collectives`).

Imports nothing of foundryx but :mod:`foundryx.errors`: any part may use it.
"""

from __future__ import annotations

import logging
from typing import Any

from foundryx.errors import ConfigError

log = logging.getLogger("foundryx")


HOST_BACKEND = "gloo"  # the collectives on host (CPU) tensors, beside the device's own


def process_group_backend(device_backend: str, device_type: str = "cuda") -> str:
    """The default process group's backend for a run whose device collectives go through
    ``device_backend`` (``nccl``; RCCL on ROCm answers to the same name): that backend for
    ``device_type`` tensors and gloo for host tensors, ``cpu:gloo,cuda:nccl`` (the string torch's
    distributed checkpointing uses). NCCL takes CUDA tensors only, and some collectives run on
    host memory on a GPU node (the NF4 block maxima of offloaded rows, the tensor-parallel re-cut
    of offloaded weights); every sub-group (device-mesh dimensions, ``new_group``) inherits the
    pair. A CPU run's ``gloo`` (or an already mixed string) is returned as it is."""
    if device_backend in ("", "gloo", "xla") or ":" in device_backend:
        return device_backend
    return f"cpu:{HOST_BACKEND},{device_type}:{device_backend}"


def with_host_collectives(device: Any, world_size: int) -> Any:
    """``device`` (a Composer ``Device``) set to create the default process group with
    :func:`process_group_backend`, said in one line; Composer's ``initialize_dist`` and the
    trainer read ``device.dist_backend``. :class:`~foundryx.errors.ConfigError` when this torch
    build cannot make that group on a multi-GPU run (no NCCL/RCCL, no gloo): said with the
    fix, before anything is built."""
    backend = getattr(device, "dist_backend", "")
    mixed = process_group_backend(backend)
    if mixed == backend or world_size <= 1:
        return device
    import torch.distributed as tdist  # here, not at the top: the CLI loads this without torch

    missing = []
    if backend == "nccl" and not tdist.is_nccl_available():
        missing.append(backend)
    if not tdist.is_gloo_available():
        missing.append(HOST_BACKEND)
    if missing:
        raise ConfigError([f"device: this torch build has no {' and no '.join(missing)} backend, "
                           f"which a {world_size}-process GPU run needs ({mixed}: {backend} for GPU "
                           "tensors, gloo for host tensors); install a CUDA or ROCm build of torch "
                           "from pytorch.org (RCCL comes with the ROCm build)"])
    device.dist_backend = mixed
    log.info("process group: %s (%s for GPU tensors; gloo for host tensors: offloaded and NF4 "
             "weights' collectives on load)", mixed, backend)
    return device
