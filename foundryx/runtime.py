"""Process set-up shared by the entry points (``foundryx train``, ``foundryx eval``,
``foundryx export``): log format and levels, and the device to run on; and writing outputs so
that a failure half-way leaves the previous ones as they were (:func:`write_together`,
:func:`replace_all`).

It imports nothing of foundryx but :mod:`foundryx.errors`, so any part may use it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import sys
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from foundryx.errors import ConfigError

log = logging.getLogger("foundryx")


class _RankFilter(logging.Filter):
    """Adds ``record.rank`` (the ``RANK`` environment variable, 0 when unset)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.rank = os.environ.get("RANK", "0")
        return True


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever ``sys.stderr`` is when a record is emitted, not the one at set-up
    (so a process that redirects stderr, as pytest does per test, still gets the log)."""

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def setup_logging(level: str | None) -> None:
    """Log ``foundryx`` at ``level`` (e.g. ``info``) with time and rank, and ``composer`` at
    the same level when it is ``debug``, else at ``warning`` at least (its info lines repeat
    what foundryx says: seeds, run name, precision); None or empty: leave logging as it is."""
    if not level:
        return
    handler = _StderrHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s: rank%(rank)s: %(levelname)s: %(name)s: %(message)s"))
    handler.addFilter(_RankFilter())
    numeric = logging.getLevelName(level.upper())
    for name in ("foundryx", "composer"):
        lg = logging.getLogger(name)
        quiet = name == "composer" and isinstance(numeric, int) and numeric > logging.DEBUG
        lg.setLevel(max(numeric, logging.WARNING) if quiet else level.upper())
        if not lg.handlers:
            lg.addHandler(handler)
        lg.propagate = False


def pick_device(requested: str | None) -> str:
    """The device to run on (``gpu`` or ``cpu``): ``requested``, else a GPU when there is
    one; logs one line when foundryx chose it."""
    if requested:
        return requested
    import torch  # here, not at the top: the CLI sets up logging without loading torch

    device = "gpu" if torch.cuda.is_available() else "cpu"
    log.info("device: %s (none set in the config; %s)", device,
             "a GPU is available" if device == "gpu" else "no GPU found")
    return device


HOST_BACKEND = "gloo"  # the collectives on host (CPU) tensors, beside the device's own


def process_group_backend(device_backend: str, device_type: str = "cuda") -> str:
    """The default process group's backend for a run whose device collectives go through
    ``device_backend`` (``nccl``; RCCL on ROCm answers to the same name): that backend for
    ``device_type`` tensors and gloo for host tensors, ``cpu:gloo,cuda:nccl`` (the string torch's
    distributed checkpointing uses). NCCL takes CUDA tensors only, and some collectives run on
    host memory on a GPU node (the NF4 block maxima of offloaded rows, the tensor-parallel re-cut
    of offloaded weights); every sub-group (device-mesh dimensions, ``new_group``) inherits the
    pair. A CPU run's ``gloo`` (or an already mixed string) is returned as it is."""
    if device_backend in ("", "gloo", "xla") or ":" in device_backend:
        return device_backend
    return f"cpu:{HOST_BACKEND},{device_type}:{device_backend}"


def with_host_collectives(device: Any, world_size: int) -> Any:
    """``device`` (a Composer ``Device``) set to create the default process group with
    :func:`process_group_backend`, said in one line; Composer's ``initialize_dist`` and the
    trainer read ``device.dist_backend``. :class:`~foundryx.errors.ConfigError` when this torch
    build cannot make that group on a multi-GPU run (no NCCL/RCCL, no gloo): said with the
    fix, before anything is built."""
    backend = getattr(device, "dist_backend", "")
    mixed = process_group_backend(backend)
    if mixed == backend or world_size <= 1:
        return device
    import torch.distributed as tdist  # here, not at the top: the CLI loads this without torch

    missing = []
    if backend == "nccl" and not tdist.is_nccl_available():
        missing.append(backend)
    if not tdist.is_gloo_available():
        missing.append(HOST_BACKEND)
    if missing:
        raise ConfigError([f"device: this torch build has no {' and no '.join(missing)} backend, "
                           f"which a {world_size}-process GPU run needs ({mixed}: {backend} for GPU "
                           "tensors, gloo for host tensors); install a CUDA or ROCm build of torch "
                           "from pytorch.org (RCCL comes with the ROCm build)"])
    device.dist_backend = mixed
    log.info("process group: %s (%s for GPU tensors; gloo for host tensors: offloaded and NF4 "
             "weights' collectives on load)", mixed, backend)
    return device


