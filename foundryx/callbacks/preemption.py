"""``preemption``: on SIGTERM or SIGUSR1, save a checkpoint at the next batch boundary and exit 0.

On by default wherever a ``save_folder`` is set (``foundryx train`` adds it and says so in one
log line, foundryx.train.run_callbacks); ``callbacks.preemption: null`` turns it off. YAML, for
other signals::

    callbacks:
      preemption:
        signals: [SIGTERM, SIGUSR1]    # the default

Slurm sends SIGTERM to every task of a job before it kills it (and SIGUSR1 ahead of time with
``#SBATCH --signal=USR1@120``); Kubernetes and most schedulers send SIGTERM. The handler only
notes the signal. After each batch the ranks agree in one small all-reduce whether any of
them got one (a signal may reach one rank first), so every rank stops after the same batch.
The run then stops as if that batch were the last: the Checkpointer saves it (the end of
training is always saved), the end-of-training eval is skipped, and the process exits 0 with
one log line saying why. Autoresume continues from that checkpoint and loses nothing. Once the
run is stopping for a signal, the signal reaching a rank late (while it saves, closes its
loggers or exits) does not kill it: the handler notes it while the checkpoint is written, and
from the end of training the signals are ignored until the process exits.
Without a ``save_folder`` the run stops without a checkpoint (said when training starts).
"""

from __future__ import annotations

import logging
import signal
from dataclasses import dataclass
from typing import Any

import torch
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from foundryx.checkpoint.callback import Checkpointer
from foundryx.config.types import option, options_or_fields

log = logging.getLogger(__name__)

_CATCHABLE = ("SIGTERM", "SIGUSR1", "SIGUSR2", "SIGINT", "SIGHUP", "SIGCONT")


@dataclass
class PreemptionOptions:
    """``callbacks.preemption``: the signals that mean "save and stop now"."""

    signals: list[str] = option(
        f"signal names to catch, from {', '.join(_CATCHABLE)}",
        default_factory=lambda: ["SIGTERM", "SIGUSR1"],
        check=(lambda names: all(n in _CATCHABLE for n in names), f"names from {', '.join(_CATCHABLE)}"))


class Preemption(Callback):
    """See the module docstring."""

    def __init__(self, options: PreemptionOptions | None = None, **fields: Any):
        self.options = options_or_fields(PreemptionOptions, options, fields, "the 'preemption' callback")
        self.received: int = 0  # the number of the first signal caught on this rank, 0: none
        self.stopped_at: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if not self.received:
            self.received = signum  # only a note: the training loop acts on it

    def fit_start(self, state: State, logger: Logger) -> None:
        for name in self.options.signals:
            signum = getattr(signal, name)
            self._previous[signum] = signal.signal(signum, self._handle)
        if not any(isinstance(c, Checkpointer) and c.save_folder is not None for c in state.callbacks):
            if dist.get_global_rank() == 0:
                log.warning("preemption: no save_folder, so on %s the run stops after the current "
                            "batch without a checkpoint; set save_folder to resume from it",
                            " or ".join(self.options.signals))

    def batch_end(self, state: State, logger: Logger) -> None:
        # [signal number or 0, rank + 1 of a rank that got one or 0]: MAX over ranks
        flags = state.device.tensor_to_device(torch.tensor(
            [self.received, (dist.get_global_rank() + 1) if self.received else 0], dtype=torch.int64))
        dist.all_reduce(flags, reduce_operation="MAX")
        signum, rank = (int(x) for x in flags.cpu())
        if not signum or self.stopped_at is not None:
            return
        self.stopped_at = int(state.timestamp.batch)
        state.stop_training()  # the Checkpointer saves this batch: it is now the last one
        for evaluator in state.evaluators:  # no end-of-training eval: time is short
            evaluator.eval_interval = lambda state, event: False
        if dist.get_global_rank() == 0:
            log.warning("preemption: %s received (rank %d got it); stopping after batch %d with a "
                        "checkpoint, exit 0; autoresume continues from it",
                        signal.Signals(signum).name, rank - 1, self.stopped_at)

    def fit_end(self, state: State, logger: Logger) -> None:
        self._restore()

    def close(self, state: State, logger: Logger) -> None:
        self._restore()

    def _restore(self) -> None:
        # A run stopping for a signal must not be killed by the same signal reaching it a moment
        # later (Slurm signals every task) while it uploads, closes its loggers or exits. Python
        # resets a Python-level handler to the default action when the interpreter shuts down
        # (a late SIGTERM there kills the process: exit -15, a "crash" for the launcher), but it
        # keeps SIG_IGN: so the signals are ignored from here on.
        if self.stopped_at is not None:
            for signum in self._previous:
                signal.signal(signum, signal.SIG_IGN)
            return
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}
