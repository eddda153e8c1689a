"""A dataloader worker that dies during a run, as one message instead of torch's traceback.

When a worker process of a ``DataLoader`` is killed (most often by the kernel's OOM killer,
which picks the process with the most memory, or by ``kill -9``), torch raises a bare
``RuntimeError: DataLoader worker (pid 1234) is killed by signal: Killed.`` from whatever the
main process was doing: deep inside the model's forward, or an evaluation. The training
entry point (:mod:`foundryx.train`) passes such an error to :func:`worker_death_error`, which
returns a :class:`~foundryx.errors.RunError` naming the loader, the worker's pid, the signal,
the batch and sample the run had reached, the likely causes and how to go on; any other
error gives ``None`` and propagates unchanged.
"""

from __future__ import annotations

import contextlib
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from foundryx.errors import RunError

# torch's three wordings: the SIGCHLD handler (torch/csrc/DataLoader.cpp), signal or exit
# code known; and the periodic liveness check of the main process (dataloader.py), not known.
_KILLED = re.compile(r"DataLoader worker \(pid (\d+)\) is killed by signal: ([^.]*)\.")
_EXITED = re.compile(r"DataLoader worker \(pid (\d+)\) exited unexpectedly with exit code (-?\d+)")
_LOST = re.compile(r"DataLoader worker \(pid\(s\) ([\d, ]+)\) exited unexpectedly")


@dataclass(frozen=True)
class WorkerDeath:
    """What torch's error says: the dead workers' pids, and the signal or exit code."""

    pids: tuple[int, ...]
    signal: str | None = None  # e.g. "SIGKILL"
    exit_code: int | None = None

    def how(self) -> str:
        if self.signal:
            return f"was killed by signal {self.signal}"
        if self.exit_code is not None:
            return f"exited with code {self.exit_code}"
        return "exited unexpectedly"


def _signal_name(description: str) -> str:
    """``"Killed"`` (strsignal's text, which torch prints) -> ``"SIGKILL"``."""
    for sig in signal.Signals:
        if signal.strsignal(sig) == description:
            return sig.name
    return repr(description)


def parse_worker_death(err: BaseException) -> WorkerDeath | None:
    """The worker death torch reports in ``err``, or None when ``err`` is something else."""
    if isinstance(err, (ConnectionError, EOFError)):
        return _from_iterator(err)
    if not isinstance(err, RuntimeError):
        return None
    text = str(err)
    if m := _KILLED.search(text):
        return WorkerDeath((int(m[1]),), signal=_signal_name(m[2].strip()))
    if m := _EXITED.search(text):
        return WorkerDeath((int(m[1]),), exit_code=int(m[2]))
    if m := _LOST.search(text):  # the liveness check: no signal in the text, the iterator has it
        pids = tuple(int(p) for p in m[1].split(",") if p.strip())
        known = _from_iterator(err)
        return known if known is not None and known.pids[0] in pids else WorkerDeath(pids)
    return None


# A worker killed while it hands a batch over (tensors travel as file descriptors) surfaces as
# ConnectionResetError / EOFError in the main process, with no pid in the message (torch 2.14),
# and torch's liveness check names pids but no signal. The dataloader iterator is a frame of the
# traceback of both; its dead workers say who died and how.
_FETCH_FRAMES = {"_try_get_data", "_get_data", "_next_data"}


def _from_iterator(err: BaseException) -> WorkerDeath | None:
    tb = err.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        workers = getattr(frame.f_locals.get("self"), "_workers", None)
        if frame.f_code.co_name in _FETCH_FRAMES and workers:
            try:
                dead = _dead(workers)
            except RuntimeError as reported:  # torch's SIGCHLD handler fired while we waited
                return parse_worker_death(reported)
            if not dead:
                return None
            pid, code = dead[0]
            if code < 0:
                return WorkerDeath((pid,), signal=signal.Signals(-code).name)
            return WorkerDeath((pid,), exit_code=code)
        tb = tb.tb_next
    return None


def _dead(workers: list[Any], wait_s: float = 2.0) -> list[tuple[int, int]]:
    """``(pid, exit code)`` of the workers that have exited (waiting briefly to reap them)."""
    deadline = time.monotonic() + wait_s
    while True:
        dead = [(w.pid, w.exitcode) for w in workers if w.exitcode is not None]
        if dead or time.monotonic() > deadline:
            return dead
        time.sleep(0.05)


def _config_name(label: str) -> str:
    """The config section of a Composer dataloader label."""
    return {"train": "train_loader", "eval": "eval_loader"}.get(label, f"evaluator {label!r}")


def _loaders(state: Any) -> dict[str, Any]:
    """Config name -> torch DataLoader of every loader the trainer reads."""
    loaders = {"train_loader": getattr(state, "train_dataloader", None)}
    for evaluator in getattr(state, "evaluators", None) or []:
        spec = evaluator.dataloader
        loaders[_config_name(evaluator.label)] = getattr(spec, "dataloader", spec)
    return {name: dl for name, dl in loaders.items() if dl is not None}


