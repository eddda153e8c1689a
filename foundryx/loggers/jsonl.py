"""A logger that appends every logged metric to a JSON-lines file (rank 0 only)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from composer.core import State
from composer.loggers import Logger, LoggerDestination
from composer.utils import dist


class JSONLLogger(LoggerDestination):
    """Write ``{"batch": N, "metric": value, ...}`` lines to ``path``.

    ``path`` may contain ``{run_name}``. Lines are flushed as they are written, so a crashed
    run keeps every metric logged before the crash.
    """

    def __init__(self, path: str = "runs/{run_name}/metrics.jsonl"):
        self.path_template = path
        self.path: Path | None = None
        self._file = None
        self._batch = 0

    def init(self, state: State, logger: Logger) -> None:
        if dist.get_global_rank() != 0:
            return
        self.path = Path(self.path_template.format(run_name=state.run_name))
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        if self._file is None:
            return
        row: dict[str, Any] = {"batch": step}
        for k, v in metrics.items():
            v = v.item() if hasattr(v, "item") else v
            if isinstance(v, (int, float)) and math.isfinite(v):
                row[k] = v
        self._file.write(json.dumps(row) + "\n")
        self._file.flush()

    def close(self, state: State, logger: Logger) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The rows a JSONLLogger wrote."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
