"""``foundryx launch [-n N] SCRIPT ARGS``: Composer's launcher, with foundryx's handling of a
scheduler's signal. A launcher the user chooses; ``composer SCRIPT ARGS`` stays Composer's own.

Composer's launcher (``composer/cli/launcher.py``) starts one process per device and watches
them. On its own, a scheduler's SIGTERM (Slurm signals every task of the job, ``kill -TERM
-PGID`` the process group, Kubernetes a container's first process) makes it print a traceback
(``SystemExit: 143`` in ``_monitor_processes``: ``import composer`` sets a SIGTERM handler that
exits 143), send the ranks SIGTERM again and SIGKILL them 30 s later, and a signal while it is
still importing Composer is swallowed by the import (the ranks never hear of it). The ranks
themselves, a script that imports foundryx, save and exit 75 either way
(foundryx.runtime.preempt, foundryx.callbacks.preemption). This command adds what a launcher
must do for that to reach the scheduler whole:

- its own handler of the preemption signals (foundryx.runtime.preempt.DEFAULT_SIGNALS) is the
  first thing it sets, before Composer is imported, and Composer's import leaves it in place
  (foundryx.runtime.preempt.kept): no signal is lost or kills it;
- the ranks start with those signals held (``FOUNDRYX_HELD_SIGNALS``; their ``import
  foundryx`` releases them into a handler that notes them, foundryx.runtime.preempt), so a rank
  that has not set its handler yet is not killed by one either;
- it passes a signal on to every rank, again each second until they exit (a rank that was
  still starting, or a launcher signalled alone), and waits for them: no 30-second kill, the
  scheduler's own grace bounds it;
- with more than one rank and no ``OMP_NUM_THREADS`` set, each rank gets cores / ranks
  threads, said in one line (:func:`rank_threads`);
- it ends with one line and exit 75 (foundryx.runtime.preempt.PREEMPTED) when the ranks stopped
  for the signal (a checkpoint saved, or training had not begun), 0 when the run finished. A
  rank that fails otherwise is Composer's case (the others stopped, its output printed).

Everything else is Composer's: its flags (``-n/--nproc``, ``--world_size``, ``--base_rank``,
``--node_rank``, ``--master_addr``, ``--master_port``, ``--stdout``, ``--stderr``, ``-m``,
``-c``, ``-v``) and their environment defaults are parsed by its own ``_parse_args``, and its
``_launch_processes`` starts the ranks (the same command lines and environment). A script that
does not import foundryx (read from its text: ``import foundryx`` or ``from foundryx``; a
``-m foundryx...`` module; the ``foundryx`` command under ``-c``) would keep the held signals
blocked for good: it is run by Composer's ``main`` as ``composer`` runs it, said in one line,
as is any run on the MosaicML platform (``MOSAICML_PLATFORM=true``, whose log files Composer's
``main`` sets up).

Imported by the ``foundryx`` command's shell at start (``foundryx --help`` stays fast):
standard library and foundryx's ground floor only at module level; Composer inside
:func:`main`, after the handler is set.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from foundryx.runtime import known_warnings, preempt
from foundryx.runtime.stack import frozen_missing

PROG = "foundryx launch"
COMPOSER_LAUNCHER = "composer.cli.launcher"
HELD = preempt.numbers(preempt.DEFAULT_SIGNALS)
FORWARD_EVERY_S = 1.0

USAGE = "foundryx launch [-n N] [Composer's launcher flags] SCRIPT [ARGS ...]"
HELP = "start N processes of a training script (Composer's launcher, exit 75 when preempted)"
DESCRIPTION = """Start N processes of a training script, as Composer's launcher (`composer`) does, with
the same flags, and end as a scheduler needs: a SIGTERM or SIGUSR1 (Slurm, Kubernetes, systemd,
kill -TERM -PGID) is passed on to every rank, the launcher waits for them to save, and ends with
one line and exit 75 (preempted, the same command continues the run), 0 when the run finished.

  foundryx launch -n 2 train.py yamls/quickstart.yaml max_duration=20ba
  foundryx launch -n 8 --world_size 32 --node_rank 1 --master_addr 10.0.0.1 --master_port 29500 train.py CFG

