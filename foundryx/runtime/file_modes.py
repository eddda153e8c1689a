"""File modes of what is written under a temporary name and renamed into place: the permissions
the umask gives a file or folder made the ordinary way (:func:`give_usual_modes`).

Imports nothing of foundryx: any part may use it.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


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
