"""Log set-up shared by the entry points (``foundryx train``, ``foundryx eval``, ``foundryx
export``, ``foundryx data``, the upload process): ``foundryx``'s lines with time and rank, and
Composer's kept to warnings unless debugging (:func:`setup_logging`).

Imports nothing of foundryx: any part may use it.
"""

from __future__ import annotations

import logging
import os
import sys


class _RankFilter(logging.Filter):
    """Adds ``record.rank`` (the ``RANK`` environment variable, 0 when unset)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = os.environ.get("RANK", "0")
        return True


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted, not the one at set-up
    (so a process that redirects stderr, as pytest does per test, still gets the log)."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def setup_logging(level: str | None) -> None:
    """Log ``foundryx`` at ``level`` (e.g. ``info``) with time and rank, and ``composer`` at
    the same level when it is ``debug``, else at ``warning`` at least (its info lines repeat
    what foundryx says: seeds, run name, precision); None or empty: leave logging as it is."""
    if not level:
        return
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s: rank%(rank)s: %(levelname)s: %(name)s: %(message)s"))
    handler.addFilter(_RankFilter())
    numeric = logging.getLevelName(level.upper())
    for name in ("foundryx", "composer"):
        lg = logging.getLogger(name)
        quiet = name == "composer" and isinstance(numeric, int) and numeric > logging.DEBUG
        lg.setLevel(max(numeric, logging.WARNING) if quiet else level.upper())
        if not lg.handlers:
            lg.addHandler(handler)
        lg.propagate = False
