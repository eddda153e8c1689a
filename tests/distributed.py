"""``run_distributed(fn, world_size=2)``: one function on N processes with a process group,
for unit tests of distributed code (in the manner of OLMo-core's ``run_distributed_test``).

Each rank is a fresh process forked from a server that has already imported torch, Composer and
foundryx (``forkserver``; ``start_method="spawn"`` for a bare interpreter), with this process's
environment as it is at the call, and ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``NODE_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` set as a launcher sets
them (so ``composer.utils.dist`` agrees with ``torch.distributed``), and a process group
initialised through a file in a fresh temporary folder (no port to race for). ``fn`` must be
importable by name (a module-level function of a test module) and its arguments and return
value picklable. The return value is the list of every rank's result. When a rank raises,
the others are stopped and the exception of the lowest failing rank is raised again here, with
its rank and its traceback from that process in the message.

    def _check_allreduce():
        t = torch.ones(1)
        torch.distributed.all_reduce(t)
        return t.item()

    def test_allreduce():
        assert run_distributed(_check_allreduce) == [2.0, 2.0]
"""

from __future__ import annotations

import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch.multiprocessing as mp

EXIT_RAISED = 3  # a rank's exit code when ``fn`` raised (its .traceback file says what)
# Imported once, by the fork server, instead of by every rank (~12 CPU-s each on 2 cores). After
# these imports the process has one thread, so forking it is safe.
PRELOAD = ["torch", "torch.distributed.checkpoint", "torch.distributed.fsdp", "foundryx.train"]


class RankFailed(RuntimeError):
    """A rank failed without an exception that could be sent back (crash, unpicklable)."""


def run_distributed(fn: Callable[..., Any], world_size: int = 2, backend: str = "gloo",
                    args: tuple[Any, ...] = (), timeout: float = 120.0,
                    start_method: str = "forkserver") -> list[Any]:
    """Run ``fn(*args)`` on ``world_size`` ranks and return their results, rank by rank."""
    ctx = mp.get_context(start_method)
    if start_method == "forkserver":  # takes effect when the server starts (the first call)
        ctx.set_forkserver_preload(PRELOAD)
    with tempfile.TemporaryDirectory(prefix="run_distributed_") as tmp:
        folder = Path(tmp)
        env = {**os.environ, "WORLD_SIZE": str(world_size), "LOCAL_WORLD_SIZE": str(world_size),
               "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port())}
        procs = [ctx.Process(target=_rank_main, name=f"rank{rank}", daemon=True,
                             args=(rank, world_size, backend, env, str(folder), fn, args, timeout))
                 for rank in range(world_size)]
        for p in procs:
            p.start()
        try:
            _wait_all(procs, timeout)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
        outcomes = [_outcome(folder, rank, p.exitcode) for rank, p in enumerate(procs)]
    # the root cause: the rank that raised first (its peers may fail on it afterwards)
    raised = sorted((o[3], r, o) for r, o in enumerate(outcomes) if o[0] == "raised")
    failed = [(r, o) for _, r, o in raised] or [(r, o) for r, o in enumerate(outcomes) if o[0] != "ok"]
    if failed:
        rank, (_, exc, text, _) = failed[0]
        header = f"rank {rank} of {world_size} failed in {fn.__name__}"
        if exc is None:  # no faithful copy of it: its type and message are in the traceback
            raise RankFailed(f"{header}: {text}")
        exc.add_note(f"{header}; its traceback:\n{text}")
        raise exc
    return [o[1] for o in outcomes]


def _wait_all(procs: list[Any], timeout: float) -> None:
    """Until every process ended, one failed (the others get a moment to report, then go),
    or ``timeout`` passed (TimeoutError)."""
    deadline = time.monotonic() + timeout
    running = list(procs)
    while running:
        left = deadline - time.monotonic()
        if left <= 0:
            stuck = [p.name for p in running]
            raise TimeoutError(f"run_distributed: {', '.join(stuck)} still running after "
                               f"{timeout:.0f} s (a rank waiting on a collective the others skipped?)")
        wait([p.sentinel for p in running], timeout=left)
        running = [p for p in running if p.exitcode is None]
        if any(p.exitcode not in (None, 0) for p in procs):
            # the peers may be blocked in a collective with the failed rank: a short grace
            # lets one that fails too write its own error, then all are stopped
            wait([p.sentinel for p in running], timeout=2.0)
            return


def _outcome(folder: Path, rank: int, exitcode: int | None) -> tuple[str, Any, Any, float]:
    """``("ok", result, None, 0)``, ``("raised", exception or None, traceback text, when)`` or
    ``("lost", None, what happened, 0)``."""
    result, text, exc = (folder / f"rank{rank}.{x}" for x in ("result", "traceback", "exception"))
    if result.exists():
        return ("ok", pickle.loads(result.read_bytes()), None, 0.0)
    if text.exists():
        try:
            error = pickle.loads(exc.read_bytes()) if exc.exists() else None
        except Exception:  # an exception type that cannot be rebuilt from its args
            error = None
        when, _, trace = text.read_text().partition("\n")
        return ("raised", error, trace, float(when))
    if exitcode is None or exitcode < 0:
        return ("lost", None, "stopped (a peer failed or the run timed out)"
                + (f", signal {-exitcode}" if exitcode else ""), 0.0)
    return ("lost", None, f"exited with code {exitcode} before it returned", 0.0)


def _rank_main(rank: int, world_size: int, backend: str, env: dict[str, str], folder: str,
               fn: Callable[..., Any], args: tuple[Any, ...], timeout: float) -> None:
    import torch.distributed as tdist

    os.environ.clear()  # the caller's environment now, not the fork server's from its start
    os.environ.update(env, RANK=str(rank), LOCAL_RANK=str(rank))
    out = Path(folder) / f"rank{rank}"
    try:
        if "nccl_like" in backend:  # a backend that refuses host tensors, as NCCL does
            import nccl_like

            nccl_like.register()
        tdist.init_process_group(backend, init_method=f"file://{folder}/rendezvous", rank=rank,
                                 world_size=world_size, timeout=timedelta(seconds=timeout))
        result = pickle.dumps(fn(*args))
    except BaseException as e:  # sent back and raised again in the parent
        # the time first: the root cause is the rank that failed first
        out.with_suffix(".traceback").write_text(f"{time.time()!r}\n{traceback.format_exc()}")
        data = _faithful_pickle(e)
        if data is not None:  # else the traceback text alone says what happened
            out.with_suffix(".exception").write_bytes(data)
        os._exit(EXIT_RAISED)  # now, without waiting for peers stuck in a collective
    out.with_suffix(".result").write_bytes(result)
    # no destroy_process_group: on torch 2.7 its gloo destructor can deadlock (the main thread
    # waiting on a mutex that a gloo thread holds while it waits for the GIL; seen with gdb in
    # benchmarks/tp.py, and as a rank "still running" after its function returned in a test
    # leg); the process ends now, as a failing rank does
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _faithful_pickle(e: BaseException) -> bytes | None:
    """``e`` pickled, or None when it does not come back as itself (a custom ``__init__``
    may rebuild it from its message as if that were its arguments)."""
    try:
        data = pickle.dumps(e)
        back = pickle.loads(data)
    except Exception:
        return None
    return data if type(back) is type(e) and str(back) == str(e) else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
