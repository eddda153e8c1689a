"""``console``: what a person reads while a run trains.

One line per ``log_interval``::

    batch   20/200  loss 5.2134  lr 3.00e-03  12.3k tok/s  mfu 41.2%  mem 1.1 GiB  eta 1m05s

(MFU only where the speed monitor knows the device's peak; memory from the memory monitor:
GPU allocated/reserved, else the process's RSS), a tqdm progress bar under it when the stream
is a terminal, and the eval results as a small table. ``level: debug`` also prints every
metric logged since the last line. Only rank 0 prints unless ``all_ranks: true``.

YAML (added for you when ``log_to_console: true``, the default, with ``console_log_interval``)::

    loggers:
      console:
        log_interval: 20ba
        level: info            # info | debug (debug: every metric too)
        progress_bar: null     # null: a bar when the stream is a terminal; true/false: always/never
        all_ranks: false
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from composer.core import State, Time, TimeUnit
from composer.loggers import Logger, LoggerDestination
from composer.utils import dist

from foundryx.errors import ConfigError

LEVELS = ("info", "debug")
STREAMS = ("stderr", "stdout")
LOSS_KEY = "loss/train/total"


def human(n: float) -> str:
    """12345 -> '12.3k'; 1.2e9 -> '1.2G'."""
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def duration(seconds: float) -> str:
    """75 -> '1m15s', 3700 -> '1h01m', 9 -> '9s'."""
    s = int(round(seconds))
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    if s >= 60:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s}s"


def _lr(metrics: dict[str, float]) -> float | None:
    """The first parameter group's learning rate (Composer's ``lr-<Optimizer>/group0``)."""
    keys = sorted(k for k in metrics if k.startswith("lr-"))
    return metrics[keys[0]] if keys else None


def _memory(metrics: dict[str, float]) -> str | None:
    if "memory/allocated_gib" in metrics:
        return (f"mem {metrics['memory/allocated_gib']:.1f}/"
                f"{metrics.get('memory/reserved_gib', 0.0):.1f} GiB")
    if "memory/rss_gib" in metrics:
        return f"rss {metrics['memory/rss_gib']:.2f} GiB"
    return None


def format_line(batch: int, total: int | None, metrics: dict[str, float],
                eta_s: float | None) -> str:
    """The one line of a log interval, from the metrics logged so far (absent ones are left
    out, so a run without the speed or memory monitor still gets loss and lr)."""
    width = len(str(total)) if total else 1
    parts = [f"batch {batch:>{width}}/{total}" if total else f"batch {batch}"]
    if LOSS_KEY in metrics:
        parts.append(f"loss {metrics[LOSS_KEY]:.4f}")
    lr = _lr(metrics)
    if lr is not None:
        parts.append(f"lr {lr:.2e}")
    if "throughput/tokens_per_sec" in metrics:
        parts.append(f"{human(metrics['throughput/tokens_per_sec'])} tok/s")
    elif "throughput/samples_per_sec" in metrics:
        parts.append(f"{metrics['throughput/samples_per_sec']:.1f} samples/s")
    if "throughput/device/mfu" in metrics:
        parts.append(f"mfu {100 * metrics['throughput/device/mfu']:.1f}%")
    mem = _memory(metrics)
    if mem:
        parts.append(mem)
    if eta_s is not None:
        parts.append(f"eta {duration(eta_s)}")
    return "  ".join(parts)


def format_eval_table(batch: int, metrics: dict[str, float]) -> str:
    """``metrics/<evaluator>/<metric>`` values as a small table, one row per metric."""
    rows = []
    for key in sorted(metrics):
        _, label, name = key.split("/", 2)
        rows.append((label, name, f"{metrics[key]:.4f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"eval at batch {batch}:"]
    lines += ["  " + "  ".join((r[0].ljust(widths[0]), r[1].ljust(widths[1]), r[2].rjust(widths[2])))
              for r in rows]
    return "\n".join(lines)


class ConsoleLogger(LoggerDestination):
    """See the module docstring. ``first_loss``, ``last_loss``, ``first_batch`` and
    ``train_seconds`` are kept for the run summary."""

    def __init__(self, log_interval: str = "10ba", level: str = "info",
                 progress_bar: bool | None = None, all_ranks: bool = False,
                 stream: str | TextIO = "stderr"):
        problems = []
        try:
            interval = Time.from_input(log_interval, TimeUnit.BATCH)
            if interval.unit != TimeUnit.BATCH or interval.value <= 0:
                raise ValueError("use a positive number of batches, e.g. 20ba")
        except (ValueError, TypeError) as e:
            problems.append(f"loggers.console.log_interval: {log_interval!r}: {e}")
            interval = None
        if level not in LEVELS:
            problems.append(f"loggers.console.level: {level!r}; use one of {', '.join(LEVELS)}")
        if isinstance(stream, str) and stream not in STREAMS:
            problems.append(f"loggers.console.stream: {stream!r}; use one of {', '.join(STREAMS)}")
        if problems:
            raise ConfigError(problems)
        self.interval = int(interval.value)
        self.level, self.all_ranks, self.want_bar = level, all_ranks, progress_bar
        self._stream = stream
        self.latest: dict[str, float] = {}
        self._since_line: dict[str, float] = {}
        self._eval: dict[str, float] = {}
        self._pending: int | None = None
        self._bar = None
        self.total: int | None = None
        self.first_loss: float | None = None
        self.last_loss: float | None = None
        self.first_batch: int | None = None
        self.train_seconds = 0.0
        self._t0: float | None = None
        self._eval_t0: float | None = None

    # -- output ---------------------------------------------------------------------------------
    @property
    def stream(self) -> TextIO:
        if not isinstance(self._stream, str):
            return self._stream
        return sys.stdout if self._stream == "stdout" else sys.stderr  # the current one

    @property
    def active(self) -> bool:
        return self.all_ranks or dist.get_global_rank() == 0

    def write(self, text: str) -> None:
        if not self.active:
            return
        if dist.get_world_size() > 1 and self.all_ranks:
            text = "\n".join(f"[rank{dist.get_global_rank()}] {t}" for t in text.splitlines())
        if self._bar is not None:
            self._bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)

    # -- metrics --------------------------------------------------------------------------------
    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        for key, value in metrics.items():
            value = value.item() if hasattr(value, "item") else value
            if not isinstance(value, (int, float)):
                continue
            self.latest[key] = float(value)
            self._since_line[key] = float(value)
            if key.startswith("metrics/") and key.count("/") >= 2 and "/train/" not in key + "/":
                self._eval[key] = float(value)
            if key == LOSS_KEY:
                if self.first_loss is None:
                    self.first_loss = float(value)
                self.last_loss = float(value)

    # -- events ---------------------------------------------------------------------------------
    def fit_start(self, state: State, logger: Logger) -> None:
        self.total = _total_batches(state)
        self.first_batch = int(state.timestamp.batch)
        self._t0 = time.monotonic()
        show = self.want_bar if self.want_bar is not None else _is_terminal(self.stream)
        if show and self.active and self.total:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=self.total, initial=self.first_batch, file=self.stream,
                             unit="ba", dynamic_ncols=True, leave=False)

    def batch_end(self, state: State, logger: Logger) -> None:
        batch = int(state.timestamp.batch)
        if self._bar is not None:
            self._bar.update(1)
        if batch % self.interval == 0 or (self.total and batch >= self.total):
            self._pending = batch  # printed once every BATCH_END callback has logged (speed)

    def eval_before_all(self, state: State, logger: Logger) -> None:
        self._flush_line()
        self._eval_t0 = time.monotonic()

    def eval_after_all(self, state: State, logger: Logger) -> None:
        if self._eval_t0 is not None and self._t0 is not None:
            self._t0 += time.monotonic() - self._eval_t0  # ETA counts training time only
        self._eval_t0 = None
        self._flush_eval(int(state.timestamp.batch))

    def eval_standalone_end(self, state: State, logger: Logger) -> None:
        self._flush_eval(int(state.timestamp.batch))

    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        self._flush_line()

    def fit_end(self, state: State, logger: Logger) -> None:
        self._flush_line()
        if self._t0 is not None:
            self.train_seconds = time.monotonic() - self._t0
        self._close_bar()

    def close(self, state: State, logger: Logger) -> None:
        self._close_bar()

    # -- helpers --------------------------------------------------------------------------------
    def _flush_line(self) -> None:
        if self._pending is None:
            return
        batch, self._pending = self._pending, None
        self.write(format_line(batch, self.total, self.latest, self._eta(batch)))
        if self.level == "debug":
            self.write("\n".join(f"  {k}: {v:.6g}" for k, v in sorted(self._since_line.items())))
        self._since_line = {}

    def _flush_eval(self, batch: int) -> None:
        if self._eval:
            self.write(format_eval_table(batch, self._eval))
        self._eval = {}

    def _eta(self, batch: int) -> float | None:
        if self.total is None or self._t0 is None or self.first_batch is None:
            return None
        done = batch - self.first_batch
        if done <= 0:
            return None
        return (time.monotonic() - self._t0) / done * max(self.total - batch, 0)

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def _total_batches(state: State) -> int | None:
    """max_duration in batches (None when it cannot be known, e.g. tokens on an unsized loader)."""
    duration_ = state.max_duration
    if duration_ is None:
        return None
    if duration_.unit == TimeUnit.BATCH:
        return int(duration_.value)
    if duration_.unit == TimeUnit.EPOCH and state.dataloader_len is not None:
        return int(duration_.value) * int(state.dataloader_len)
    return None


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
