"""A logger that appends every logged metric to a JSON-lines file (rank 0 only), and keeps the
run's hyperparameters (its resolved config, its environment, Composer's own) in ``run.json``
beside it: the two files ``foundryx report`` reads."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

from composer.core import State
from composer.loggers import Logger, LoggerDestination
from composer.utils import dist

from foundryx.loggers.files import RUN_FILE, read_hyperparameters, read_metrics
from foundryx.loggers.steps import BatchNumbered

__all__ = ["JSONLLogger", "read_hyperparameters", "read_metrics"]


class JSONLLogger(BatchNumbered, LoggerDestination):
    """Write ``{"batch": N, "metric": value, ...}`` lines to ``path``, N the number of the batch
    the values belong to, 1..N as the console prints it (the loss of the first batch: 1; see
    foundryx.loggers.steps); 0 for what comes before the first batch (an eval_first eval).

    ``path`` may contain ``{run_name}``. Lines are flushed as they are written, so a crashed
    run keeps every metric logged before the crash. Hyperparameters (``log_hyperparameters``:
    ``foundryx train`` logs ``foundryx/config`` and ``foundryx/environment``) go to
    ``run.json`` in the same folder, rewritten whole (atomically) when more arrive.

    Nothing is written before the run starts (``fit()`` or a standalone ``eval()``): what is
    logged while the Trainer is built waits in memory, so a run that stops before its first
    batch (a missing ``load_path``, a checkpoint that does not fit) leaves the folder, and
    the previous run's ``run.json`` and metrics, as they were.
    """

    def __init__(self, path: str = "runs/{run_name}/metrics.jsonl"):
        self.path_template = path
        self.path: Path | None = None
        self._file = None
        self._batch = 0
        self._hparams: dict[str, Any] = {}
        self._waiting: list[dict[str, Any]] | None = None  # rows logged before the run started

    def init(self, state: State, logger: Logger) -> None:
        if dist.get_global_rank() != 0:
            return
        self.path = Path(self.path_template.format(run_name=state.run_name))
        self._waiting = []  # nothing touches the folder until the run starts (_start)

    def fit_start(self, state: State, logger: Logger) -> None:
        self._start()

    def eval_standalone_start(self, state: State, logger: Logger) -> None:
        self._start()  # `trainer.eval()` before fit (eval_first)

    def _start(self) -> None:
        """Open the metrics file and write ``run.json`` (rank 0, once): the run has started."""
        if self._file is not None or self.path is None:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")
        for row in self._waiting or ():
            self._file.write(json.dumps(row) + "\n")
        self._file.flush()
        self._waiting = None
        self._write_hparams()

    def log_hyperparameters(self, hyperparameters: dict[str, Any]) -> None:
        self._hparams.update(hyperparameters)
        self._write_hparams()

    def _write_hparams(self) -> None:
        if self._file is None or not self._hparams:
            return  # before the run started, or not rank 0
        text = json.dumps({"hyperparameters": self._hparams}, indent=1, default=str)
        path = self.path.parent / RUN_FILE
        tmp = path.with_name(f".{RUN_FILE}.tmp-{os.getpid()}")
        tmp.write_text(text + "\n", encoding="utf-8")
        os.replace(tmp, path)  # readers see the old file or the new one, never a part

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if self._file is None and self._waiting is None:
            return  # not rank 0 (or closed)
        row: dict[str, Any] = {"batch": self.batch_number(step)}
        for k, v in metrics.items():
            v = v.item() if hasattr(v, "item") else v
            if isinstance(v, (int, float)) and math.isfinite(v):
                row[k] = v
        if self._file is None:
            self._waiting.append(row)
            return
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self, state: State, logger: Logger) -> None:
        self._waiting = None  # a run that never started writes nothing
        if self._file is not None:
            self._file.close()
            self._file = None

