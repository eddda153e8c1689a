"""``memory_monitor``: memory of this process, logged every ``interval`` batches.

On a GPU (keys in GiB): ``memory/allocated_gib`` (tensors), ``memory/reserved_gib`` (held by
torch's caching allocator) and ``memory/peak_allocated_gib`` (the most allocated since the
run started). On CPU: ``memory/rss_gib`` (resident set size) and ``memory/peak_rss_gib``
(the most resident since the process started, from getrusage). Rank 0's numbers reach the
loggers (Composer's loggers write on rank 0). Host memory per rank, on any device:
``memory/host_rss_gib/rank<r>`` and ``memory/host_peak_gib/rank<r>`` for every rank, and
``memory/host_peak_gib_max``, the largest rank's peak: the figure ``foundryx plan`` gives as
host memory per rank (one small all-gather of the ranks' readings per interval)::

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


def host_per_rank(mine: dict[str, float] | None = None) -> dict[str, float]:
    """Every rank's host RSS and peak RSS in GiB, and the largest peak (see the module's
    docstring), from each rank's :func:`cpu_memory` (``mine``: this rank's, when already read).
    A collective: every rank calls it at the same batch."""
    from composer.utils import dist

    mine = mine or cpu_memory()
    reading = (mine["memory/rss_gib"], mine["memory/peak_rss_gib"])
    ranks = dist.all_gather_object(reading) if dist.get_world_size() > 1 else [reading]
    out = {}
    for r, (rss, peak) in enumerate(ranks):
        out[f"memory/host_rss_gib/rank{r}"] = rss
        out[f"memory/host_peak_gib/rank{r}"] = peak
    out["memory/host_peak_gib_max"] = max(peak for _, peak in ranks)
    return out


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
            host = cpu_memory()  # read once: on CPU it is also the device's reading
            device = gpu_memory() if state.device.name == "gpu" else host
            logger.log_metrics({**device, **host_per_rank(host)})

    @staticmethod
    def read(state: State) -> dict[str, float]:
        return gpu_memory() if state.device.name == "gpu" else cpu_memory()
