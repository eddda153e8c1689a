"""A logger destination whose backend opens when training (or a first eval) starts, after the
checkpoint is loaded, so a resumed run knows its batch before it writes; what is logged before
then (the hyperparameters, Composer's first numbers) is kept and written when it opens. Only
rank 0 writes unless ``rank_zero_only`` is false."""

from __future__ import annotations

from typing import Any

from composer.core import State
from composer.loggers import Logger, LoggerDestination
from composer.utils import dist

from foundryx.loggers.steps import BatchNumbered


class DeferredDestination(BatchNumbered, LoggerDestination):
    """Subclasses set ``self.options`` (with ``rank_zero_only``) and implement ``opened``,
    ``_open(state)`` and ``_write(kind, data, step)``, kind ``hyperparameters`` or ``metrics``;
    ``step`` is the batch's number, 1..N (foundryx.loggers.steps)."""

    def __init__(self) -> None:
        self._enabled = False
        self._pending: list[tuple[str, dict[str, Any], int | None]] = []

    @property
    def opened(self) -> bool:
        raise NotImplementedError

    def _open(self, state: State) -> None:
        raise NotImplementedError

    def _write(self, kind: str, data: dict[str, Any], step: int | None) -> None:
        raise NotImplementedError

    def init(self, state: State, logger: Logger) -> None:
        self._enabled = not self.options.rank_zero_only or dist.get_global_rank() == 0

    def fit_start(self, state: State, logger: Logger) -> None:
        self._begin(state)

    def eval_start(self, state: State, logger: Logger) -> None:
        self._begin(state)

    def _begin(self, state: State) -> None:
        if not self._enabled or self.opened:
            return
        self._open(state)
        for kind, data, step in self._pending:
            self._write(kind, data, step)
        self._pending = []

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        self._log("hyperparameters", hyperparameters, None)

    def log_metrics(self, metrics: dict[str, Any], step: int | None = None) -> None:
        self._log("metrics", metrics, self.batch_number(step))

    def _log(self, kind: str, data: dict[str, Any], step: int | None) -> None:
        if not self._enabled:
            return
        if self.opened:
            self._write(kind, data, step)
        else:
            self._pending.append((kind, dict(data), step))


def scalars(data: dict[str, Any]) -> dict[str, float | int]:
    """The numbers of ``data`` (one-element tensors as Python numbers; NaN and inf kept: they
    say when a run diverged)."""
    out = {}
    for k, v in data.items():
        numel = getattr(v, "numel", None)  # a tensor's; a numpy value's is its size
        size = numel() if callable(numel) else getattr(v, "size", 1)
        if hasattr(v, "item") and size == 1:
            v = v.item()
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = v
    return out