def _whose(state: Any) -> list[tuple[str, Any]]:
    """The loaders the dead worker can have belonged to: those with worker processes.

    Not simply the loader being read (``state.dataloader_label``): the train loader's workers
    keep prefetching while an evaluation runs, and torch's error does not say whose worker it
    was. With several candidates the message names them all.
    """
    loaders = _loaders(state)
    with_workers = [(n, dl) for n, dl in loaders.items() if getattr(dl, "num_workers", 0) > 0]
    if with_workers:
        return with_workers
    name = _config_name(getattr(state, "dataloader_label", None) or "train")
    return [(name, loaders.get(name))]


def _quiet_sigchld() -> None:
    """Stop torch's SIGCHLD handler from raising again while the run ends.

    torch's handler raises ``RuntimeError: DataLoader worker ... is killed`` in whatever Python
    frame the main thread is running when the signal is handled. When the main process first
    learns of the death another way (a broken connection while a batch was handed over), the
    handler can fire a moment later, inside this translation or while the message is printed,
    and its traceback would replace the message. CPython looks the handler up when it runs a
    pending signal, so the default (SIGCHLD: do nothing) set here also silences one already
    pending. Only the main thread may set handlers; the run is ending, so no loader needs it.
    """
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)


@contextlib.contextmanager
def unraisable_deaths_kept_quiet() -> Iterator[list[BaseException]]:
    """While the block runs, a worker death that torch's SIGCHLD handler raises inside a
    finalizer (a ``__del__`` the garbage collector runs, e.g. ``tempfile``'s) is not printed.

    Python cannot raise from a finalizer: it prints "Exception ignored in ..." with the
    handler's traceback and goes on, and the main process hears of the death a moment later
    from the loader (its liveness check), which :func:`worker_death_error` turns into the one
    message. The traceback printed before it is noise; this hook keeps it out and yields the
    errors it kept back (for a run that ends on another error meanwhile). Every other
    unraisable exception goes to the hook that was there.
    """
    kept: list[BaseException] = []
    previous = sys.unraisablehook

    def hook(unraisable: Any) -> None:
        err = unraisable.exc_value
        if err is not None and parse_worker_death(err) is not None:
            kept.append(err)
        else:
            previous(unraisable)

    sys.unraisablehook = hook
    try:
        yield kept
    finally:
        sys.unraisablehook = previous


def worker_death_error(err: BaseException, state: Any, *, save_folder: str | None,
                       autoresume: bool) -> RunError | None:
    """A :class:`RunError` for a dataloader worker death reported by ``err`` during a run with
    Composer ``state``, or None when ``err`` is not one (see the module docstring)."""
    death = parse_worker_death(err)
    if death is None:
        return None
    _quiet_sigchld()
    from composer.utils import dist

    candidates = _whose(state)
    loader = " or ".join(name for name, _ in candidates)
    workers = " or ".join(
        (f"{name}.num_workers" if name.endswith("_loader") else f"the num_workers of {name}")
        + (f" (now {dl.num_workers})" if dl is not None else "") for name, dl in candidates)
    ts = state.timestamp
    pids = ", ".join(str(p) for p in death.pids)
    rank = f"rank {dist.get_global_rank()}: " if dist.get_world_size() > 1 else ""
    lines = [
        f"{rank}a dataloader worker of {loader} (pid {pids}) {death.how()} after batch "
        f"{int(ts.batch)} (sample {int(ts.sample)}, epoch {int(ts.epoch)}); training stopped there.",
    ]
    oom = (f"  Likely cause: the host ran out of memory and the kernel's OOM killer chose the "
           f"worker (check `dmesg` or `journalctl -k` for \"Killed process {death.pids[0]}\"); "
           f"lower {workers}, the batch size or max_seq_len, or give the job more memory. A job "
           f"scheduler or `kill -9` can also have sent the signal.")
    crash = ("  A crash inside the worker (native code, or a library calling exit) ends it this "
             "way; with num_workers: 0 the same error shows in the main process, with its "
             "traceback.")
    if death.exit_code is not None:
        lines.append(crash)
    elif death.signal == "SIGBUS":
        lines.append(f"  Likely cause: shared memory (/dev/shm) ran out; raise its size (e.g. "
                     f"`docker run --shm-size=16g`) or lower {workers}.")
    elif death.signal in (None, "SIGKILL"):
        lines.append(oom)
    else:
        lines += [oom, crash]
    if save_folder and autoresume:
        lines.append(f"  Run the same command again: autoresume continues from the newest "
                     f"checkpoint in {save_folder} (from the start if none was saved yet).")
    elif save_folder:
        lines.append(f"  Checkpoints are in {save_folder}, but autoresume is off for this run: "
                     "set autoresume=true (and save_overwrite=false) to continue from them.")
    else:
        lines.append("  This run saves no checkpoints (save_folder is not set), so running "
                     "it again starts from batch 0; set save_folder to make it resumable.")
    return RunError("\n".join(lines))
