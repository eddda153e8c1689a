"""``wandb``: Weights & Biases, with autoresumed runs continuing the same W&B run.

YAML::

    loggers:
      wandb:
        project: my-project
        entity: my-team           # optional
        name: null                # default: the run's run_name
        tags: [pretrain]
        dir: runs/{run_name}      # W&B's local files, and the file that keeps the run id
        rank_zero_only: true      # false: every rank logs, to its own W&B run in one group

The W&B run starts when training (or a first eval) starts, after the checkpoint is loaded:
a run that resumed from a checkpoint continues the W&B run whose id ``dir/wandb-run-id``
holds (``wandb.init(id=..., resume="allow")``); a run that starts from batch 0 gets a new id
and writes it there. ``WANDB_MODE=offline`` writes the run under ``dir/wandb`` for a later
``wandb sync``; ``WANDB_MODE=disabled`` turns it off. What is logged before the W&B run starts
(the hyperparameters) is kept and sent when it does.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from composer.core import State
from composer.utils import dist

from foundryx.loggers.deferred import DeferredDestination, scalars

log = logging.getLogger(__name__)
ID_FILE = "wandb-run-id"


def _doc(text: str, **kw: Any) -> Any:
    return field(metadata={"doc": text}, **kw)


@dataclass
class WandBOptions:
    """``loggers.wandb``: where the run goes in Weights & Biases."""

    project: str | None = _doc("W&B project (default: W&B's, or WANDB_PROJECT)", default=None)
    entity: str | None = _doc("W&B team or user (default: yours, or WANDB_ENTITY)", default=None)
    name: str | None = _doc("display name (default: the run's run_name)", default=None)
    group: str | None = _doc("W&B group", default=None)
    tags: list[str] = _doc("W&B tags", default_factory=list)
    dir: str = _doc("local folder for W&B's files and the run id ({run_name} is replaced)",
                    default="runs/{run_name}")
    rank_zero_only: bool = _doc("only rank 0 logs; false: each rank logs to its own W&B run "
                                "(<name>-rank<N>, grouped)", default=True)
    init_kwargs: dict[str, Any] = _doc("further wandb.init arguments", default_factory=dict)


class WandBLogger(DeferredDestination):
    """See the module docstring."""

    def __init__(self, options: WandBOptions | None = None, **fields: Any):
        super().__init__()
        self.options = options if options is not None else WandBOptions(**fields)
        self.run: Any = None
        self.run_id: str | None = None
        self.resumed = False

    # the W&B run starts after loading: the first fit_start or eval_start
    @property
    def opened(self) -> bool:
        return self.run is not None

    def _open(self, state: State) -> None:
        import wandb  # heavy; only for runs that use this logger

        o = self.options
        folder = Path(o.dir.format(run_name=state.run_name))
        folder.mkdir(parents=True, exist_ok=True)
        rank = dist.get_global_rank()
        id_file = folder / (ID_FILE if o.rank_zero_only or rank == 0 else f"{ID_FILE}-rank{rank}")
        resuming = int(state.timestamp.batch) > 0
        run_id = id_file.read_text().strip() if resuming and id_file.is_file() else None
        if resuming and run_id is None:
            log.info("wandb: resumed from batch %d but %s has no W&B run id; starting a new W&B run",
                     int(state.timestamp.batch), id_file)
        if run_id is None:
            run_id = uuid.uuid4().hex[:12]  # W&B ids: letters and digits, unique per project
            id_file.write_text(run_id + "\n")
        name = o.name or state.run_name
        kwargs: dict[str, Any] = {
            "project": o.project, "entity": o.entity, "name": name, "tags": o.tags or None,
            "group": o.group, "dir": str(folder), "id": run_id, "resume": "allow", **o.init_kwargs,
        }
        if not o.rank_zero_only:
            kwargs["name"], kwargs["group"] = f"{name}-rank{rank}", o.group or name
        self.run = wandb.init(**kwargs)
        self.run_id, self.resumed = run_id, resuming and self.run is not None
        if resuming:
            log.info("wandb: continuing W&B run %s from batch %d", run_id, int(state.timestamp.batch))

    def _write(self, kind: str, data: dict[str, Any], step: int | None) -> None:
        if kind == "hyperparameters":
            self.run.config.update(data, allow_val_change=True)
            return
        row = scalars(data)  # NaN and inf too: W&B shows them, and they say when a run diverged
        if row:
            self.run.log(row, step=step)

    def post_close(self) -> None:
        if self.run is not None:
            self.run.finish()
            self.run = None
