"""Known-harmless third-party warnings, filtered by message in this one place.

Each filter names the warning's start (a regular expression matched against the start of the
message, as :func:`warnings.filterwarnings` does), its category and why it is harmless in
foundryx. Everything else still reaches the output. :func:`install` is called by the CLI for
every subcommand (``foundryx train``, ``eval``, ``export``, ... and ``train.py``/``eval/eval.py``)
and again by ``foundryx train`` (foundryx.train) before it builds anything. To see every warning again,
set ``FOUNDRYX_ALL_WARNINGS=1``.

Imports nothing of foundryx: any part may use it.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import warnings
from dataclasses import dataclass


@dataclass(frozen=True)
class Known:
    message: str  # regular expression, matched at the start of the message
    category: type[Warning]
    reason: str


KNOWN: tuple[Known, ...] = (
    Known(r"TypedStorage is deprecated", UserWarning,
          "torch's DCP save/load touches storages through the old API internally (every "
          "checkpoint); nothing in foundryx uses TypedStorage"),
    Known(r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is "
          r"to (save|load) in a single process", UserWarning,
          "a single-process run saves and loads DCP checkpoints without a process group, "
          "which is what it means to do"),
    Known(r"The ``compute`` method of metric \w+ was called before the ``update`` method",
          UserWarning,
          "Composer computes the train metrics on the first batch before any update when "
          "train metrics are logged; the value it logs is replaced on the next batch"),
)

# Lines that third-party code prints to stderr (torch < 2.8) or logs (later: the logger
# torch.utils.cpp_extension) while being imported.
KNOWN_PRINTS: tuple[Known, ...] = (
    Known(r"No CUDA runtime is found, using CUDA_HOME=", UserWarning,
          "torch.utils.cpp_extension (imported by torch.compile's CPU backend) says it on "
          "a machine with a CUDA toolkit and no GPU; a CPU run needs no CUDA runtime"),
)
KNOWN_PRINT_LOGGERS = ("torch.utils.cpp_extension",)


# Log lines that third-party packages write while being imported, before any foundryx code
# runs: filtered from `import foundryx` on (foundryx/__init__.py calls install_import_filters).
KNOWN_IMPORT_LOGS: tuple[tuple[str, Known], ...] = (
    ("torchao", Known(r"Skipping import of cpp extensions due to incompatible torch version",
                      UserWarning,
                      "torchao's compiled kernels are built for one torch release; foundryx uses "
                      "only its NF4 tensor subclass (pure Python, tested on torch 2.7 and 2.15). "
                      "transformers imports torchao whenever it is installed, so every run "
                      "would print it")),
    ("torch.utils._pytree", Known(r"<enum '\w+'> is an Enum subclass and is now natively supported "
                                  r"by torch\.compile", UserWarning,
                                  "torchao (0.18) registers its enums as pytree constants, which "
                                  "torch 2.15 deprecates, at import; foundryx compiles none of them")),
)


# Log lines that third-party code writes while a run goes on, filtered the same way (a filter
# on the named logger, from `import foundryx` on; forked and spawned dataloader workers too,
# as they import foundryx or inherit the filter).
KNOWN_LOGS: tuple[tuple[str, Known], ...] = (
    ("streaming.base.dataset",
     Known(r"The `replication` arg has been set to \d+ and training is resuming from sample \d+\. "
           r"Make sure you are accounting for sample replication", UserWarning,
           "under parallelism.tp foundryx sets dataset.replication to tp (the ranks of a "
           "tensor-parallel group read the same batches), and streaming says this at the start "
           "of every epoch of every loader with replication, resumed or not. foundryx accounts "
           "for it: each rank of a group counts 1/tp of the batch, so the sample count a "
           "checkpoint resumes from is the unique samples read (foundryx/data/text.py; "
           "tests/test_icl_tp.py checks a tp 2 checkpoint's data position against FSDP's)")),
)


class _DropKnownImportLogs(logging.Filter):
    def __init__(self, patterns: list[str]):
        super().__init__()
        self.patterns = [re.compile(p) for p in patterns]

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(p.match(record.getMessage()) for p in self.patterns)


def install_import_filters() -> None:
    """Drop the :data:`KNOWN_IMPORT_LOGS` and :data:`KNOWN_LOGS` lines (not when
    ``FOUNDRYX_ALL_WARNINGS=1``)."""
    if os.environ.get("FOUNDRYX_ALL_WARNINGS") == "1":
        return
    logs = KNOWN_IMPORT_LOGS + KNOWN_LOGS
    for name in {n for n, _ in logs}:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnownImportLogs) for f in logger.filters):
            logger.addFilter(_DropKnownImportLogs([k.message for n, k in logs if n == name]))


class _DropKnownPrints(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not any(re.match(k.message, record.getMessage()) for k in KNOWN_PRINTS)


def install(preimport: bool = True) -> None:
    """Ignore the :data:`KNOWN` warnings (not when ``FOUNDRYX_ALL_WARNINGS=1``), and with
    ``preimport`` import the modules that print :data:`KNOWN_PRINTS` with those lines dropped
    (that imports torch: the CLI installs the filters without it for every subcommand, before
    anything heavy is imported; ``foundryx train`` installs them whole)."""
    if os.environ.get("FOUNDRYX_ALL_WARNINGS") == "1":
        return
    install_import_filters()
    for known in KNOWN:
        warnings.filterwarnings("ignore", message=known.message, category=known.category)
    for name in KNOWN_PRINT_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _DropKnownPrints) for f in logger.filters):
            logger.addFilter(_DropKnownPrints())
    if not preimport:
        return
    with filtered_stderr():
        with contextlib.suppress(Exception):
            import torch.utils.cpp_extension  # noqa: F401  (prints on import; see KNOWN_PRINTS)


@contextlib.contextmanager
def filtered_stderr():
    """Run the block with stderr captured, then write what it printed less the
    :data:`KNOWN_PRINTS` lines."""
    captured = io.StringIO()
    with contextlib.redirect_stderr(captured):
        yield
    patterns = [re.compile(k.message) for k in KNOWN_PRINTS]
    for line in captured.getvalue().splitlines(keepends=True):
        if not any(p.match(line) for p in patterns):
            sys.stderr.write(line)
