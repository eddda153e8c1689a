"""``hang_watchdog``: when no batch finishes for ``timeout_s``, print every rank's Python stacks,
say which rank is behind, and exit 1 instead of waiting for the NCCL/gloo timeout.

YAML::

    callbacks:
      hang_watchdog:
        timeout_s: 600              # longer than the slowest batch, eval batch or checkpoint save
        first_batch_timeout_s: 1800 # the first batch (compilation, data loader start-up)

Each rank records its last finished batch in the process group's key-value store (the
TCPStore the launcher's rendezvous created: a side channel that works while a collective is
stuck). A thread on each rank watches the time since its last finished batch (train or eval).
When it passes the timeout, that rank reads every rank's last batch from the store, logs which
rank is behind, asks the other ranks (through the store) to dump too, prints its own Python
stacks (faulthandler, every thread) to its stderr, waits up to ``grace_s`` for the others'
dumps and exits with code 1. A rank whose interpreter is wedged in C code holding the GIL is
still dumped by faulthandler's own timer ``grace_s`` later.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from foundryx.config.types import option, options_or_fields

log = logging.getLogger(__name__)

EXIT_CODE = 1
_PREFIX = "foundryx/hang_watchdog"


@dataclass
class HangWatchdogOptions:
    """``callbacks.hang_watchdog``: how long without a finished batch counts as a hang."""

    timeout_s: float = option("seconds without a finished batch (train or eval) after which "
                              "every rank dumps its stacks and the run exits 1; longer than the "
                              "slowest batch, eval batch and checkpoint save", default=600.0, gt=0)
    first_batch_timeout_s: float = option(
        "the same for the first batch of the run (compilation, data loader start-up)",
        default=1800.0, gt=0)
    grace_s: float = option("seconds a rank that detected the hang waits for the other ranks' "
                            "stack dumps before it exits", default=10.0, ge=0)
    poll_s: float = option("how often the watchdog thread looks", default=1.0, gt=0)


def _default_store() -> Any:
    """The process group's key-value store, or None (one process, no process group)."""
    import torch.distributed as tdist

    if not (tdist.is_available() and tdist.is_initialized()):
        return None
    try:
        return tdist.distributed_c10d._get_default_store()
    except (RuntimeError, ValueError, AttributeError):
        return None


class HangWatchdog(Callback):
    """See the module docstring."""

    def __init__(self, options: HangWatchdogOptions | None = None, **fields: Any):
        self.options = options_or_fields(HangWatchdogOptions, options, fields,
                                         "the 'hang_watchdog' callback")
        self._last = time.monotonic()
        self._batch = 0
        self._timeout = self.options.first_batch_timeout_s
        self._store: Any = None
        self._rank, self._world = 0, 1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- training thread: beats ------------------------------------------------------------
    def fit_start(self, state: State, logger: Logger) -> None:
        self._rank, self._world = dist.get_global_rank(), dist.get_world_size()
        self._store = _default_store() if self._world > 1 else None
        self._batch = int(state.timestamp.batch)
        self._beat(first=True)
        self._thread = threading.Thread(target=self._watch, name="foundryx-hang-watchdog", daemon=True)
        self._thread.start()

    def batch_end(self, state: State, logger: Logger) -> None:
        self._batch = int(state.timestamp.batch)
        self._timeout = self.options.timeout_s
        self._beat()

    def eval_batch_end(self, state: State, logger: Logger) -> None:
        self._beat()

    def eval_end(self, state: State, logger: Logger) -> None:
        self._beat()

    def _beat(self, first: bool = False) -> None:
        self._last = time.monotonic()
        # faulthandler's own timer: dumps this rank's stacks even if the GIL is never released
        try:
            faulthandler.dump_traceback_later(
                self._timeout + self.options.grace_s + 5 * self.options.poll_s, exit=True,
                file=sys.stderr)
        except (ValueError, OSError, AttributeError):  # a stderr without a file descriptor
            pass
        if self._store is not None:
            try:
                self._store.set(f"{_PREFIX}/rank{self._rank}", f"{self._batch} {time.time():.3f}")
            except Exception as e:  # noqa: BLE001  (the store is a side channel; training goes on)
                if first:
                    log.warning("hang_watchdog: the process group's store is not usable (%s); a "
                                "hang is still detected, without saying which rank is behind", e)
                self._store = None

    def fit_end(self, state: State, logger: Logger) -> None:
        self._shutdown()

    def close(self, state: State, logger: Logger) -> None:
        self._shutdown()

    def _shutdown(self) -> None:
        self._stop.set()
        faulthandler.cancel_dump_traceback_later()

    # -- watchdog thread -------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._stop.wait(self.options.poll_s):
            waited = time.monotonic() - self._last
            if waited > self._timeout:
                self._fire(f"no batch finished on rank {self._rank} for {waited:.0f} s "
                           f"(timeout {self._timeout:g} s)")
            elif self._store is not None and self._peer_fired():
                self._fire("another rank detected a hang")

    def _peer_fired(self) -> bool:
        try:
            return bool(self._store.check([f"{_PREFIX}/fired"]))
        except Exception:  # noqa: BLE001
            return False

    def _progress(self) -> list[tuple[int, int | None, float | None]]:
        """``(rank, last finished batch, seconds ago)`` of every rank, from the store."""
        now, rows = time.time(), []
        for r in range(self._world):
            key = f"{_PREFIX}/rank{r}"
            try:
                if not self._store.check([key]):
                    rows.append((r, None, None))
                    continue
                batch, when = self._store.get(key).decode().split()
                rows.append((r, int(batch), now - float(when)))
            except Exception:  # noqa: BLE001
                rows.append((r, None, None))
        return rows

    def _fire(self, why: str) -> None:
        self._stop.set()
        lines = [f"hang_watchdog: {why}; rank {self._rank} last finished batch {self._batch}."]
        if self._store is not None:
            try:
                self._store.set(f"{_PREFIX}/fired", str(self._rank))
            except Exception:  # noqa: BLE001
                pass
            rows = self._progress()
            known = [b for _, b, _ in rows if b is not None]
            lines.append("Last finished batch per rank: " + ", ".join(
                f"rank {r}: {'none' if b is None else b}"
                + ("" if ago is None else f" ({ago:.0f} s ago)") for r, b, ago in rows))
            behind = [r for r, b, _ in rows if b is None or (known and b < max(known))]
            if behind:
                lines.append(f"Behind: rank(s) {', '.join(map(str, behind))}; their stacks show "
                             "where they are.")
            else:
                lines.append("Every rank finished the same batch: all are stuck in the next one "
                             "(e.g. a collective, I/O or the data loader); the stacks show where.")
        lines.append(f"Python stacks of rank {self._rank} (pid {os.getpid()}) follow; every rank "
                     f"prints its own, then exits {EXIT_CODE}.")
        sys.stderr.write("\n".join(lines) + "\n")
        sys.stderr.flush()
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        sys.stderr.flush()
        self._wait_for_peers()
        os._exit(EXIT_CODE)

    def _wait_for_peers(self) -> None:
        """Until every rank dumped its stacks, at most ``grace_s``."""
        if self._store is None:
            return
        try:
            self._store.set(f"{_PREFIX}/dumped/rank{self._rank}", "1")
            keys = [f"{_PREFIX}/dumped/rank{r}" for r in range(self._world)]
            deadline = time.monotonic() + self.options.grace_s
            while time.monotonic() < deadline and not self._store.check(keys):
                time.sleep(0.2)
        except Exception:  # noqa: BLE001
            pass
