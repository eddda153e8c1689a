"""The device a run uses (:func:`pick_device`), the one place it is picked: the config's
``device``, else a GPU when there is one, said in one line. Everything else that needs the
run's device (Composer's device, the frozen base's storage and pinning, FSDP2, the FP8 GEMM
path) asks here or is handed its answer. What a device can do (peak FLOP/s, bf16, FP8 tensor
cores) is :mod:`foundryx.runtime.devices`; which settings a machine can run,
:mod:`foundryx.config.hardware`.

Imports nothing of foundryx: any part may use it.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

log = logging.getLogger("foundryx")


def pick_device(requested: str | None = None, *, say: bool = False) -> torch.device:
    """The run's device as torch names it: ``requested`` ``"cpu"`` is the CPU whatever the
    machine has (CUDA is never initialised); ``"gpu"``, or None on a machine with a GPU, the
    current GPU (``cuda:N``; Composer sets each rank's); None without a GPU, the CPU. With
    ``say``, logs one line when foundryx chose (the entry points' call, once per run)."""
    import torch  # here, not at the top: the CLI sets up logging without loading torch

    if requested == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        if requested is None and say:
            log.info("device: cpu (none set in the config; no GPU found)")
        # "gpu" without one: the machine check (foundryx.config.hardware) refused it already
        return torch.device("cpu") if requested is None else torch.device("cuda")
    if requested is None and say:
        log.info("device: gpu (none set in the config; a GPU is available)")
    return torch.device("cuda", torch.cuda.current_device())


def composer_name(device: torch.device) -> str:
    """Composer's name of ``device`` (``composer.utils.get_device``): ``gpu`` or ``cpu``."""
    return "gpu" if device.type == "cuda" else device.type
