"""Forked worker processes that take their tasks from, and leave their results in, shared
memory: a small stand-in for ``multiprocessing.Pool`` (``apply_async``, ``close``,
``terminate``, ``join``) for large tasks on a few cores.

Why not the pool: it sends each task and result through a pipe of 64 KB, written and read by
helper threads of the parent that need the GIL for every 64 KB while the parent's own thread
reads and splits the input. A conversion's worker waited ~8 ms per 1 MB batch for its next
task and to hand back its tokens: 0.18-0.25 s a worker over 40 copies of tinyshakespeare on 2
cores, 0.07-0.11 s with these workers (benchmarks/RESULTS.md, issue 55).

Here there are two slots of shared memory per worker (``mmap`` made before the fork), each an
input and an output buffer. The parent pickles a task ``(fn, args)`` into a free slot's input
buffer and puts the slot's number on a pipe that every worker reads from (one at a time): a
worker takes a task only when it is free, as in the pool, so the last tasks spread over the
workers. The worker pickles the result into the slot's output buffer and answers with its size
on a second pipe. No thread of the parent is involved, and only a few bytes go through pipes. A
task or result larger than its buffer goes through a temporary file instead (removed by its
reader).

Only for the ``fork`` start method (the buffers are inherited); the parent must not run other
threads (see :func:`foundryx.data.parallel.start_method`). A worker that dies (killed, out of
memory) is reported as a :class:`~foundryx.errors.RunError` by the next wait, not waited on
forever as the pool does.
"""

from __future__ import annotations

import contextlib
import mmap
import multiprocessing as mp
import os
import pickle
import signal
import tempfile
import traceback
from collections import deque
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

from foundryx.data.workers import WorkerDeath
from foundryx.errors import RunError

SLOT_BYTES = 1 << 23  # each buffer's size; its pages are backed only once written
_PICKLE = pickle.HIGHEST_PROTOCOL


class WorkerTraceback(Exception):
    """The traceback of a task's error in its worker: the cause of the error ``get`` raises
    (as ``multiprocessing.pool``'s ``RemoteTraceback``)."""

    def __str__(self) -> str:
        return f"\n\"\"\"\n{self.args[0]}\"\"\""


class Task:
    """A task's result, as ``multiprocessing.pool.AsyncResult`` gives it (:meth:`get`)."""

    __slots__ = ("workers", "payload", "done", "value", "error")

    def __init__(self, workers: ForkedWorkers, payload: bytes):
        self.workers, self.payload = workers, payload
        self.done, self.value, self.error = False, None, None

    def get(self) -> Any:
        """The result; raises what the task raised in its worker."""
        while not self.done:
            self.workers.wait_for_results()
        if self.error is not None:
            raise self.error
        return self.value


class ForkedWorkers:
    """``n`` forked processes, each running ``initializer(*initargs)`` once, then tasks."""

    def __init__(self, n: int, initializer: Callable[..., None] | None = None,
                 initargs: tuple = (), slot_bytes: int = SLOT_BYTES):
        ctx = mp.get_context("fork")
        self.slots = [(mmap.mmap(-1, slot_bytes), mmap.mmap(-1, slot_bytes))
                      for _ in range(2 * n)]
        self.free = deque(range(len(self.slots)))
        self.queued: deque[Task] = deque()
        self.running: dict[int, Task] = {}  # by slot
        self.spilled: dict[int, str] = {}  # by slot: a running task's temporary file
        tasks_out, self.tasks = ctx.Pipe(duplex=False)
        self.results, results_in = ctx.Pipe(duplex=False)
        self.procs: list[Any] = []
        args = (tasks_out, ctx.Lock(), results_in, ctx.Lock(), self.slots,
                (self.tasks, self.results), initializer, initargs)
        try:
            for _ in range(n):
                proc = ctx.Process(target=_serve, args=args, daemon=True)
                proc.start()
                self.procs.append(proc)
        except BaseException:
            self.terminate()
            self.join()
            raise
        tasks_out.close()
        results_in.close()

    def apply_async(self, fn: Callable[..., Any], args: tuple = ()) -> Task:
        """Run ``fn(*args)`` in a worker (``fn`` pickled by reference, as the pool does)."""
        task = Task(self, pickle.dumps((fn, args), protocol=_PICKLE))
        self.queued.append(task)
        self._dispatch()
        return task

    def _dispatch(self) -> None:
        """Put queued tasks in free slots and announce them to the workers."""
        while self.queued and self.free:
            task, slot = self.queued.popleft(), self.free.popleft()
            where = _put(self.slots[slot][0], task.payload)
            if isinstance(where, str):
                self.spilled[slot] = where
            try:
                self.tasks.send((slot, where))
            except BrokenPipeError:  # every worker is gone
                self._raise_if_dead(None)
                raise
            task.payload = b""
            self.running[slot] = task

    def wait_for_results(self) -> None:
        """Wait until at least one running task ends; take in every result there is."""
        if not self.running:
            raise RuntimeError("no task is running")  # a bug: get() of a task never sent
        ready = wait([self.results] + [p.sentinel for p in self.procs])
        while self.results.poll():
            try:
                slot, result, error = self.results.recv()
            except EOFError:  # no worker left to write: every one has ended
                for proc in self.procs:
                    proc.join(5)
                self._raise_if_dead(None)
                raise
            task = self.running.pop(slot)
            self.spilled.pop(slot, None)  # read (and removed) by its worker
            task.done = True
            if error is not None:
                task.error, text = error
                task.error.__cause__ = WorkerTraceback(text)
            else:
                task.value = pickle.loads(_take(self.slots[slot][1], result))
            self.free.append(slot)
        self._raise_if_dead(ready)
        self._dispatch()

    def _raise_if_dead(self, ready: list[Any] | None) -> None:
        """A RunError naming the first worker that ended (its sentinel among ``ready``, or
        any that is no longer alive when ``ready`` is None): workers end only when told."""
        for proc in self.procs:
            if (proc.sentinel in ready) if ready is not None else not proc.is_alive():
                proc.join(1)
                raise worker_died(proc.pid, proc.exitcode)

    def close(self) -> None:
        """No more tasks: the workers exit once theirs are done."""
        for _ in self.procs:
            self.tasks.send(None)

    def terminate(self) -> None:
        for proc in self.procs:
            if proc.is_alive():
                proc.terminate()

    def join(self) -> None:
        for proc in self.procs:
            proc.join()
        self.tasks.close()
        self.results.close()
        for path in self.spilled.values():  # tasks never done: their workers were stopped
            with contextlib.suppress(OSError):
                os.unlink(path)


