"""``preemption``: on SIGTERM or SIGUSR1, save a checkpoint at the next batch boundary and exit 0.

On by default wherever a ``save_folder`` is set (``foundryx train`` adds it and says so in one
log line, foundryx.train.run_callbacks); ``callbacks.preemption: null`` turns it off. YAML, for
other signals::

    callbacks:
      preemption:
        signals: [SIGTERM, SIGUSR1]    # the default

Slurm sends SIGTERM to every task of a job before it kills it (and SIGUSR1 ahead of time with
``#SBATCH --signal=USR1@120``); Kubernetes and most schedulers send SIGTERM. From ``fit_start``
the handler (foundryx.runtime.preempt) only notes the signal. After each batch the ranks agree in one
small all-reduce whether any of them got one (a signal may reach one rank first), so every rank
stops after the same batch. The run then stops as if that batch were the last: the Checkpointer
saves it (the end of training is always saved), the end-of-training eval is skipped, and the
process exits 75 (foundryx.runtime.preempt.PREEMPTED: "preempted, saved, run me again") with one log
line saying why. Autoresume continues from that checkpoint and loses nothing. Once the run is
stopping for a signal, the signal reaching a rank late (while it saves, closes its loggers or
exits) does not kill it: it is noted while the checkpoint is written, and from the end of
training ignored until the process exits. A signal before ``fit_start`` (while the run starts)
is foundryx.runtime.preempt's: one line, nothing to save, exit 75.
Without a ``save_folder`` the run stops without a checkpoint (said when training starts).
Ctrl-C (SIGINT) while training is noted the same way (foundryx.runtime.preempt: one line at once, exit
130); a second Ctrl-C stops at once, saying which batches that lost.
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
from foundryx.runtime import preempt

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
        self.stopped_at: int | None = None
        self.finished = False  # the batch it stopped after was the run's last anyway

    @property
    def received(self) -> int:
        """The number of the first signal caught in this process, 0: none."""
        return preempt.received()

    def fit_start(self, state: State, logger: Logger) -> None:
        # a signal noted before (while the run started) raises foundryx.runtime.preempt.Preempted here
        preempt.watch(preempt.numbers(self.options.signals), training=True)
        if not any(isinstance(c, Checkpointer) and c.save_folder is not None for c in state.callbacks):
            if dist.get_global_rank() == 0:
                log.warning("preemption: no save_folder, so on %s the run stops after the current "
                            "batch without a checkpoint; set save_folder to resume from it",
                            " or ".join(self.options.signals))

    def batch_end(self, state: State, logger: Logger) -> None:
        # [signal number or 0, rank + 1 of a rank that got one or 0]: MAX over ranks
        preempt.batch_done(int(state.timestamp.batch))  # what a second Ctrl-C would lose
        got = preempt.received()
        flags = state.device.tensor_to_device(torch.tensor(
            [got, (dist.get_global_rank() + 1) if got else 0], dtype=torch.int64))
        dist.all_reduce(flags, reduce_operation="MAX")
        signum, rank = (int(x) for x in flags.cpu())
        if not signum or self.stopped_at is not None:
            return
        self.stopped_at = int(state.timestamp.batch)
        self.finished = _reached_max_duration(state)  # before stop_training() moves max_duration
        state.stop_training()  # the Checkpointer saves this batch: it is now the last one
        for evaluator in state.evaluators:  # no end-of-training eval: time is short
            evaluator.eval_interval = lambda state, event: False
        if dist.get_global_rank() == 0 and signum != signal.SIGINT:  # Ctrl-C: said at once
            log.warning("preemption: %s received (rank %d got it); stopping after batch %d with a "
                        "checkpoint, exit %d; autoresume continues from it",
                        signal.Signals(signum).name, rank - 1, self.stopped_at, preempt.PREEMPTED)

    def fit_end(self, state: State, logger: Logger) -> None:
        self._end(state)

    def close(self, state: State, logger: Logger) -> None:
        self._end(state)

    def _end(self, state: State) -> None:
        """Stopped for a signal, or in ``foundryx train``'s own process: the signals are
        ignored from here (foundryx.runtime.preempt.stop); else the handlers as they were."""
        if self.stopped_at is not None:
            preempt.stop(None if self.finished else self.stopped_at)
        elif preempt.owned():
            preempt.stop(None)
        else:
            preempt.restore()


def _reached_max_duration(state: State) -> bool:
    """Whether the batch the run stopped after was its last anyway (then it finished: exit 0)."""
    try:
        return bool(state.max_duration is not None
                    and state.timestamp.get(state.max_duration.unit) >= state.max_duration)
    except (ValueError, TypeError, AttributeError):  # a unit the timestamp does not count
        return False
