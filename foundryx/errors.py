"""User-facing errors.

Every error a person can cause with bad input (config, data, checkpoint, CLI) is a
:class:`FoundryxError`. The CLI prints its message without a traceback and exits with
code 2. One subclass per subsystem keeps ``except`` clauses precise. A run that stops for a
cause outside its input (a killed dataloader worker) is a :class:`RunError`: the same kind of
message, exit code 1.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class FoundryxError(Exception):
    """An error caused by user input; its message says what is wrong and how to fix it."""

    exit_code = 2
    # The same on every rank (it comes from the shared input), so only rank 0 prints it.
    rank_zero_only = True


class ConfigError(FoundryxError):
    """The run config is invalid. Holds every problem found, each with its YAML path."""

    def __init__(self, problems: list[str], source: str | None = None):
        self.problems = list(problems)
        self.source = source
        where = f" in {source}" if source else ""
        n = len(self.problems)
        head = f"{n} problem{'s' if n != 1 else ''} in the config{where}:"
        super().__init__("\n".join([head] + [f"  - {p}" for p in self.problems]))


class RegistryError(FoundryxError):
    """An unknown name, or two entries under one name."""


class DataError(FoundryxError):
    """Input data is missing, empty or malformed."""


class CheckpointError(FoundryxError):
    """A checkpoint is missing, incomplete or does not match the model."""


class RunError(FoundryxError):
    """A run stopped for a cause outside its input, e.g. a dataloader worker killed by the OOM
    killer. Not bad input, so exit code 1 (running again may succeed; 2 says it will not
    until the input changes). Only the rank that saw it knows it, so that rank prints it."""

    exit_code = 1
    rank_zero_only = False


class ExportError(FoundryxError):
    """An export cannot be done as asked (format, output folder, missing model config)."""


class EvalError(FoundryxError):
    """An eval's results cannot be written (full disk, no permission on ``output_dir``)."""


def did_you_mean(name: str, choices: Iterable[str], n: int = 3) -> str:
    """Return `` (did you mean 'x'?)`` for the closest choices, or an empty string."""
    close = difflib.get_close_matches(str(name), sorted(set(choices)), n=n, cutoff=0.6)
    if not close:
        return ""
    return " (did you mean " + " or ".join(repr(c) for c in close) + "?)"


class ReportError(FoundryxError):
    """A run folder cannot be reported on (missing, empty, damaged metrics), or the report
    cannot be written."""