def worker_died(pid: int | None, code: int | None) -> RunError:
    """The error for a worker process that ended before its work was done, saying how as a
    dataloader worker's death does (:class:`foundryx.data.workers.WorkerDeath`)."""
    death = WorkerDeath((pid,), exit_code=code)
    if code is not None and code < 0:
        with contextlib.suppress(ValueError):  # a signal Python has no name for: its code
            death = WorkerDeath((pid,), signal=signal.Signals(-code).name)
    return RunError(f"a worker process (pid {pid}) {death.how()} before its work was done (out "
                    f"of memory? the system log says what killed it)")


def _put(buf: mmap.mmap, data: bytes) -> int | str:
    """``data`` written to ``buf``: its size; or, too large, to a temporary file: its path."""
    if len(data) <= len(buf):
        buf[:len(data)] = data
        return len(data)
    fd, path = tempfile.mkstemp(prefix="foundryx-worker-", suffix=".pickle")
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    return path


def _take(buf: mmap.mmap, where: int | str) -> Any:
    """What :func:`_put` wrote (a temporary file is removed once read)."""
    if isinstance(where, int):
        return memoryview(buf)[:where]
    try:
        with open(where, "rb") as f:
            return f.read()
    finally:
        os.unlink(where)


def _serve(tasks: Any, tasks_lock: Any, results: Any, results_lock: Any,
           slots: list[tuple[mmap.mmap, mmap.mmap]], parents: tuple[Any, Any],
           initializer: Callable[..., None] | None, initargs: tuple) -> None:
    """A worker: the next task on ``tasks`` whenever it is free, its result in the slot's
    output buffer and the result's size on ``results``, until told to stop. ``parents``: the
    parent's ends of the two pipes, closed here (so the parent is the only writer of tasks:
    its exit ends the wait)."""
    for end in parents:
        end.close()
    if initializer is not None:
        initializer(*initargs)
    while True:
        with tasks_lock:  # one message at a time: header and body are two reads
            try:
                msg = tasks.recv()
            except EOFError:  # the parent, the only writer, is gone
                return
        if msg is None:
            return
        slot, where = msg
        inbuf, outbuf = slots[slot]
        try:
            fn, args = pickle.loads(_take(inbuf, where))
            reply = (slot, _put(outbuf, pickle.dumps(fn(*args), protocol=_PICKLE)), None)
        except BaseException as e:  # the parent raises it from get(), with this traceback
            reply = (slot, 0, (_sendable(e), traceback.format_exc()))
        with results_lock:
            results.send(reply)


def _sendable(e: BaseException) -> BaseException:
    """``e`` if it pickles, else a RuntimeError with its text (the traceback stays here)."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:
        return RuntimeError(f"{type(e).__name__}: {e}")
