"""The ``foundryx`` command: a thin shell over library functions.

User errors (:class:`foundryx.errors.FoundryxError`) print one message, no traceback, and
exit with code 2 (a :class:`~foundryx.errors.RunError`, such as a killed dataloader worker:
code 1, printed by the rank that saw it). Training, eval and export load torch and Composer
(seconds); their modules are imported when the command runs, after the config passed the
checks that need none of them (:func:`foundryx.config.load.precheck`), so ``foundryx --help``,
the data commands and a config's mistakes answer in a fraction of a second. Each subcommand's
arguments and handler live in ``foundryx/cli/<name>_command.py``; this module is the shell.
``foundryx launch`` (``foundryx/cli/launch.py``: Composer's launcher, with a scheduler's signal
passed on to the ranks and exit 75) is handed its words before this shell parses any: its
flags are Composer's, read by Composer's parser.

``train``, ``plan``, ``eval``, ``doctor`` and ``export`` take ``key=value`` overrides anywhere
on the line (:func:`split_overrides`), before or after the flags.
"""

from __future__ import annotations

import argparse
import atexit
import gc
import platform
import sys
from typing import NoReturn

from foundryx import __version__
from foundryx.cli import (
    data_command,
    doctor_command,
    eval_command,
    export_command,
    launch,
    registry_command,
    report_command,
    train_command,
)
from foundryx.cli.common import is_rank_zero
from foundryx.config.load import is_override
from foundryx.errors import FoundryxError
from foundryx.plan.command import add_parser as add_plan_parser
from foundryx.runtime import known_warnings, preempt
from foundryx.runtime.stack import frozen_missing

DESCRIPTION = """LLM training on Composer: train, evaluate, export and plan runs from one YAML config.

Commands that take a config also take key=value overrides of it, anywhere on the line:
  foundryx train yamls/quickstart.yaml max_duration=20ba --dry-run
  foundryx plan yamls/mpt-1b.yaml --gpus 8 global_train_batch_size=512

Several processes (FSDP2, tensor parallelism; one per GPU), with Composer's launcher flags:
  foundryx launch -n 2 train.py yamls/quickstart.yaml max_duration=20ba
(`composer -n 2 train.py ...` starts the same ranks; `foundryx launch` also passes a scheduler's
SIGTERM on to them, waits while they save, and exits 75: docs/operations.md, "Which launcher".)
"""


def versions() -> str:
    """``foundryx --version``: foundryx and what it runs on (read without importing them)."""
    import importlib.metadata  # 30 ms: this flag's alone

    def v(dist: str) -> str:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    return (f"foundryx {__version__} (composer {v('mosaicml')}, torch {v('torch')}, "
            f"transformers {v('transformers')}, python {platform.python_version()})")


class _Version(argparse.Action):
    """``--version``: the versions are read only when asked for."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the versions of foundryx and what it runs on, and exit")

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        print(versions())
        parser.exit()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="foundryx", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action=_Version)
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    # `foundryx launch ...` is dispatched before parsing (main): Composer's parser reads its
    # words; listed here for `foundryx --help`.
    sub.add_parser("launch", help=launch.HELP, add_help=False, usage=launch.USAGE,
                   description=launch.DESCRIPTION,
                   formatter_class=argparse.RawDescriptionHelpFormatter)
    for add in (train_command.add_parser, registry_command.add_parser, data_command.add_parser,
                export_command.add_parser, eval_command.add_parser, add_plan_parser,
                report_command.add_parser, doctor_command.add_parser):
        add(sub)
    return p


# Commands whose config takes key=value overrides (their ``overrides`` argument).
OVERRIDE_COMMANDS = ("train", "plan", "eval", "doctor", "export")


def _subcommands(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    return next((a.choices for a in p._actions if isinstance(a, argparse._SubParsersAction)), {})


def _innermost(p: argparse.ArgumentParser, argv: list[str]) -> argparse.ArgumentParser:
    """The (sub)command parser the words ``argv`` end up in, e.g. ``foundryx data convert``'s."""
    for word in argv:
        inner = _subcommands(p).get(word)
        if inner is not None:
            p = inner
    return p


def _takes_value(sub: argparse.ArgumentParser, word: str) -> bool:
    """Whether ``word`` is one of ``sub``'s options that is followed by its value."""
    if not word.startswith("-") or "=" in word:
        return False
    action = sub._option_string_actions.get(word)
    if action is None:  # an abbreviation (--gpu-mem): argparse accepts unique prefixes
        found = [a for o, a in sub._option_string_actions.items() if o.startswith(word)]
        action = found[0] if len({id(a) for a in found}) == 1 else None
    return action is not None and action.nargs != 0


def split_overrides(sub: argparse.ArgumentParser, words: list[str]) -> tuple[list[str], list[str]]:
    """``(words without the key=value overrides, the overrides)``: an override is a word of
    the form ``key=value`` (``a.b[0]=x``) anywhere, except as the value of an option."""
    rest, overrides = [], []
    for i, word in enumerate(words):
        after_option = i > 0 and _takes_value(sub, words[i - 1])
        (overrides if is_override(word) and not after_option else rest).append(word)
    return rest, overrides


