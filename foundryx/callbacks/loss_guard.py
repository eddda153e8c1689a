"""``loss_guard``: stop the run, or skip the batch, when the loss is NaN/inf or spikes.

YAML::

    callbacks:
      loss_guard:
        action: skip            # stop (default) | skip
        spike_factor: 3.0       # a loss above 3x the running mean is a spike; null: NaN/inf only
        window: 50              # batches in the running mean (spikes are checked once it is full)
        max_skips: 5            # skip: this many skipped batches in a row stop the run

Each rank checks the loss of every microbatch it trained; the ranks then agree in one small
all-reduce (a NaN on one rank is a NaN for all), so every rank stops or skips the same batch.
A skipped batch changes no weight and no optimizer state: its gradients are dropped before
the optimizer step (the LR schedule still advances). Stop ends the run on every rank with one
message naming the batch and the reason (exit code 1).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Any, Literal

import torch
from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from foundryx.config.types import option, options_or_fields
from foundryx.errors import RunError

log = logging.getLogger(__name__)


class GuardStop(RunError):
    """A guard stopped the run. Every rank agreed on it, so rank 0 alone prints it."""

    rank_zero_only = True


@dataclass
class LossGuardOptions:
    """``callbacks.loss_guard``: what to do when the training loss is not finite or spikes."""

    action: Literal["stop", "skip"] = option(
        "stop: end the run with one message (exit 1); skip: drop the batch's gradients so the "
        "optimizer does not step on it, and go on", default="stop")
    spike_factor: float | None = option(
        "a batch whose loss is above spike_factor times the mean of the last `window` good "
        "batches is a spike; null: only NaN/inf losses count", default=None, gt=1)
    window: int = option("batches in the running mean that spikes are measured against; spikes "
                         "are checked once it is full", default=50, gt=0)
    max_skips: int = option("with action: skip, this many skipped batches in a row stop the "
                            "run (the model has diverged)", default=5, gt=0)


def _scalar(loss: Any) -> torch.Tensor:
    """The total of a model's loss (a tensor, or a dict with 'total' or parts), detached."""
    if isinstance(loss, dict):
        loss = loss["total"] if "total" in loss else sum(loss.values())
    elif isinstance(loss, (list, tuple)):
        loss = sum(loss)
    return loss.detach().float().sum()


class LossGuard(Callback):
    """See the module docstring. ``LossGuard(action="skip", spike_factor=3.0)`` or
    ``LossGuard(options=LossGuardOptions(...))``."""

    def __init__(self, options: LossGuardOptions | None = None, **fields: Any):
        self.options = options_or_fields(LossGuardOptions, options, fields, "the 'loss_guard' callback")
        self._recent: deque[float] = deque(maxlen=self.options.window)
        self._sum: torch.Tensor | None = None
        self._count = 0
        self._skips_in_a_row = 0
        self.skipped: list[int] = []  # batches skipped so far (1-based), for reports and tests

    def before_train_batch(self, state: State, logger: Logger) -> None:
        self._sum, self._count = None, 0

    def after_loss(self, state: State, logger: Logger) -> None:
        loss = _scalar(state.loss)
        self._sum = loss if self._sum is None else self._sum + loss
        self._count += 1

    def after_train_batch(self, state: State, logger: Logger) -> None:
        """After the backward passes, before the optimizer step: agree on the batch."""
        if self._sum is None:
            return
        # [sum of microbatch losses, microbatches, ranks with a non-finite loss]
        local = self._sum.reshape(1).to(torch.float64)
        bad = 0.0 if torch.isfinite(local).all() else 1.0
        stats = torch.cat([torch.nan_to_num(local, nan=0.0, posinf=0.0, neginf=0.0),
                           torch.tensor([float(self._count), bad], dtype=torch.float64,
                                        device=local.device)])
        stats = state.device.tensor_to_device(stats)
        dist.all_reduce(stats, reduce_operation="SUM")
        total, count, bad_ranks = (float(x) for x in stats.cpu())
        batch = int(state.timestamp.batch) + 1  # the batch being trained, 1-based
        reason = None
        if bad_ranks:
            reason = f"the loss is not finite (NaN or inf) on {int(bad_ranks)} of {dist.get_world_size()} rank(s)"
        else:
            mean = total / max(count, 1.0)
            factor = self.options.spike_factor
            if factor is not None and len(self._recent) == self._recent.maxlen:
                avg = sum(self._recent) / len(self._recent)
                if mean > factor * avg:
                    reason = (f"loss spike: {mean:.4g} is above {factor:g}x the mean of the last "
                              f"{len(self._recent)} batches ({avg:.4g})")
            if reason is None:
                self._recent.append(mean)
                self._skips_in_a_row = 0
                return
        self._act(state, batch, reason)

    def _act(self, state: State, batch: int, reason: str) -> None:
        o = self.options
        if o.action == "stop":
            raise GuardStop(f"loss_guard: stopped at batch {batch}: {reason}. The weights are those "
                            "after the previous batch; resume from a checkpoint with a lower learning "
                            "rate, or set callbacks.loss_guard.action: skip")
        self._skips_in_a_row += 1
        if self._skips_in_a_row > o.max_skips:
            raise GuardStop(f"loss_guard: stopped at batch {batch}: {reason}, after skipping "
                            f"{o.max_skips} batches in a row (max_skips); the run has diverged: "
                            "resume from a checkpoint with a lower learning rate")
        for optimizer in state.optimizers:
            optimizer.zero_grad(set_to_none=True)  # the optimizer skips parameters without grads
        self.skipped.append(batch)
        if dist.get_global_rank() == 0:
            log.warning("loss_guard: skipped batch %d (no optimizer step): %s", batch, reason)
