"""One batch numbering for every logger: batch N is the N-th batch trained (1..N), the number
the console prints.

Composer logs the loss, the train metrics and ``time/*`` while a batch runs, before it counts
that batch (so at step N-1), and everything else (learning rate, speed, memory, eval) after it
(at step N). A logger destination that mixes in :class:`BatchNumbered` writes the first kind at
the batch's own number too, so a batch's loss and its learning rate share one step.
"""

from __future__ import annotations

from typing import Any


class BatchNumbered:
    """Mixin for a Composer LoggerDestination: :meth:`batch_number` turns Composer's step into
    the batch's number (see the module docstring)."""

    _running: int | None = None  # the number of the batch in progress, None between batches

    def batch_start(self, state: Any, logger: Any) -> None:
        self._running = int(state.timestamp.batch) + 1

    def batch_end(self, state: Any, logger: Any) -> None:
        self._running = None

    def batch_number(self, step: int | None) -> int | None:
        """The batch's number for what is logged at Composer's ``step``: ``step`` + 1 while a
        batch runs and is not counted yet, else ``step`` (callbacks that log at BATCH_END
        before this one sees it log the counted batch already)."""
        if self._running is not None and step == self._running - 1:
            return self._running
        return step
