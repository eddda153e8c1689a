"""``memory_monitor``: memory of this process, logged every ``interval`` batches.

On a GPU (keys in GiB): ``memory/allocated_gib`` (tensors), ``memory/reserved_gib`` (held by
torch's caching allocator) and ``memory/peak_allocated_gib`` (the most allocated since the
run started). On CPU: ``memory/rss_gib`` (resident set size) and ``memory/peak_rss_gib``
(the most resident since the process started, from getrusage). Rank 0's numbers reach the
loggers (Composer's loggers write on rank 0)::

    callbacks:
      memory_monitor:
        interval: 1      # batches between readings
"""

from __future__ import annotations

import resource
import sys

from composer.core import Callback, State
from composer.loggers import Logger

from foundryx.errors import ConfigError

GIB = 2**30


def gpu_memory(device: object = None) -> dict[str, float]:
    """allocated, reserved and peak allocated GiB of a CUDA/ROCm device."""
    import torch

    return {
        "memory/allocated_gib": torch.cuda.memory_allocated(device) / GIB,
        "memory/reserved_gib": torch.cuda.memory_reserved(device) / GIB,
        "memory/peak_allocated_gib": torch.cuda.max_memory_allocated(device) / GIB,
    }


def cpu_memory() -> dict[str, float]:
    """RSS and peak RSS of this process in GiB."""
    import psutil  # a Composer requirement

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    peak_bytes = peak if sys.platform == "darwin" else peak * 1024  # Linux reports KiB
    return {"memory/rss_gib": psutil.Process().memory_info().rss / GIB,
            "memory/peak_rss_gib": peak_bytes / GIB}


class MemoryMonitor(Callback):
    """A Composer callback (see the module docstring)."""

    def __init__(self, interval: int = 1):
        if isinstance(interval, bool) or not isinstance(interval, int) or interval < 1:
            raise ConfigError(f"callbacks.memory_monitor.interval: {interval!r}; use a positive "
                              "number of batches")
        self.interval = interval

    def fit_start(self, state: State, logger: Logger) -> None:
        if state.device.name == "gpu":
            import torch

            torch.cuda.reset_peak_memory_stats()

    def batch_end(self, state: State, logger: Logger) -> None:
        if int(state.timestamp.batch) % self.interval == 0:
            logger.log_metrics(self.read(state))

    @staticmethod
    def read(state: State) -> dict[str, float]:
        return gpu_memory() if state.device.name == "gpu" else cpu_memory()
