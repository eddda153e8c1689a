"""Free the shared memory that killed foundryx runs left behind, and only that.

``StreamingDataset`` keeps its state in POSIX shared memory named ``<prefix>_<name>``
(``/dev/shm/000003_locals``, ...), with a new prefix for each dataset instance, so two runs
on the same data never share it. A run killed together with Python's resource tracker
(``kill -9`` of a job, the OOM killer) leaves these segments behind. streaming's own
``clean_stale_shared_memory`` unlinks *every* prefix, including those of other live runs on
the machine, which breaks them; and which process owns a segment cannot be read from
``/proc`` either, since every later ``StreamingDataset`` maps the segments of the prefixes
it skips.

Picking the prefix is racy in streaming itself (mosaicml/streaming#901): every rank scans
``/dev/shm`` for the first free prefix, and only after a barrier does the local leader claim
it. Two runs that start together can both pick prefix N (the second leader then fails with
``FileExistsError: '/00000N_locals'``), or a rank that scans after another run claimed N picks
N+1 while its leader claims N (its run fails, or the rank attaches to the other run's
memory). :func:`registering` makes scan and claim one step per host: around the dataset's
construction, the local leader of each run holds ``<tmp>/foundryx_shm_register.lock``, and the
other ranks start only once every leader holds it.

So each foundryx process that builds a dataset holds a shared ``flock`` on
``<tmp>/foundryx_shm_<prefix>.lock`` for as long as it lives (the kernel releases it when the
process dies, however it dies); at a normal exit the last of them removes that file and the
lock files streaming leaves behind. A prefix is stale when its lock file exists but nobody
holds the lock: then its segments, streaming's lock files and the lock file are removed.
Prefixes without a foundryx lock file (other programs' datasets) are never touched.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import random
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

_LOCK_GLOB = "foundryx_shm_*.lock"
_held: dict[int, int] = {}  # prefix → fd of the lock this process holds


def lock_path(prefix: int) -> Path:
    return Path(tempfile.gettempdir()) / f"foundryx_shm_{prefix:06d}.lock"


def hold(dataset: Any) -> None:
    """Mark the shared memory of ``dataset`` (a StreamingDataset) as used by this process."""
    import fcntl

    prefix = int(dataset._shm_prefix_int)
    if prefix in _held:
        return
    path = lock_path(prefix)
    fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a cleanup is checking this prefix
    _held[prefix] = fd
    atexit.register(_let_go, prefix)


def _let_go(prefix: int) -> None:
    """At a normal exit: the last process of the run on ``prefix`` removes streaming's lock
    files and ours. streaming leaves its two lock files in the temp folder for good, so every
    run would add two files there and every later prefix scan would walk past them. (The
    segments are the live dataset's; streaming and Python's resource tracker free them later.)"""
    import fcntl

    fd = _held.pop(prefix, None)
    if fd is None:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # another process of this run still uses it; it cleans up
        os.close(fd)
        return
    try:
        _unlink_filelocks(f"{prefix:06d}")
        lock_path(prefix).unlink(missing_ok=True)
    finally:
        os.close(fd)


def _unlink_segments(prefix: str) -> None:
    from multiprocessing import shared_memory

    from streaming.base.constant import SHM_TO_CLEAN

    posixshmem = getattr(shared_memory, "_posixshmem", None)
    for name in SHM_TO_CLEAN:
        try:
            if posixshmem is not None:
                posixshmem.shm_unlink(f"/{prefix}_{name}")
        except FileNotFoundError:
            pass
    _unlink_filelocks(prefix)


def _unlink_filelocks(prefix: str) -> None:
    from streaming.base.constant import BARRIER_FILELOCK, CACHE_FILELOCK

    for name in (BARRIER_FILELOCK, CACHE_FILELOCK):
        (Path(tempfile.gettempdir()) / f"{prefix}_{name}").unlink(missing_ok=True)


def clean_stale_shared_memory() -> list[str]:
    """Remove the shared memory of dead foundryx datasets; return the freed prefixes."""
    import fcntl

    freed = []
    for path in sorted(Path(tempfile.gettempdir()).glob(_LOCK_GLOB)):
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:  # a live process holds it
            os.close(fd)
            continue
        try:
            prefix = path.stem.rsplit("_", 1)[-1]
            _unlink_segments(prefix)
            path.unlink(missing_ok=True)
            freed.append(prefix)
        finally:
            os.close(fd)
    if freed:
        log.info("freed the shared memory of %d killed streaming dataset(s) (prefixes %s)",
                 len(freed), ", ".join(freed))
    return freed


@functools.cache
def clean_once() -> None:
    """:func:`clean_stale_shared_memory`, at most once per process."""
    clean_stale_shared_memory()


def _register_lock_path() -> Path:
    return Path(tempfile.gettempdir()) / "foundryx_shm_register.lock"


@contextlib.contextmanager
def registering() -> Iterator[None]:
    """Build a StreamingDataset inside this: no other foundryx run on this host picks or
    claims a shared-memory prefix meanwhile (see the module docstring). Every rank enters it.

    The local leader of each node takes its host's lock; the ranks then agree that every
    leader holds one before anyone scans. A leader that cannot take its lock at once makes
    all leaders let go and try again after a short random pause, so two runs that share
    several hosts cannot deadlock by taking the locks in opposite orders.
    """
    import fcntl

    import torch.distributed as tdist
    from streaming.base.world import World

    distributed = tdist.is_available() and tdist.is_initialized() and tdist.get_world_size() > 1
    fd = os.open(_register_lock_path(), os.O_CREAT | os.O_RDWR, 0o644) \
        if World.detect().is_local_leader else None
    try:
        waited = 0.0
        while True:
            held = True
            if fd is not None:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | (fcntl.LOCK_NB if distributed else 0))
                except BlockingIOError:
                    held = False
            if distributed:
                everyone: list[Any] = [None] * tdist.get_world_size()
                tdist.all_gather_object(everyone, held)
                if not all(everyone):
                    if held and fd is not None:
                        fcntl.flock(fd, fcntl.LOCK_UN)
                    pause = random.uniform(0.05, 0.25)
                    time.sleep(pause)
                    waited += pause
                    continue
            break
        if waited > 5:
            log.info("waited %.0f s for another run on this host to register its dataset",
                     waited)
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock
