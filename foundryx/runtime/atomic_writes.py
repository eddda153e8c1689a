"""Writing outputs so that a failure half-way leaves the previous ones as they were: a set of
files that all change or none does (:func:`write_together`), renames all or none
(:func:`replace_all`), one text file (:func:`write_text_atomically`).

A process killed at any moment (no ``except`` or ``finally`` runs) leaves every path whole,
old or new: a file is replaced by one rename while a hard link keeps the old one; a folder (an
export, a converted dataset) by one atomic exchange of the two names (Linux's
``renameat2(RENAME_EXCHANGE)``). Where the file system cannot exchange, the old folder is
renamed aside first, which a kill can leave there with nothing at the path; the next
:func:`replace_all` onto that path puts it back first (:func:`restore_set_aside`), and the
fallback is logged once per call.

Imports nothing of foundryx: any part may use it.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import logging
import os
import shutil
import uuid
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
# what renameat2 answers where the kernel or the file system cannot exchange two names
_CANNOT_EXCHANGE = {errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP}


@functools.cache
def _renameat2():  # noqa: ANN202
    """libc's ``renameat2`` (glibc 2.28+), or None."""
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def _exchange(a: Path, b: Path) -> bool:
    """Swap what the names ``a`` and ``b`` point at, in one step; False where the system
    cannot (nothing changed), an OSError for any other failure."""
    fn = _renameat2()
    if fn is None:
        return False
    if fn(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _CANNOT_EXCHANGE:
        return False
    raise OSError(code, os.strerror(code), str(b))


def restore_set_aside(final: Path) -> Path | None:
    """When ``final`` is missing and a folder set aside for it by a replace that was killed
    half-way is there (``.<name>.old-<random>``), put it back at ``final``; returns what was
    restored, or None."""
    final = Path(final)
    if final.exists() or final.is_symlink() or not final.parent.is_dir():
        return None
    kept = sorted(final.parent.glob(f".{final.name}.old-*"), key=lambda p: p.stat().st_mtime)
    if not kept:
        return None
    os.replace(kept[-1], final)
    log.warning("%s was missing after a replace that stopped half-way; put back the previous "
                "one from %s", final, kept[-1].name)
    return kept[-1]


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
    raised. What the finals held is deleted only after all renames succeeded. A folder is
    replaced by exchanging the two names (the module docstring), so a kill leaves the old or
    the new one at ``final``."""
    done: list[tuple[Path, Path, Path | None]] = []
    exchanged: set[Path] = set()  # the finals replaced by an exchange
    try:
        for new, final in moves:
            new, final = Path(new), Path(final)
            restore_set_aside(final)
            if final.is_dir() and not final.is_symlink():
                if _exchange(new, final):  # ``new`` now names the previous folder
                    done.append((new, final, new))
                    exchanged.add(final)
                    continue
                log.warning("%s: this file system cannot exchange two names in one step; the "
                            "previous folder is renamed aside first (a kill in between leaves it "
                            "as .%s.old-*, put back by the next replace)", final, final.name)
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
    except BaseException as failure:
        for new, final, aside in reversed(done):
            if final in exchanged:
                if not _exchange(new, final):  # it exchanged a moment ago
                    raise OSError(errno.EIO, f"could not exchange {new} and {final} back") \
                        from failure
                continue
            os.replace(final, new)
            if aside is not None:
                os.replace(aside, final)
        raise
    for _, _, aside in done:
        if aside is not None:
            _remove(aside)  # an exchanged folder's ``new``: the previous folder


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