# -- writing outputs so that a failure leaves the previous ones as they were --------------------
def current_umask() -> int:
    """The process's umask (read from /proc where it can be, so no other thread ever sees it
    changed)."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def give_usual_modes(path: str | Path) -> None:
    """Give ``path`` (a file, or a folder and everything in it; links are left alone) the
    permissions the umask gives a file or folder made the ordinary way: ``0o777 & ~umask`` for
    folders and executable files, ``0o666 & ~umask`` for other files. For what is written
    under a temporary name and renamed into place: ``tempfile.mkdtemp`` makes its folder
    private to its owner (0o700), and safetensors writes its files 0o600, so a teammate or a
    serving container running as another user could not read an export otherwise."""
    mask = current_umask()
    path = Path(path)
    entries = [path, *path.rglob("*")] if path.is_dir() and not path.is_symlink() else [path]
    for entry in entries:
        if entry.is_symlink():
            continue
        mode = entry.stat().st_mode
        executable = entry.is_dir() or mode & 0o100
        os.chmod(entry, (0o777 if executable else 0o666) & ~mask)


def _remove(path: Path) -> None:
    """Delete a file or a folder tree; a leftover is only a hidden name, so errors are ignored."""
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(OSError):
            path.unlink()


def _set_aside(final: Path) -> Path | None:
    """Keep what ``final`` holds under a hidden sibling name (None when there is nothing): a
    file by a hard link (so ``final`` never disappears), else by renaming it."""
    if not (final.exists() or final.is_symlink()):
        return None
    aside = final.with_name(f".{final.name}.old-{uuid.uuid4().hex[:8]}")
    if final.is_file() and not final.is_symlink():
        try:
            os.link(final, aside)
            return aside
        except OSError:
            pass  # a file system without hard links: rename instead
    os.replace(final, aside)
    return aside


def _fsync(path: Path) -> None:
    """Flush ``path`` (a file, or a folder after renames in it) to disk where the OS allows."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def replace_all(moves: Sequence[tuple[Path, Path]]) -> None:
    """Rename each ``new`` onto its ``final`` (files, or folders replaced as a whole; each pair
    in one folder), all or none: when a rename fails, those already done are undone (every
    ``final`` holds what it held, every ``new`` is back at its own name) and the error is
    raised. What the finals held is deleted only after all renames succeeded."""
    done: list[tuple[Path, Path, Path | None]] = []
    try:
        for new, final in moves:
            aside = _set_aside(final)
            try:
                os.replace(new, final)
            except BaseException:
                if aside is not None and (final.exists() or final.is_symlink()):
                    _remove(aside)  # a hard link: final was never touched
                elif aside is not None:
                    os.replace(aside, final)
                raise
            done.append((new, final, aside))
    except BaseException:
        for new, final, aside in reversed(done):
            os.replace(final, new)
            if aside is not None:
                os.replace(aside, final)
        raise
    for _, _, aside in done:
        if aside is not None:
            _remove(aside)


@contextlib.contextmanager
def write_together() -> Iterator[Callable[[str | Path], Path]]:
    """Write a set of files so that either all of them change or none does::

        with write_together() as stage:
            stage(out / "a.md").write_text(...)
            plot.savefig(stage(out / "b.png"))

    ``stage(path)`` makes ``path``'s folder if needed and returns a hidden temporary name beside
    ``path`` (``.<stem>.tmp-<random><suffix>``) to write the new content to. After the block every
    temporary file is renamed onto its path (:func:`replace_all`). When the block or a rename
    fails, the temporary files and the folders ``stage`` made are deleted, every path holds
    what it held before, and the error is raised."""
    staged: list[tuple[Path, Path]] = []
    made: list[Path] = []  # in the order they were made

    def stage(path: str | Path) -> Path:
        path = Path(path)
        if any(final == path for _, final in staged):
            raise ValueError(f"{path} is staged twice in one write_together()")
        missing, folder = [], path.parent
        while not folder.exists():
            missing.append(folder)
            folder = folder.parent
        path.parent.mkdir(parents=True, exist_ok=True)
        made.extend(reversed(missing))
        # the suffix stays last: a writer may pick the format by it (savefig, to_parquet)
        tmp = path.with_name(f".{path.stem}.tmp-{uuid.uuid4().hex[:8]}{path.suffix}")
        staged.append((tmp, path))
        return tmp

    try:
        yield stage
        for tmp, _ in staged:
            _fsync(tmp)  # the content is on disk before a rename makes it the path's
        replace_all(staged)
        for folder in {final.parent for _, final in staged}:
            _fsync(folder)
    except BaseException:
        for tmp, _ in staged:
            _remove(tmp)
        for folder in reversed(made):
            with contextlib.suppress(OSError):
                folder.rmdir()  # only if empty: something else may have put a file there
        raise


def write_text_atomically(path: str | Path, text: str) -> Path:
    """Write ``text`` (UTF-8) to ``path`` through a temporary file: ``path`` holds either
    its old content or all of ``text``, never a part."""
    with write_together() as stage:
        stage(path).write_text(text, encoding="utf-8")
    return Path(path)
