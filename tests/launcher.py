"""``launch(script_args, nproc, out, ...)``: ``composer -n N SCRIPT ARGS`` for tests that run
a training script many times, started from this process instead of a launcher process.

The ``composer`` command imports all of Composer before it starts a rank (~10 s of one core on
a 2-core CI machine, and ~3 s more at its exit); a harness that launches a run a dozen times
pays that a dozen times. This starts the ranks as ``composer.cli.launcher`` does: each rank is
``python SCRIPT ARGS`` with the environment that launcher sets (RANK, WORLD_SIZE, LOCAL_RANK,
LOCAL_WORLD_SIZE, NODE_RANK, MASTER_ADDR, a free MASTER_PORT, PYTHONUNBUFFERED,
TORCH_NCCL_ASYNC_ERROR_HANDLING), every rank's output in ``out/rank{r}.out`` and ``.err``, and
when one rank fails the others are stopped by Composer's own cleanup (SIGTERM, then SIGKILL
after 30 s); the exit code is Composer's (the first failing rank's).

The README's and the docs' commands keep the real ``foundryx launch`` or ``composer`` command
in their tests
(test_quickstart_e2e, test_walkthrough, test_guards_e2e, test_cli_first_hour, ...).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

from distributed import free_port


def launch(script_args: list[str], nproc: int, out: Path, cwd: Path,
           env: dict[str, str] | None = None, timeout: float = 600) -> subprocess.CompletedProcess:
    """Run ``python *script_args`` on ``nproc`` ranks with ``env`` (default: this process's),
    plus what the launcher sets; rank 0's output is the result's stdout/stderr (as the
    composer command prints it), every rank's is in ``out``."""
    from composer.cli.launcher import _aggregate_process_returncode, _cleanup_processes

    out.mkdir(parents=True, exist_ok=True)
    port = free_port()
    procs: dict[int, subprocess.Popen] = {}
    files = []
    try:
        for rank in range(nproc):
            rank_env = {**(os.environ if env is None else env), "RANK": str(rank), "WORLD_SIZE": str(nproc),
                        "LOCAL_RANK": str(rank), "LOCAL_WORLD_SIZE": str(nproc),
                        "NODE_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                        "PYTHONUNBUFFERED": "1", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}
            stdout, stderr = (open(out / f"rank{rank}.{x}", "a+") for x in ("out", "err"))
            files += [stdout, stderr]
            procs[rank] = subprocess.Popen([sys.executable, *script_args], cwd=cwd, env=rank_env,
                                           stdout=stdout, stderr=stderr, text=True)
        deadline = time.monotonic() + timeout
        while any(p.poll() is None for p in procs.values()):
            if any(p.returncode not in (None, 0) for p in procs.values()):
                break
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired([sys.executable, *script_args], timeout)
            time.sleep(0.1)
    finally:
        _cleanup_processes(procs)
        for f in files:
            f.close()
    code = _aggregate_process_returncode(procs) % 256  # sys.exit(-9) exits 247
    stdout, stderr = ((out / f"rank0.{x}").read_text() for x in ("out", "err"))
    return subprocess.CompletedProcess([sys.executable, *script_args], code, stdout, stderr)