def parse(argv: list[str]) -> argparse.Namespace:
    """The command line as a Namespace; a usage error exits 2 with the usage of the command
    it is in (``foundryx plan: error: ...``), not the top-level one."""
    p = parser()
    command = next((w for w in argv if not w.startswith("-")), None)
    sub = _subcommands(p).get(command) if command in OVERRIDE_COMMANDS else None
    overrides: list[str] = []
    if sub is not None:
        at = argv.index(command) + 1
        rest, overrides = split_overrides(sub, argv[at:])
        argv = argv[:at] + rest
    args, extras = p.parse_known_args(argv)
    if sub is None:
        if extras:
            _innermost(p, argv).error(f"unrecognized arguments: {' '.join(extras)}")
        return args
    # Words after the flags that are not key=value: shown as malformed overrides, not a usage.
    args.overrides = [*args.overrides, *overrides, *(w for w in extras if not w.startswith("-"))]
    flags = [w for w in extras if w.startswith("-")]
    if flags:
        sub.error(f"unrecognized arguments: {' '.join(flags)} (see foundryx {command} --help)")
    return args


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:  # Composer's launcher flags, read by Composer's parser
        return launch.main(argv[1:])
    args = parse(argv)
    known_warnings.install(preimport=False)  # every subcommand: see docs/operations.md
    problem = frozen_missing() if args.command != "doctor" else None
    if problem:
        print(f"foundryx: error: {problem}", file=sys.stderr)
        return 2
    preempt.new_run()  # in a process that ran a command before (tests): its signal is not ours
    try:
        return args.fn(args)
    except preempt.Preempted as e:  # a scheduler's signal before training began
        preempt.stop(None)  # the same signal again (the launcher repeats it) must not kill the exit
        print(preempt.said(preempt.before_training_line(e.signum)), file=sys.stderr, flush=True)
        return preempt.PREEMPTED
    except KeyboardInterrupt:
        if not preempt.interrupted():  # Ctrl-C outside training: Python's own way out
            raise
        preempt.stop(None)  # a third Ctrl-C must not interrupt the way out
        return preempt.INTERRUPTED  # the line is said: foundryx.runtime.preempt._interrupt
    except FoundryxError as e:
        if preempt.received():
            return _preempted(e)
        if is_rank_zero() or not e.rank_zero_only:
            print(f"foundryx: error: {e}", file=sys.stderr)
        return e.exit_code
    except Exception as e:
        if preempt.received():
            return _preempted(e)
        raise


def _preempted(error: BaseException) -> int:
    """A failure after a preemption signal (another rank left first and broke a collective):
    one line naming the signal, not the traceback; exit foundryx.runtime.preempt.PREEMPTED."""
    preempt.stop(None)
    if preempt.interrupted() > 1:  # a second Ctrl-C, turned into this error on its way out
        return preempt.INTERRUPTED  # its line is said
    print(preempt.said(preempt.failed_line(preempt.received(), error)), file=sys.stderr, flush=True)
    return preempt.INTERRUPTED if preempt.interrupted() else preempt.PREEMPTED


def run(argv: list[str] | None = None) -> NoReturn:
    """A foundryx process from start to exit: the console script, ``train.py`` (once per rank
    under the composer launcher) and ``eval/eval.py``. ``main`` and then exit, skipping the
    interpreter's final garbage collection, which walks every object torch, transformers and
    Composer made and takes ~3 s of a 2-core machine's time per process (measured: ``import
    composer`` then exit, 13.0 s; with the objects frozen first, 10.3 s). atexit handlers and
    every module's cleanup still run; only cyclic garbage is left to the operating system (not in
    a process that loaded Triton's nanobind extension: :func:`_nanobind_extension_loaded`)."""
    atexit.register(_release_process_group)  # first in, so last out: after Composer's own
    preempt.whole_process()  # a run's signals stay foundryx's until the process exits
    argv = list(sys.argv[1:] if argv is None else argv)
    code = main(argv)
    preempt.leaving()  # a launcher's SIGTERM to a rank on its way out: not a traceback
    if argv[:1] == ["eval"]:
        _exit_after_handlers(code)
    if not _nanobind_extension_loaded():
        gc.freeze()
    sys.exit(code)


def _exit_after_handlers(code: int) -> NoReturn:
    """End ``foundryx eval`` as the interpreter would, up to its teardown: wait for the
    threads it would wait for, run the atexit handlers (logging's flush, multiprocessing's
    reaping, a logger's upload), flush stdout and stderr, then exit with ``code`` without
    tearing down every module's objects: 0.2-0.3 s of a small eval's ~6.5 s command on a
    2-core machine (measured after the last atexit handler, 3 runs; benchmarks/RESULTS.md,
    issue 55). What it leaves out is what the results files do not need: the objects torch
    and the model made, freed by the operating system instead."""
    import os
    import threading

    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a broken pipe: nothing left to say there
            pass
    os._exit(int(code or 0))


def _release_process_group() -> None:
    """Destroy this rank's default process group, if it has one, as the interpreter ends (the
    last atexit handler: Composer's, which may still use the group, run before it).
    A rank that leaves with it alive (after an error every rank agreed on, say) can die in its
    C++ teardown ("terminate called without an active exception", seen on a loaded CI machine
    with gloo), which turns the agreed exit code 2 into an abort."""
    dist = sys.modules.get("torch.distributed")
    try:
        if dist is not None and dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - exiting anyway; the exit code is what matters
        pass


def _nanobind_extension_loaded() -> bool:
    """Whether Triton's nanobind-built extension is loaded (Triton >= 3.9, torch 2.15): nanobind
    reports every object of its types still alive when the interpreter ends ("nanobind: leaked
    514 functions!", ~100 lines on stderr), which frozen objects are, so such a process exits
    with the ordinary final collection (its ~3 s) instead."""
    ext = sys.modules.get("triton._C.libtriton")
    context = getattr(getattr(ext, "ir", None), "context", None)
    return context is not None and type(context).__name__.startswith("nb_type")
