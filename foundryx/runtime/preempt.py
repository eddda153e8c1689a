"""The preemption signals of one foundryx process: held while it starts, noted, then acted on.

A scheduler sends SIGTERM (Slurm, Kubernetes) or SIGUSR1 (Slurm's ``--signal``) to every
process of a job at any moment: while Python starts, while Composer is imported (its
``composer.core.engine`` sets a SIGTERM handler that exits 143 at once), while the model is
built, during a step, a save or an eval. Each of those moments ends in one of two ways:

- training had begun (the ``preemption`` callback's ``fit_start``): the signal is only noted;
  after each batch the ranks agree whether any got one, save that batch and exit
  :data:`PREEMPTED` (foundryx.callbacks.preemption);
- it had not: :class:`Preempted` is raised in the main thread, and the process prints one line
  (:func:`before_training_line`) and exits :data:`PREEMPTED`: nothing of this job needs saving.

The phases, in order: ``off`` (the handlers are not foundryx's), ``noting`` (a process started
by foundryx's launcher with the signals held, :func:`release_held`: note only, nothing to act on
yet), ``starting`` (``foundryx train`` from :func:`take_over`: note and raise), ``training``
(:func:`watch`: note only) and ``stopping`` (:func:`stop`, :func:`leaving`: ignored until the process exits).
Composer's import sets its own SIGTERM handler; ``foundryx train`` imports it inside
:func:`kept`, which leaves foundryx's in place. Standard library only: ``foundryx/__init__.py``
calls :func:`release_held` before anything else is imported.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

# EX_TEMPFAIL (sysexits.h): "a temporary failure; the user is invited to retry later". Not 0,
# which a scheduler reads as "finished" (a Kubernetes Job would not run again, a Slurm
# `afterok` dependency would start the next stage on an unfinished model); not 143 (128 +
# SIGTERM), which reads as "killed", work lost. docs/operations.md, "preemption".
PREEMPTED = 75
# Ctrl-C (SIGINT) while training: the first stops after the batch with a checkpoint, the second
# at once (:func:`_interrupt`); either way the process exits 130 (128 + SIGINT), as an
# interrupted command does: a wrapper that runs a job again on 75 does not run this one again.
INTERRUPTED = 130
DEFAULT_SIGNALS = ("SIGTERM", "SIGUSR1")
# Set by `foundryx launch` (foundryx.cli.launch) for the ranks it starts with these
# signals blocked: comma-separated signal numbers.
HELD_ENV = "FOUNDRYX_HELD_SIGNALS"


class Preempted(BaseException):
    """A preemption signal before training began. A BaseException, like KeyboardInterrupt:
    no ``except Exception`` on the way out catches it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


_state: dict[str, Any] = {"received": 0, "phase": "off", "watched": (), "previous": {},
                          "stopped_at": None, "owned": False, "began": False, "said": False,
                          "interrupts": 0, "batch": 0, "saved": None}


def numbers(names: Iterable[str]) -> tuple[int, ...]:
    """``("SIGTERM", ...)`` -> their numbers."""
    return tuple(int(getattr(signal, name)) for name in names)


def received() -> int:
    """The first preemption signal this process got, 0 for none."""
    return _state["received"]


def stopped_at() -> int | None:
    """The batch the run stopped after for a preemption signal (its checkpoint), or None."""
    return _state["stopped_at"]


def _handle(signum: int, frame: Any) -> None:
    if not _state["received"]:
        _state["received"] = signum
    if _state["phase"] == "starting":
        _state["phase"] = "noting"  # raised once: the way out is not interrupted again
        raise Preempted(signum)


def _interrupt(signum: int, frame: Any) -> None:
    """Ctrl-C while training (:func:`watch`): the first is noted as a preemption signal (the
    run stops after the batch, with a checkpoint) and said at once; the second stops now,
    saying which batches that loses (:class:`KeyboardInterrupt`, exit :data:`INTERRUPTED`)."""
    _state["interrupts"] += 1
    if _state["interrupts"] == 1 and _state["phase"] == "training":
        _state["received"] = _state["received"] or signum
        _say(f"foundryx: Ctrl-C: stopping after batch {_state['batch'] + 1} with a checkpoint, "
             f"then exit {INTERRUPTED}; Ctrl-C again stops at once, losing {_since_saved()}")
        return
    _state["said"] = True
    _say(f"foundryx: Ctrl-C again: stopped at once in batch {_state['batch'] + 1}; lost: "
         f"{_since_saved()}; exit {INTERRUPTED}")
    raise KeyboardInterrupt


def _since_saved() -> str:
    """The batches a stop now would lose: those since the last checkpoint of this run."""
    batch, saved = _state["batch"], _state["saved"]
    first = 1 if saved is None else saved + 1
    lost = ("nothing" if batch < first else f"batch {batch}" if batch == first
            else f"batches {first}-{batch}")
    return f"{lost} ({'no checkpoint yet' if saved is None else f'the last checkpoint is batch {saved}'})"


