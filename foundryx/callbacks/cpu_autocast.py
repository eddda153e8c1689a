"""``amp_bf16`` on a CPU: the forward and the loss under torch's CPU autocast to bfloat16.

Composer 0.32 refuses every precision but fp32 on a CPU (``_validate_precision``), and its own
autocast context does nothing there. So a CPU run of an ``amp_bf16`` config hands Composer
``fp32`` and adds this callback (``foundryx.train`` says so in one line): it enters
``torch.autocast("cpu", dtype=torch.bfloat16)`` where Composer would enter its own (the training
forward, the loss, the eval forward) and leaves it after, so the backward runs outside it, as
under Composer's. FSDP2's mixed-precision policy follows the config's precision as on a GPU
(bf16 gathered weights, fp32 gradient reduction under ``DEFAULT``): the recipe's own policy.
"""

from __future__ import annotations

import contextlib

import torch
from composer.core import Callback, Event, State
from composer.loggers import Logger

_ENTER = {Event.BEFORE_FORWARD, Event.BEFORE_LOSS, Event.EVAL_BEFORE_FORWARD}
_EXIT = {Event.AFTER_FORWARD, Event.AFTER_LOSS, Event.EVAL_AFTER_FORWARD, Event.FIT_END}


class CpuAutocast(Callback):
    """Autocast the forward and loss of a CPU run to ``dtype`` (bfloat16)."""

    def __init__(self, dtype: torch.dtype = torch.bfloat16) -> None:
        self.dtype = dtype
        self._context: contextlib.ExitStack | None = None
        self.entered = 0  # forwards and losses run under autocast (tests read it)

    def run_event(self, event: Event, state: State, logger: Logger) -> None:
        if event in _EXIT and self._context is not None:
            self._context.close()
            self._context = None
        elif event in _ENTER and self._context is None:
            self._context = contextlib.ExitStack()
            self._context.enter_context(torch.autocast("cpu", dtype=self.dtype))
            self.entered += 1
