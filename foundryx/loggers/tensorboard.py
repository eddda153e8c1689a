"""``tensorboard``: TensorBoard event files (``tensorboard --logdir runs``).

YAML::

    loggers:
      tensorboard:
        log_dir: runs/{run_name}/tensorboard   # the default
        flush_secs: 30
        rank_zero_only: true                   # false: every rank writes to log_dir/rank<N>

Every logged number is a scalar at step = the batch's number (1..N, as the console prints it). The writer opens when training (or a
first eval) starts, after the checkpoint is loaded; a resumed run tells TensorBoard to drop
the steps the interrupted run logged after its checkpoint (``purge_step``), so the curves
have no doubled tail.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from composer.core import State
from composer.utils import dist

from foundryx.loggers.deferred import DeferredDestination, scalars

log = logging.getLogger(__name__)


@dataclass
class TensorBoardOptions:
    """``loggers.tensorboard``: where the event files go."""

    log_dir: str = field(default="runs/{run_name}/tensorboard", metadata={
        "doc": "folder of the event files ({run_name} is replaced)"})
    flush_secs: float = field(default=30.0, metadata={
        "doc": "seconds between flushes to disk", "bounds": {"gt": 0}})
    rank_zero_only: bool = field(default=True, metadata={
        "doc": "only rank 0 writes; false: every rank writes to log_dir/rank<N>"})


class TensorBoardLogger(DeferredDestination):
    """See the module docstring."""

    def __init__(self, options: TensorBoardOptions | None = None, **fields: Any):
        super().__init__()
        self.options = options if options is not None else TensorBoardOptions(**fields)
        self.writer: Any = None
        self.log_dir: Path | None = None

    @property
    def opened(self) -> bool:
        return self.writer is not None

    def _open(self, state: State) -> None:
        from torch.utils.tensorboard import SummaryWriter  # imports tensorboard: only when used

        folder = Path(self.options.log_dir.format(run_name=state.run_name))
        if not self.options.rank_zero_only:
            folder = folder / f"rank{dist.get_global_rank()}"
        start = int(state.timestamp.batch)  # resumed after batch `start`: it logs from start + 1
        self.writer = SummaryWriter(str(folder), flush_secs=self.options.flush_secs,
                                    purge_step=start + 1 if start > 0 else None)
        self.log_dir = folder

    def _write(self, kind: str, data: dict[str, Any], step: int | None) -> None:
        if kind == "hyperparameters":
            text = "\n".join(f"    {k}: {v}" for k, v in sorted(data.items()))  # markdown code
            self.writer.add_text("hyperparameters", text, global_step=step or 0)
            return
        for k, v in scalars(data).items():
            self.writer.add_scalar(k, v, global_step=step)

    def post_close(self) -> None:
        if self.writer is not None:
            self.writer.flush()
            self.writer.close()
            self.writer = None
