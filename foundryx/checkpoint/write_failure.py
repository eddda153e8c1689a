"""What to tell the user when a checkpoint cannot be written (full disk, quota, permissions).

DCP hides the cause: a full disk reaches us as ``CheckpointException`` wrapping torch's
``RuntimeError("[enforce fail at inline_container.cc] unexpected pos ...")``, whose
``__context__`` is the ``OSError`` with ``ENOSPC``. So the cause is looked for down the chain
of every rank's failure, and the free space of the folder is compared with what the
checkpoint needs.
"""

from __future__ import annotations

import errno
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

NO_SPACE = {errno.ENOSPC, errno.EDQUOT}


def _chain(e: BaseException | None) -> Iterator[BaseException]:
    seen: set[int] = set()
    stack = [e]
    while stack:
        cur = stack.pop()
        if cur is None or id(cur) in seen:
            continue
        seen.add(id(cur))
        yield cur
        stack += [cur.__cause__, cur.__context__]
        for failure in (getattr(cur, "failures", None) or {}).values():  # DCP: rank -> (exc, tb)
            stack.append(failure[0] if isinstance(failure, tuple) else failure)


def os_error_in(e: BaseException) -> OSError | None:
    """The first OSError with an errno in ``e``'s chain (causes, contexts, DCP's rank failures)."""
    return next((x for x in _chain(e) if isinstance(x, OSError) and x.errno), None)


def interrupted(e: BaseException) -> bool:
    """Whether ``e`` is a Ctrl-C (KeyboardInterrupt) that DCP caught while writing and wrapped."""
    return any(isinstance(x, KeyboardInterrupt) for x in _chain(e))


def state_bytes(*state_dicts: dict[str, Any]) -> int:
    """Bytes of every tensor in (possibly sharded, possibly nested) state dicts, global sizes."""
    total = 0
    stack: list[Any] = list(state_dicts)
    while stack:
        v = stack.pop()
        if isinstance(v, torch.Tensor):
            total += v.numel() * v.element_size()
        elif isinstance(v, dict):
            stack += list(v.values())
        elif isinstance(v, (list, tuple)):
            stack += list(v)
    return total


def human(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB", "TB"):
        if abs(n) < 1024 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TB"


def describe(e: BaseException, root: Path, needed: int) -> str:
    """One line: why the save failed, with the free space and what the checkpoint needs."""
    cause = os_error_in(e)
    free = shutil.disk_usage(root).free if root.exists() else None
    if (cause is not None and cause.errno in NO_SPACE) or (free is not None and free < needed):
        have = f"{human(free)} free there" if free is not None else "the free space is unknown"
        return (f"no space left on the device: the checkpoint needs about {human(needed)}, "
                f"{have}")
    if cause is not None:
        where = f" ({cause.filename})" if cause.filename else ""
        return f"{cause.strerror or cause}{where}"
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else type(e).__name__
