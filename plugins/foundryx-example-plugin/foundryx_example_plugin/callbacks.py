"""A callback that counts training batches and writes the count when training ends."""

from __future__ import annotations

import json
from pathlib import Path

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist


class BatchCounter(Callback):
    """Count ``batch_end`` events; on ``fit_end`` write ``{"batches": N}`` to ``out_path``
    (with ``record_shapes``, also ``"shapes"``: each batch's ``input_ids`` shape as the model
    saw it, e.g. to watch sequence-length warmup)."""

    def __init__(self, out_path: str = "batch_counter.json", record_shapes: bool = False):
        self.out_path = Path(out_path)
        self.record_shapes = record_shapes
        self.batches = 0
        self.shapes: list[list[int]] = []

    def before_forward(self, state: State, logger: Logger) -> None:
        if self.record_shapes and isinstance(state.batch, dict) and "input_ids" in state.batch:
            self.shapes.append(list(state.batch["input_ids"].shape))

    def batch_end(self, state: State, logger: Logger) -> None:
        self.batches += 1

    def fit_end(self, state: State, logger: Logger) -> None:
        if dist.get_global_rank() == 0:
            self.out_path.parent.mkdir(parents=True, exist_ok=True)
            out = {"batches": self.batches, **({"shapes": self.shapes} if self.record_shapes else {})}
            self.out_path.write_text(json.dumps(out))
