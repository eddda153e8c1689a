"""What a standalone eval uses of Composer's device, rank and precision helpers, without
importing Composer when the eval runs in one process.

``foundryx eval`` on one process needs none of Composer's machinery: moving the model and the
batches to one device, seeding, and an autocast context. Importing Composer for them costs
~1 s of the command's start (with torchmetrics, torch.distributed.checkpoint and mcli), and
LLM Foundry's users time the whole command. With several processes (``composer -n N
eval/eval.py``) the eval keeps Composer's ``dist`` and devices, which set up the process group.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Iterator, Mapping
from typing import Any

import torch

# the precisions this module autocasts as Composer's get_precision_context does; the rest
# (amp_fp8) go to Composer's
_AUTOCAST = {"amp_bf16": torch.bfloat16, "amp_fp16": torch.float16}


def launched_world_size() -> int:
    """The number of processes this eval was launched with (``WORLD_SIZE``; 1 without)."""
    return int(os.environ.get("WORLD_SIZE", "1") or 1)


def rank_and_world() -> tuple[int, int]:
    """(this process's rank, the number of processes) of the default process group; (0, 1)
    when there is none."""
    import torch.distributed as tdist

    if tdist.is_available() and tdist.is_initialized():
        return tdist.get_rank(), tdist.get_world_size()
    return 0, 1


class LocalDevice:
    """One process's device with the calls the eval makes on a Composer ``Device``:
    ``name`` (``cpu`` or ``gpu``), ``module_to_device`` and ``batch_to_device`` (tensors in
    nested dicts, lists and tuples; anything else as it is)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.name = "gpu" if device.type == "cuda" else device.type
        if device.type == "cuda":
            torch.cuda.set_device(device)

    def module_to_device(self, module: Any) -> Any:
        return module.to(self.device)

    def batch_to_device(self, batch: Any) -> Any:
        if isinstance(batch, torch.Tensor):
            return batch.to(self.device, non_blocking=True)
        if isinstance(batch, Mapping):
            return {k: self.batch_to_device(v) for k, v in batch.items()}
        if type(batch) in (list, tuple):
            return type(batch)(self.batch_to_device(v) for v in batch)
        return batch


def seed_all(seed: int) -> None:
    """Python's, numpy's and torch's generators (every GPU's too), as Composer's
    ``reproducibility.seed_all``."""
    import numpy as np

    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    if torch.cuda.is_available():
        torch.cuda.manual_seed_all(seed)


@contextlib.contextmanager
def precision_context(precision: str) -> Iterator[None]:
    """Composer's ``get_precision_context(precision)``: fp32 with autocast off on a GPU,
    amp_bf16 / amp_fp16 autocast on a GPU, nothing on a CPU; other precisions through
    Composer's own (a heavy import, only for them)."""
    cuda = torch.cuda.is_available()
    if precision == "fp32":
        with torch.autocast("cuda", enabled=False) if cuda else contextlib.nullcontext():
            yield
    elif precision in _AUTOCAST:
        with torch.autocast("cuda", dtype=_AUTOCAST[precision]) if cuda else \
                contextlib.nullcontext():
            yield
    else:
        from composer.core.precision import get_precision_context  # Composer: fp8 and beyond

        with get_precision_context(precision):
            yield
