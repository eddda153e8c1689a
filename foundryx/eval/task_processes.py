"""Tasks evaluated at once in forked processes (``task_processes``), the CPU's threads shared
between them.

On a CPU a small model's step is mostly per-operation overhead: Python, dispatch and tiny
kernels. Two tasks on two threads of one process (:mod:`foundryx.eval.task_threads`) share one
interpreter lock for that Python work; two processes do not. With the model loaded and the tasks
prepared, the eval process forks, and each process, on its share of the threads, takes the next
task not yet taken (longest first, :func:`foundryx.eval.task_threads.longest_first`; a counter in
shared memory) until none is left; the children send their results back through a pipe, which
the parent puts in the config's order.
A fork copies nothing up front: the model's weights and the prepared rows are shared until
written. The 20 results of ``benchmarks/eval_vs_llmfoundry.py`` took ~0.91x the time of two
tasks on two threads (4 alternating pairs, benchmarks/RESULTS.md), with less CPU.

``auto`` takes 2 for the native Llama on a Linux CPU with at least 2 threads, in one process,
when ``task_threads`` is ``auto`` too; else 1, and the thread rule applies. A number forks that
many processes (Linux, a CPU, one process). A child that fails sends its error back, which the
parent raises (foundryx's errors as they are, anything else with the child's traceback); a
child that dies (the OOM killer, a signal) is reported in one message naming its tasks (exit
1: running again may work); the parent that fails ends its children first.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import signal
import sys
import traceback
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import torch

from foundryx.errors import ConfigError, FoundryxError, RunError
from foundryx.eval.prepare import PreparedTask
from foundryx.eval.task_threads import longest_first

__all__ = ["FORKS", "choose_task_processes", "run_in_processes"]

T = TypeVar("T")
FORKS = sys.platform == "linux"  # elsewhere fork is missing (Windows) or unsafe (macOS)


def choose_task_processes(setting: int | str, task_threads: int | str, device: str, world: int,
                          threads: int, native: bool = True) -> tuple[int, str]:
    """``(processes, why)`` for ``task_processes`` = ``setting``; ``why`` is empty when it is 1
    under auto (the thread rule's line is said instead); a ConfigError for a number the run
    cannot take."""
    if isinstance(setting, int):
        if setting > 1 and (world > 1 or device != "cpu" or not FORKS):
            where = (f"{world} processes" if world > 1 else f"device {device}" if device != "cpu"
                     else sys.platform)
            raise ConfigError([f"task_processes: {setting} forks the eval process on a Linux CPU "
                               f"run as one process, not on {where}; set task_processes: 1 (or "
                               "auto)"])
        return setting, (f"tasks: {setting} processes at once (task_processes)" if setting > 1
                         else "")
    if FORKS and device == "cpu" and world == 1 and threads >= 2 and native and \
            task_threads == "auto":
        each = threads // 2
        return 2, (f"tasks: 2 at a time in 2 processes, {each} thread{'s' if each > 1 else ''} "
                   f"each (task_processes: auto on a CPU of {threads} threads; 1 for one at a "
                   "time)")
    return 1, ""


def run_in_processes(tasks: list[PreparedTask], evaluate: Callable[[int], T], processes: int,
                     at_once: int = 1) -> list[T]:
    """``[evaluate(i) for i in range(len(tasks))]`` over ``processes`` processes (this one and
    forked children), each taking the next task not yet taken, longest first, ``at_once`` at a
    time (threads); the results in the tasks' order."""
    order = longest_first(tasks)
    processes = min(processes, len(tasks))
    if processes <= 1:
        return [evaluate(i) for i in range(len(tasks))]
    ctx = mp.get_context("fork")
    taken = ctx.Value("i", 0)  # the next place in ``order``: shared memory and its lock
    owner = ctx.Array("i", len(order), lock=False)  # the pid that took each place

    def work() -> list[tuple[int, T]]:
        out = []
        while True:
            with taken.get_lock():
                k = taken.value
                taken.value += 1
                if k < len(order):
                    owner[k] = os.getpid()
            if k >= len(order):
                return out
            try:
                out.append((order[k], evaluate(order[k])))
            except BaseException:  # no process takes another task: the eval stops
                with taken.get_lock():
                    taken.value = len(order)
                raise

    def run() -> list[tuple[int, T]]:
        if at_once <= 1:
            return work()
        with ThreadPoolExecutor(at_once, thread_name_prefix="foundryx-task") as pool:
            return [r for part in pool.map(lambda _: work(), range(at_once)) for r in part]

    before = torch.get_num_threads()
    each = max(1, before // processes // max(1, at_once))
    torch.set_num_threads(each)
    children: list[tuple[int, int]] = []
    try:
        for _ in range(processes - 1):
            children.append(_fork(run, each))
        done = dict(run())
        while children:
            pid, fd = children.pop(0)  # _receive reaps it, whatever happens
            mine = [tasks[order[k]].key for k in range(len(order)) if owner[k] == pid]
            done.update(_receive(pid, fd, ", ".join(mine) or "no task"))
    finally:
        for pid, fd in children:  # this process failed: its children end with it
            _end(pid, fd)
        torch.set_num_threads(before)
    return [done[i] for i in range(len(tasks))]


def _fork(run: Callable[[], list[tuple[int, T]]], threads: int) -> tuple[int, int]:
    read, write = os.pipe()
    # the tokenizers library warns in a forked child once its thread pool has been used, unless
    # the variable is set: the child tokenizes nothing that needs it
    parallelism = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    pid = os.fork()
    if pid == 0:
        os.close(read)
        _child(write, run, threads)  # never returns
    if parallelism is None:
        del os.environ["TOKENIZERS_PARALLELISM"]
    os.close(write)
    return pid, read


def _child(fd: int, run: Callable[[], list[tuple[int, T]]], threads: int) -> None:
    """Evaluate tasks, send ``("ok", [(index, result), ...])`` or ``("error", exception,
    traceback)`` and leave without Python's clean-up (the parent's atexit work, buffers and
    files are its)."""
    try:
        torch.set_num_threads(threads)
        payload: tuple = ("ok", run())
    except BaseException as e:  # noqa: BLE001 - whatever it is, the parent raises it
        payload = ("error", e, traceback.format_exc())
    try:
        data = pickle.dumps(payload)
    except Exception:  # noqa: BLE001 - an error that does not pickle: its traceback does
        data = pickle.dumps(("error", None, payload[-1] if payload[0] == "error" else
                             traceback.format_exc()))
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os._exit(0)


def _receive(pid: int, fd: int, names: str) -> list[tuple[int, Any]]:
    try:
        with os.fdopen(fd, "rb") as f:
            data = f.read()
    except BaseException:  # interrupted while waiting: the child ends too
        _end(pid, None)
        raise
    _, status = os.waitpid(pid, 0)
    if not data:
        if os.WIFSIGNALED(status):
            how = f"was killed by signal {signal.Signals(os.WTERMSIG(status)).name}"
        else:
            how = f"exited with code {os.waitstatus_to_exitcode(status)}"
        raise RunError(f"the eval process evaluating {names} (pid {pid}) {how} before it sent "
                        "its results (the OOM killer, when memory ran out); task_processes: 1 "
                        "evaluates every task in this process")
    kind, *rest = pickle.loads(data)
    if kind == "ok":
        return rest[0]
    error, text = rest
    if isinstance(error, (FoundryxError, KeyboardInterrupt)):  # its message is the whole story
        raise error
    raise RuntimeError(f"the eval process evaluating {names} (pid {pid}) failed; its "
                       f"traceback:\n{text}")


def _end(pid: int, fd: int | None) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    except (ProcessLookupError, ChildProcessError):
        pass
    if fd is not None:
        os.close(fd)
