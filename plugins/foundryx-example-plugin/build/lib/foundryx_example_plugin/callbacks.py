"""A callback that counts training batches and writes the count when training ends."""

from __future__ import annotations

import json
from pathlib import Path

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist


class BatchCounter(Callback):
    """Count ``batch_end`` events; on ``fit_end`` write ``{"batches": N}`` to ``out_path``."""

    def __init__(self, out_path: str = "batch_counter.json"):
        self.out_path = Path(out_path)
        self.batches = 0

    def batch_end(self, state: State, logger: Logger) -> None:
        self.batches += 1

    def fit_end(self, state: State, logger: Logger) -> None:
        if dist.get_global_rank() == 0:
            self.out_path.parent.mkdir(parents=True, exist_ok=True)
            self.out_path.write_text(json.dumps({"batches": self.batches}))
