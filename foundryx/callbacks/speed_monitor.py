"""``speed_monitor``: tokens/s, samples/s, FLOP/s and MFU.

Composer's SpeedMonitor (the same ``throughput/...`` and ``time/...`` keys, over a rolling
window of batches) with the device's peak taken from foundryx's one table,
:mod:`foundryx.runtime.devices`, for the run's precision. MFU is ``throughput/device/mfu`` =
the model's ``flops_per_batch`` per second per device / that peak. Where there is no peak it
says why once and logs no MFU: on CPU (no CPU peak in the table: MFU is a GPU measure), on a
device or precision the table lacks (one warning), or give the number yourself::

    callbacks:
      speed_monitor:
        window_size: 10          # batches in the rolling average
        peak_flops: 4.5e14       # optional: peak dense FLOP/s of one device, overrides the table
"""

from __future__ import annotations

import logging

from composer.callbacks import SpeedMonitor as ComposerSpeedMonitor
from composer.core import State
from composer.loggers import Logger

from foundryx.errors import ConfigError
from foundryx.runtime import devices

log = logging.getLogger(__name__)


class SpeedMonitor(ComposerSpeedMonitor):
    """Args: ``window_size`` (batches averaged), ``peak_flops`` (peak dense FLOP/s of one
    device; none: from :mod:`foundryx.runtime.devices`), ``time_unit`` (of ``time/...``: seconds,
    minutes, hours or days)."""

    def __init__(self, window_size: int = 100, peak_flops: float | None = None,
                 time_unit: str = "hours"):
        problems = []
        if not isinstance(window_size, int) or isinstance(window_size, bool) or window_size < 1:
            problems.append(f"callbacks.speed_monitor.window_size: {window_size!r}; use a "
                            "positive number of batches")
        if peak_flops is not None and (isinstance(peak_flops, bool)
                                       or not isinstance(peak_flops, (int, float)) or peak_flops <= 0):
            problems.append(f"callbacks.speed_monitor.peak_flops: {peak_flops!r}; use a positive "
                            "number of FLOP/s, e.g. 9.89e14")
        if time_unit not in ("seconds", "minutes", "hours", "days"):
            problems.append(f"callbacks.speed_monitor.time_unit: {time_unit!r}; use one of "
                            "seconds, minutes, hours, days")
        if problems:
            raise ConfigError(problems)
        super().__init__(window_size=window_size, gpu_flops_available=peak_flops,
                         time_unit=time_unit)

    def init(self, state: State, logger: Logger) -> None:
        if self.gpu_flops_available is None:
            self.gpu_flops_available = device_peak(state) or 0  # 0: Composer logs no MFU


def device_peak(state: State) -> float | None:
    """Peak dense FLOP/s of this run's device at its precision, or None (said once why)."""
    import torch

    if state.device.name != "gpu" or not torch.cuda.is_available():
        log.info("MFU: not reported on %s (the device table has GPU peaks only; tokens/s "
                 "is the measure here)", state.device.name)
        return None
    name, precision = torch.cuda.get_device_name(), state.precision.value
    peak = devices.peak_flops(name, precision)
    if peak is not None:
        log.info("MFU: against %.0f TFLOP/s, the %s %s peak of %s (foundryx/runtime/devices.py)",
                 peak / 1e12, devices.find_device(name).key,
                 devices.PRECISION_DTYPE.get(precision, precision), name)
    return peak