See docs/operations.md, "Which launcher"."""


class Relay:
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


def _wait(composer: Any, processes: dict[int, subprocess.Popen], relay: Relay) -> int:
    """Until every rank has exited: a rank that fails (not 0, 75 or the signal's end) is
    Composer's case (the others stopped, its output printed); else :func:`outcome`."""
    while True:
        relay.again()
        codes = {rank: p.poll() for rank, p in processes.items()}
        failed = [(rank, c) for rank, c in codes.items() if c is not None
                  and c not in (0, preempt.PREEMPTED) and not stopped_by(c, relay.signum)]
        if failed:
            rank, code = failed[0]
            composer.log.error("Rank %s crashed with exit code %s.", rank, code)
            composer._cleanup_processes(processes)
            return 128 - code if code < 0 else code
        if all(c is not None for c in codes.values()):
            code, line = outcome(codes, relay.signum)
            if line:
                print(line, file=sys.stderr, flush=True)
            return code
        time.sleep(0.1)


@contextlib.contextmanager
def _ranks_hold_signals() -> Iterator[None]:
    """The ranks launched inside start with the signals blocked, and told so (they release
    them as foundryx is imported: foundryx.runtime.preempt.release_held)."""
    os.environ[preempt.HELD_ENV] = ",".join(str(s) for s in HELD)
    try:
        with preempt.held(HELD):
            yield
    finally:
        os.environ.pop(preempt.HELD_ENV, None)


@contextlib.contextmanager
def _as_foundryx_launch(composer: Any, argv: list[str]) -> Iterator[None]:
    """Inside, Composer's ``_parse_args`` reads ``argv`` under the name ``foundryx launch`` (its
    usage, errors and ``--help``, with :data:`DESCRIPTION`); both as they were after."""
    saved_argv, get_parser = sys.argv, composer._get_parser

    def parser() -> Any:
        p = get_parser()
        p.prog, p.description = PROG, DESCRIPTION
        p.formatter_class = argparse.RawDescriptionHelpFormatter
        return p

    sys.argv, composer._get_parser = [PROG, *argv], parser
    try:
        yield
    finally:
        sys.argv, composer._get_parser = saved_argv, get_parser


def rank_threads(environ: dict[str, str] | os._Environ, nproc: int, cores: int
                 ) -> tuple[str | None, str | None]:
    """``(OMP_NUM_THREADS for each rank, the line saying so)``, or ``(None, None)`` where the
    user set it or one rank runs. Each rank's torch would otherwise take a thread per core, so
    N ranks run N threads a core and spin at every OpenMP barrier (``foundryx launch -n 2
    train.py yamls/quickstart.yaml max_duration=12ba`` on a loaded 2-core VM, 2026-11-29: 169.5
    and 106.1 s with torch's default, 75.3 and 79.5 s with 1); torchrun sets 1 for that reason."""
    if "OMP_NUM_THREADS" in environ or nproc <= 1:
        return None, None
    n = max(1, cores // nproc)
    return str(n), (f"foundryx: launch: OMP_NUM_THREADS={n} in each of the {nproc} ranks "
                    f"({cores} cores / {nproc} ranks: a thread per core in every rank would "
                    f"oversubscribe the cores); set OMP_NUM_THREADS to choose")


@contextlib.contextmanager
def _ranks_threads(nproc: int) -> Iterator[None]:
    """The ranks start with :func:`rank_threads`'s ``OMP_NUM_THREADS`` (said in one line)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        os.cpu_count() or 1
    value, line = rank_threads(os.environ, nproc, cores)
    if value is None:
        yield
        return
    print(line, file=sys.stderr, flush=True)
    os.environ["OMP_NUM_THREADS"] = value
    try:
        yield
    finally:
        os.environ.pop("OMP_NUM_THREADS", None)


def main(argv: list[str]) -> int:
    """``foundryx launch ARGV``: the exit code (see the module docstring)."""
    relay = Relay()
    relay.install()  # first: a signal from here on is noted, and passed on once ranks run
    known_warnings.install(preimport=False)  # torchao's import-time line as Composer imports it
    problem = frozen_missing()
    if problem:
        print(f"foundryx: error: {problem}", file=sys.stderr)
        return 2
    with preempt.kept(HELD):  # `import composer` sets a SIGTERM handler that exits 143
        composer = importlib.import_module(COMPOSER_LAUNCHER)  # heavy: torch and Composer
    try:
        with _as_foundryx_launch(composer, argv):
            args = composer._parse_args()
    except ValueError as e:  # Composer's checks of the flags (nproc, world_size, node_rank, ...)
        print(f"{PROG}: error: {e}", file=sys.stderr)
        return 2
    if relay.signum:
        print(f"foundryx: {signal.Signals(relay.signum).name} before the ranks started: nothing "
              f"to save; exit {preempt.PREEMPTED}", file=sys.stderr, flush=True)
        return preempt.PREEMPTED
    mosaic = os.environ.get(composer.MOSAICML_PLATFORM_ENV_VAR, "false").lower() == "true"
    if mosaic or not foundryx_script(args.training_script, module_mode=args.module_mode,
                                     command_mode=args.command_mode):
        why = ("on the MosaicML platform (MOSAICML_PLATFORM=true), whose log files Composer's "
               "launcher sets up" if mosaic else f"{args.training_script} does not import foundryx "
               f"(its ranks would never release the signals foundryx holds for them)")
        print(f"foundryx: launch: {why}: Composer's launcher runs it as `composer` would, without "
              f"foundryx's signal handling", file=sys.stderr, flush=True)
        preempt.restore()  # Composer's handlers, as the composer command has them
        with _as_foundryx_launch(composer, argv):
            return composer.main()
    logging.basicConfig()
    composer.log.setLevel(logging.INFO if args.verbose else logging.WARNING)
    processes = relay.processes
    with tempfile.TemporaryDirectory() as tmp:
        try:
            with _ranks_hold_signals(), _ranks_threads(args.nproc):
                composer._launch_processes(
                    nproc=args.nproc, world_size=args.world_size, base_rank=args.base_rank,
                    node_rank=args.node_rank, master_addr=args.master_addr,
                    master_port=args.master_port, module_mode=args.module_mode,
                    command_mode=args.command_mode, training_script=args.training_script,
                    stdout_file_format=args.stdout or f"{tmp}/rank{{rank}}.stdout.txt",
                    stderr_file_format=args.stderr or f"{tmp}/rank{{rank}}.stderr.txt",
                    training_script_args=args.training_script_args, processes=processes)
            return _wait(composer, processes, relay)
        except BaseException as e:  # Ctrl-C (Composer's SIGINT handler: SystemExit), a launch error
            if isinstance(e, Exception):
                traceback.print_exc()
            composer._cleanup_processes(processes)
            code = e.code if isinstance(e, SystemExit) and isinstance(e.code, int) else 1
            return composer._aggregate_process_returncode(processes) or code
