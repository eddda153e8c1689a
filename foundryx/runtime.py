"""Process set-up shared by the entry points (``foundryx train``, ``foundryx eval``,
``foundryx export``): log format and levels, and the device to run on.

It imports nothing of foundryx but :mod:`foundryx.errors`, so any part may use it.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("foundryx")


class _RankFilter(logging.Filter):
    """Adds ``record.rank`` (the ``RANK`` environment variable, 0 when unset)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = os.environ.get("RANK", "0")
        return True


def setup_logging(level: str | None) -> None:
    """Log ``foundryx`` and ``composer`` at ``level`` (e.g. ``info``) with time and rank;
    None or empty: leave logging as it is."""
    if not level:
        return
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s: rank%(rank)s: %(levelname)s: %(name)s: %(message)s"))
    handler.addFilter(_RankFilter())
    for name in ("foundryx", "composer"):
        lg = logging.getLogger(name)
        lg.setLevel(level.upper())
        if not lg.handlers:
            lg.addHandler(handler)
        lg.propagate = False


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
