"""The device a run uses when its config names none (:func:`pick_device`): a GPU when there is
one, said in one line. What a device can do (peak FLOP/s, whether a config's device and
precision can run here) is :mod:`foundryx.runtime.devices`.

Imports nothing of foundryx: any part may use it.
"""

from __future__ import annotations

import logging

log = logging.getLogger("foundryx")


def pick_device(requested: str | None) -> str:
    """The device to run on (``gpu`` or ``cpu``): ``requested``, else a GPU when there is
    one; logs one line when foundryx chose it."""
    if requested:
        return requested
    import torch  # here, not at the top: the CLI sets up logging without loading torch

    device = "gpu" if torch.cuda.is_available() else "cpu"
    log.info("device: %s (none set in the config; %s)", device,
             "a GPU is available" if device == "gpu" else "no GPU found")
    return device
