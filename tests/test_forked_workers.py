"""foundryx.data.forked_workers: a conversion's forked workers, tasks and results through
shared memory (a temporary file when larger), errors raised in the parent, a dead worker
reported instead of waited on, and a free worker taking the next task."""

from __future__ import annotations

import os
import signal
import sys
import tempfile
import time

import pytest

from foundryx.data.forked_workers import ForkedWorkers
from foundryx.errors import RunError

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="workers fork on Linux only")


def _repeat(text: str, n: int) -> tuple[int, str]:
    return os.getpid(), text * n


def _nap(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def _fail(kind: str) -> None:
    if kind == "value":
        raise ValueError("bad document 7")
    if kind == "unpicklable":
        raise _Unpicklable("no way back")
    os.kill(os.getpid(), signal.SIGKILL)  # as the OOM killer would


class _Unpicklable(Exception):
    def __init__(self, text):
        super().__init__(text)
        self.lock = __import__("threading").Lock()


def _ended(workers: ForkedWorkers, close: bool = True) -> None:
    if close:
        workers.close()
    workers.terminate()
    workers.join()
    assert not any(p.is_alive() for p in workers.procs)


@pytest.fixture
def own_tempdir(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    return tmp_path


def test_more_tasks_than_slots_come_back_right_and_large_ones_through_files(own_tempdir):
    """12 tasks on 2 workers (4 slots: the rest wait in the parent), some larger than a buffer
    on the way in, some on the way out (4 KB buffers here): every result is right, and no
    temporary file is left."""
    workers = ForkedWorkers(2, slot_bytes=4096)
    sizes = [(f"t{i}-", n) for i, n in enumerate([1, 2000, 3, 1, 1500, 2, 1, 1, 900, 5, 1, 7])]
    # ("t1-" * 2000) is 6 KB out; a task of 5 KB text in:
    sizes[3] = ("x" * 5000, 1)
    tasks = [workers.apply_async(_repeat, args) for args in sizes]
    results = [t.get() for t in tasks]
    assert [text for _, text in results] == [s * n for s, n in sizes]
    assert {pid for pid, _ in results} <= {p.pid for p in workers.procs}
    _ended(workers)
    assert not list(own_tempdir.iterdir())


def test_a_task_error_is_raised_by_get_and_the_workers_go_on():
    workers = ForkedWorkers(2)
    bad, good = workers.apply_async(_fail, ("value",)), workers.apply_async(_repeat, ("a", 3))
    odd = workers.apply_async(_fail, ("unpicklable",))
    with pytest.raises(ValueError, match="bad document 7") as e:
        bad.get()
    assert 'in _fail\n    raise ValueError("bad document 7")' in str(e.value.__cause__)
    assert good.get()[1] == "aaa"
    with pytest.raises(RuntimeError, match="_Unpicklable: no way back"):
        odd.get()
    assert workers.apply_async(_repeat, ("b", 2)).get()[1] == "bb"
    _ended(workers)


def test_a_killed_worker_is_reported_not_waited_on():
    """multiprocessing.Pool replaces a worker killed mid-task and waits for its result for
    ever; here the wait raises a RunError naming the worker (exit code 1 in the CLI)."""
    workers = ForkedWorkers(2)
    task = workers.apply_async(_fail, ("kill",))
    start = time.monotonic()
    with pytest.raises(RunError,
                       match=r"a worker process \(pid \d+\) was killed by signal SIGKILL"):
        task.get()
    assert time.monotonic() - start < 30
    _ended(workers, close=False)
    alone = ForkedWorkers(1)  # its only worker gone, the next task has no one to go to
    with pytest.raises(RunError, match="was killed by signal SIGKILL"):
        alone.apply_async(_fail, ("kill",)).get()
    with pytest.raises(RunError, match="was killed by signal SIGKILL"):
        alone.apply_async(_repeat, ("a", 1))
    _ended(alone, close=False)


def test_a_free_worker_takes_the_next_task():
    """A task goes to whichever worker is free (not to a queue of its own behind a long
    task): the short tasks all run beside the long one, in the other worker."""
    workers = ForkedWorkers(2)
    long = workers.apply_async(_nap, (1.5,))
    time.sleep(0.2)  # the long task is taken first
    short = [workers.apply_async(_nap, (0.01,)) for _ in range(6)]
    pids = {t.get() for t in short}
    long_pid = long.get()
    assert long_pid not in pids and len(pids) == 1
    _ended(workers)