def _say(line: str) -> None:
    """One line on stderr from a signal handler, on rank 0 only (a terminal's Ctrl-C reaches
    every rank). ``os.write``: a print could interrupt a print of the main thread."""
    if os.environ.get("RANK", "0") == "0":
        os.write(2, f"\n{line}\n".encode())


def batch_done(batch: int) -> None:
    """Training finished ``batch`` (the preemption callback says so after each batch)."""
    _state["batch"] = batch


def checkpointed(batch: int) -> None:
    """This run's latest checkpoint is of ``batch`` (written, or resumed from)."""
    _state["saved"] = batch


def interrupted() -> int:
    """How many times Ctrl-C came while training (1: stopping after the batch, saved; 2 or
    more: stopped at once); 0: none."""
    return _state["interrupts"]


_OURS: list[Any] = [_handle, _interrupt]  # they stay in place inside kept() (and the launcher's)


def _install(signums: Iterable[int], phase: str) -> None:
    """Our handler for ``signums`` (see :func:`install`), in ``phase``."""
    install(_handle, signums)
    _state["phase"] = phase


def install(handler: Any, signums: Iterable[int]) -> None:
    """``handler`` for ``signums``, the handlers before it kept (once) for :func:`watch` and
    :func:`restore`; it stays in place inside :func:`kept`. (foundryx's launcher installs its
    own this way.)"""
    if handler not in _OURS:
        _OURS.append(handler)
    for signum in signums:
        previous = signal.signal(signum, handler)
        if previous not in _OURS:
            _state["previous"].setdefault(signum, previous)
    _state["watched"] = tuple(sorted(set(_state["watched"]) | set(signums)))


