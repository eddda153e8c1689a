"""``composer -n N train.py ...``: Composer's launcher, with foundryx's handling of a scheduler's
signal and of its start.

Composer's launcher (``composer/cli/launcher.py``) imports ``composer``, whose engine sets a
SIGTERM handler that exits 143 at once. A scheduler signals the launcher with the ranks (Slurm
every task of the job, ``kill -TERM -PGID`` the process group); the launcher then printed a
traceback (``SystemExit: 143`` in ``_monitor_processes``), sent the ranks SIGTERM again and
SIGKILLed them after 30 s, and a signal while it was still importing ``composer`` was swallowed
by an import (the ranks never heard of it: the run went on). For a foundryx training script
this module's :func:`main` runs instead of Composer's ``main``:

- foundryx's handler of the preemption signals (foundryx.runtime.preempt.DEFAULT_SIGNALS) is set as
  torch's import ends, and Composer's import leaves it in place (foundryx.runtime.preempt.kept), so
  none is lost or kills it;
- the ranks start with them held too (``FOUNDRYX_HELD_SIGNALS``: foundryx's import releases
  them into a handler that notes them, foundryx.runtime.preempt), so a rank that has not set its
  handler yet is not killed by one either;
- the launcher passes a signal on to every rank, again each second until they exit (a rank
  that was still starting, or a launcher signalled alone, as Kubernetes signals a container's
  first process), and waits for them: no 30-second kill, the scheduler's own grace bounds it;
- it ends with one line and exit 75 (foundryx.runtime.preempt.PREEMPTED) when the ranks stopped for
  the signal (a checkpoint saved, or training had not begun), 0 when the run finished. A rank
  that fails otherwise is Composer's case as before (the others stopped, its output printed).

How it gets there: ``[project.entry-points."torch.backends"]`` names
``_foundryx_torch_hook.autoload`` (a top-level module beside the package), which torch calls
at the end of every ``import torch`` (its hook for out-of-tree device backends, the only
foundryx code Composer's launcher process runs before ``composer`` sets its handler: ``import
composer`` imports torch first). In any process but the ``composer`` command it returns at
once without importing foundryx (a plain transformers + peft script never imports foundryx
through it); in the command it calls :func:`autoload` here. There it sets the handler and adds an import hook that, once
``composer.cli.launcher`` has run, replaces its ``main`` with this module's :func:`main` (what
the command's ``from composer.cli.launcher import main`` then gets). A signal in the command's
first seconds, before torch is imported, ends it as it would any process (exit 143, no line):
no rank has started, nothing is lost. ``import foundryx``
there also filters the known import-time log lines (foundryx.runtime.known_warnings: torchao's
"Skipping import of cpp extensions"). A script that does not import foundryx gets Composer's
``main`` unchanged. ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` or ``FOUNDRYX_LAUNCHER=0`` turns all of
this off.

Imported inside ``import torch``: standard library and foundryx's bottom floor only.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.util
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import types
from pathlib import Path
from typing import Any

from foundryx.runtime import preempt

LAUNCHER = "composer.cli.launcher"
HELD = preempt.numbers(preempt.DEFAULT_SIGNALS)
FORWARD_EVERY_S = 1.0


def autoload() -> None:
    """The ``torch.backends`` entry point: in the ``composer`` command, before it imports
    Composer's launcher, set foundryx's signal handler and have :class:`_Swap` give the
    command foundryx's ``main``. Anywhere else, nothing. Never raises: torch's import would
    fail with it."""
    if not _composer_command() or os.environ.get("FOUNDRYX_LAUNCHER") == "0":
        return
    try:
        _RELAY.install()
        _KEEP.enter_context(preempt.kept(HELD))  # Composer's engine sets SIGTERM's as it is imported
        sys.meta_path.insert(0, _Swap())
    except Exception as e:  # noqa: BLE001 - said in one line; Composer's launcher runs as it is
        print(f"foundryx: Composer's launcher runs without foundryx's signal handling ({e})",
              file=sys.stderr)


def _composer_command() -> bool:
    """Whether this process is the ``composer`` console script, its launcher not imported yet."""
    script = getattr(sys.modules.get("__main__"), "__file__", None) or ""
    return (Path(script).name == "composer" and Path(sys.argv[0] if sys.argv else "").name == "composer"
            and LAUNCHER not in sys.modules)


class _Swap(importlib.abc.MetaPathFinder):
    """Finds ``composer.cli.launcher`` as the other finders do, and once it has run, keeps its
    ``main`` as ``composer_main`` and puts foundryx's :func:`main` in its place (what the
    ``composer`` command's ``from composer.cli.launcher import main`` then gets)."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name != LAUNCHER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module: types.ModuleType) -> None:
            run(module)
            module.composer_main, module.main = module.main, main

        spec.loader.exec_module = exec_module  # this spec's own loader object
        return spec


def _composer() -> Any:
    """Composer's launcher module."""
    return sys.modules[LAUNCHER]


def foundryx_script(script: str, *, module_mode: bool = False, command_mode: bool = False) -> bool:
    """Whether the launched script is foundryx's: a module under ``foundryx``, the
    ``foundryx`` command, or a file that imports foundryx (train.py, eval/eval.py, ...)."""
    if module_mode:
        return script.split(".")[0] == "foundryx"
    if command_mode:
        return Path(script).name == "foundryx"
    try:
        text = Path(script).read_text(errors="replace")
    except OSError:
        return False
    return re.search(r"^\s*(from|import)\s+foundryx\b", text, re.MULTILINE) is not None