@contextlib.contextmanager
def held(signums: Iterable[int] = numbers(DEFAULT_SIGNALS)) -> Iterator[None]:
    """Block ``signums`` in this thread for the block (a signal meanwhile waits); the mask as it
    was after. Threads and processes started inside inherit the block."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, list(signums))
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


@contextlib.contextmanager
def kept(signums: Iterable[int] = numbers(DEFAULT_SIGNALS)) -> Iterator[None]:
    """Inside, ``signal.signal`` leaves foundryx's handler of ``signums`` in place and keeps the
    new one as the handler to give back (:func:`watch`, :func:`restore`). For imports that set
    their own: Composer's ``composer.core.engine`` sets a SIGTERM handler that exits 143 at once.
    (Blocking the signal meanwhile would not do: a thread that does not block it takes it, and
    Python runs the handler in place in the main thread.)"""
    signums, real = set(signums), signal.signal

    def keep(signum: int, handler: Any) -> Any:
        if signum in signums and signal.getsignal(signum) in _OURS:
            previous = _state["previous"].get(signum, signal.SIG_DFL)
            _state["previous"][signum] = handler
            return previous
        return real(signum, handler)

    signal.signal = keep
    try:
        yield
    finally:
        signal.signal = real


def release_held() -> None:
    """In a process foundryx's launcher started with the signals blocked (:data:`HELD_ENV`):
    note them from here on and unblock them. Nothing otherwise."""
    value = os.environ.pop(HELD_ENV, "")  # not for this process's own children
    signums = tuple(int(s) for s in value.split(",") if s.strip().isdigit())
    if signums:
        _install(signums, "noting")
        signal.pthread_sigmask(signal.SIG_UNBLOCK, list(signums))


def take_over(names: Iterable[str] = DEFAULT_SIGNALS) -> None:
    """``foundryx train``: from here a signal raises :class:`Preempted` (one that came
    earlier, held or noted, too) until :func:`watch` says training began."""
    signums = numbers(names)
    new_run()
    _install(signums, "starting")
    _Deadline.start(signums)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, list(signums))  # one held arrives here: raised
    if _state["received"]:
        _state["phase"] = "noting"
        raise Preempted(_state["received"])


def watch(signums: Iterable[int], *, training: bool) -> None:
    """The signals the run stops for (the ``preemption`` callback's; none when it is off):
    others go back to the handlers they had before foundryx's. ``training``: from now a signal
    is only noted (the callback acts on it after the batch). A signal noted before training
    began raises :class:`Preempted` here."""
    signums = tuple(signums)
    if training:
        new_run()
    before = _state["received"] if _state["phase"] in ("starting", "noting") else 0
    for signum in [s for s in _state["watched"] if s not in signums]:
        signal.signal(signum, _state["previous"].pop(signum, signal.SIG_DFL))
    _state["watched"] = ()
    if signums:
        _install(signums, "training" if training else _state["phase"])
        if training and threading.current_thread() is threading.main_thread():
            install(_interrupt, (int(signal.SIGINT),))  # Ctrl-C: save and stop, twice: stop now
    _state["began"] = _state["began"] or training
    if before:  # raised once already, and caught on the way (a finalizer): raised again here
        _state["phase"] = "noting"
        raise Preempted(before)


def new_run() -> None:
    """A run starting in a process where an earlier one ended (tests, a notebook): what that
    one noted is not this one's."""
    if _state["phase"] in ("off", "stopping"):
        _state.update(received=0, stopped_at=None, began=False, said=False, interrupts=0,
                      batch=0, saved=None)


def whole_process() -> None:
    """This process ends when its command does (the ``foundryx`` command, ``train.py``):
    after a run, the signals stay foundryx's (ignored) until it exits (:func:`owned`)."""
    _state["owned"] = True


def owned() -> bool:
    """Whether this process is a command's (:func:`whole_process`) that took the signals over
    (:func:`take_over`): they stay foundryx's until it exits."""
    return _state["owned"] and _state["phase"] != "off"


def stop(batch: int | None) -> None:
    """The run stops (after ``batch`` for a signal, or at its end: None): from here the
    signals are ignored until the process exits. Python resets a Python-level handler to the
    default action as the interpreter shuts down (a late SIGTERM there would kill the process:
    exit -15, a "crash" for the launcher), but it keeps SIG_IGN."""
    if batch is not None:
        _state["stopped_at"] = batch
    for signum in _state["watched"]:
        signal.signal(signum, signal.SIG_IGN)
    _state["phase"] = "stopping"


def leaving() -> None:
    """The command returned and its process now exits with the command's code: from here
    SIGTERM and SIGUSR1 are ignored. A launcher ends the other ranks once one has left (all
    of them leaving with the same error, exit 2, say): a signal that lands in an atexit
    callback must not turn that exit into a traceback, or into Composer's 143 (its handler,
    given back by :func:`restore`, calls ``sys.exit`` wherever the signal lands). A process
    stuck on its way out is still ended by the launcher's SIGKILL."""
    for signum in numbers(DEFAULT_SIGNALS):
        signal.signal(signum, signal.SIG_IGN)
    _state["phase"] = "stopping"


def restore() -> None:
    """The handlers as they were before foundryx's (a run that ends without a signal, in a
    process that goes on: tests, a notebook)."""
    for signum in _state["watched"]:
        signal.signal(signum, _state["previous"].pop(signum, signal.SIG_DFL))
    _state.update(watched=(), phase="off")
    _Deadline.end()


def exit_code() -> int:
    """What the process exits with after ``train`` returns: :data:`PREEMPTED` when it stopped
    for a signal before the run's end (:data:`INTERRUPTED` for Ctrl-C), else 0."""
    if _state["stopped_at"] is None:
        return 0
    return INTERRUPTED if _state["received"] == signal.SIGINT else PREEMPTED


class _Deadline:
    """A signal before training began ends the process within :attr:`GRACE_S` s, even when its
    main thread is blocked in C, where Python cannot run the handler (a rendezvous or a
    collective waiting for a rank that already left): a thread reads the signal numbers Python
    writes to its wakeup fd as each signal arrives, and, the grace passed with training not
    begun, says the line and exits :data:`PREEMPTED` (nothing of the job to save)."""

    GRACE_S = 10.0
    fds: tuple[int, int] | None = None

    @classmethod
    def start(cls, signums: tuple[int, ...]) -> None:
        if cls.fds is not None or threading.current_thread() is not threading.main_thread():
            return
        read, write = os.pipe()
        os.set_blocking(write, False)
        signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        cls.fds = (read, write)
        threading.Thread(target=cls._watch, args=(read, set(signums)), daemon=True,
                         name="foundryx-preempt-deadline").start()

    @classmethod
    def end(cls) -> None:
        if cls.fds is None:
            return
        if threading.current_thread() is threading.main_thread():
            signal.set_wakeup_fd(-1)
        os.close(cls.fds[1])  # the thread's read ends
        cls.fds = None

    @classmethod
    def _watch(cls, read: int, signums: set[int]) -> None:
        while True:
            try:
                got = os.read(read, 64)
            except OSError:
                return
            if not got:
                return os.close(read)
            signum = next((n for n in got if n in signums), 0)
            if signum and not _state["began"] and _state["phase"] != "off":
                time.sleep(cls.GRACE_S)
                if not _state["began"] and _state["phase"] != "off":
                    if not _state["said"]:
                        sys.stderr.write(before_training_line(signum) + "\n")
                        sys.stderr.flush()
                    os._exit(PREEMPTED)


def said(line: str) -> str:
    """``line``, noted as this process's one line about the signal (not said twice)."""
    _state["said"] = True
    return line


def before_training_line(signum: int) -> str:
    """The one line of a process stopped by a signal before training began."""
    return (f"foundryx: preemption: {signal.Signals(signum).name} before training began: nothing "
            f"of this job to save; exit {PREEMPTED} (the same command starts again, from the "
            f"latest checkpoint if any)")


def failed_line(signum: int, error: BaseException) -> str:
    """The one line of a process that failed after a preemption signal: the signal is the
    cause, the error its consequence (a collective broken by a rank that left first, an import
    it interrupted that turned :class:`Preempted` into an ImportError)."""
    what = f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}".rstrip(": ")
    when = "after training began" if _state["began"] else "before training began"
    return (f"foundryx: preemption: {signal.Signals(signum).name} {when}; it ended the run in "
            f"'{what[:200]}'; exit {PREEMPTED} (the same command starts again, from the latest "
            f"checkpoint if any)")