class _Relay:
    """The launcher's handler: note the first signal and pass it on to the running ranks, and
    again each second (:meth:`again`) until they exit."""

    def __init__(self) -> None:
        self.processes: dict[int, subprocess.Popen] = {}
        self.signum = 0
        self.last = 0.0

    def install(self) -> None:
        preempt.install(self._handle, HELD)

    def _handle(self, signum: int, frame: Any) -> None:
        self.signum = self.signum or signum
        self.forward()

    def forward(self) -> None:
        self.last = time.monotonic()
        for process in list(self.processes.values()):
            if process.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(process.pid, self.signum)

    def again(self) -> None:
        if self.signum and time.monotonic() - self.last >= FORWARD_EVERY_S:
            self.forward()


def stopped_by(code: int, signum: int) -> bool:
    """Whether a rank's exit code is the signal's default end (128 + n, or -n from Popen)."""
    return bool(signum) and code in (128 + signum, -signum)


def outcome(codes: dict[int, int], signum: int) -> tuple[int, str | None]:
    """The launcher's exit code and line, every rank having exited with ``codes`` (by rank),
    ``signum`` the signal the launcher got (0: none)."""
    name = signal.Signals(signum).name if signum else "a preemption signal"
    values = list(codes.values())
    if all(c == 0 for c in values):
        return 0, (f"foundryx: {name} came as the run ended; it had finished: exit 0"
                   if signum else None)
    if all(c in (0, preempt.PREEMPTED) for c in values):
        return preempt.PREEMPTED, (
            f"foundryx: preempted by {name}: every rank stopped cleanly (rank 0's line above says "
            f"where: a checkpoint, or before training began); exit {preempt.PREEMPTED}: the same "
            f"command continues the run")
    if all(c in (0, preempt.PREEMPTED) or stopped_by(c, signum) for c in values):
        return 128 + signum, (
            f"foundryx: stopped by {name} without a checkpoint (the ranks do not save on it: no "
            f"save_folder, or callbacks.preemption: null; ranks' exit codes "
            f"{', '.join(str(c) for c in values)}); exit {128 + signum}")
    code = next(c for c in values if c not in (0, preempt.PREEMPTED) and not stopped_by(c, signum))
    return (128 - code if code < 0 else code), None


def _wait(real: Any, processes: dict[int, subprocess.Popen], relay: _Relay) -> int:
    """Until every rank has exited: a rank that fails (not 0, 75 or the signal's end) is
    Composer's case (the others stopped, its output printed); else :func:`outcome`."""
    while True:
        relay.again()
        codes = {rank: p.poll() for rank, p in processes.items()}
        failed = [(rank, c) for rank, c in codes.items() if c is not None
                  and c not in (0, preempt.PREEMPTED) and not stopped_by(c, relay.signum)]
        if failed:
            rank, code = failed[0]
            real.log.error("Rank %s crashed with exit code %s.", rank, code)
            real._cleanup_processes(processes)
            return 128 - code if code < 0 else code
        if all(c is not None for c in codes.values()):
            code, line = outcome(codes, relay.signum)
            if line:
                print(line, file=sys.stderr, flush=True)
            return code
        time.sleep(0.1)


@contextlib.contextmanager
def _ranks_hold_signals():
    """The ranks launched inside start with the signals blocked, and told so (they release
    them as foundryx is imported: foundryx.runtime.preempt.release_held)."""
    os.environ[preempt.HELD_ENV] = ",".join(str(s) for s in HELD)
    try:
        with preempt.held(HELD):
            yield
    finally:
        os.environ.pop(preempt.HELD_ENV, None)


_RELAY = _Relay()
_KEEP = contextlib.ExitStack()


def main() -> int:
    """The ``composer`` command with foundryx's signal handling (see the module docstring)."""
    real, relay = _composer(), _RELAY
    _KEEP.close()
    args = real._parse_args()
    mosaic = os.environ.get(real.MOSAICML_PLATFORM_ENV_VAR, "false").lower() == "true"
    if mosaic or not foundryx_script(args.training_script, module_mode=args.module_mode,
                                     command_mode=args.command_mode):
        preempt.restore()  # Composer's launcher as it is, with its handlers
        return real.composer_main()
    logging.basicConfig()
    real.log.setLevel(logging.INFO if args.verbose else logging.WARNING)
    processes = relay.processes
    if relay.signum:
        print(f"foundryx: {signal.Signals(relay.signum).name} before the ranks started: nothing "
              f"to save; exit {preempt.PREEMPTED}", file=sys.stderr, flush=True)
        return preempt.PREEMPTED
    with tempfile.TemporaryDirectory() as tmp:
        try:
            with _ranks_hold_signals():
                real._launch_processes(
                    nproc=args.nproc, world_size=args.world_size, base_rank=args.base_rank,
                    node_rank=args.node_rank, master_addr=args.master_addr,
                    master_port=args.master_port, module_mode=args.module_mode,
                    command_mode=args.command_mode, training_script=args.training_script,
                    stdout_file_format=args.stdout or f"{tmp}/rank{{rank}}.stdout.txt",
                    stderr_file_format=args.stderr or f"{tmp}/rank{{rank}}.stderr.txt",
                    training_script_args=args.training_script_args, processes=processes)
            return _wait(real, processes, relay)
        except BaseException as e:  # Ctrl-C (Composer's SIGINT handler: SystemExit), a launch error
            if isinstance(e, Exception):
                traceback.print_exc()
            real._cleanup_processes(processes)
            code = e.code if isinstance(e, SystemExit) and isinstance(e.code, int) else 1
            return real._aggregate_process_returncode(processes) or code
