"""A host buffer page-locked in place (``cudaHostRegister``), so that ``non_blocking``
host -> device copies from it are asynchronous, and unregistered before it can be freed.

Pinned when the run's device is a GPU (:func:`pins`), not whenever the machine has one: a
``device: cpu`` run on a GPU node neither initialises CUDA nor locks pages. The caller says
which device the buffer's copies go to.

A host that refuses to pin (usually the locked-memory limit, ``ulimit -l``) still works, but
every copy from the buffer then blocks the host until it is done: the offload prefetch stops
overlapping compute. That is said once per process, with the cost and the fix.

Self-contained (torch and the standard library only), to move with the offload runtime.

ROCm: ``torch.cuda.cudart()`` is the same binding built over HIP (the ``cuda*`` names are
kept and call ``hipHostRegister`` / ``hipHostUnregister``, whose error codes are numbered as
CUDA's), so this runs unchanged there; a pending error is read off ``libamdhip64`` instead.
"""

from __future__ import annotations

import ctypes
import logging
import os
import weakref
from collections.abc import Iterable
from typing import Any

import torch

log = logging.getLogger(__name__)

COST = "offload copies will not overlap compute: each layer's copy blocks the step"
FIX = ("raise the locked-memory limit: `ulimit -l unlimited` in the shell that starts the run, "
       "or in a container `--ulimit memlock=-1` (docker run; the equivalent memlock limit of "
       "your container runtime or scheduler)")
_warned = False  # one warning per process, however many buffers fail
_undrained_said = False  # one line per process when a pending error cannot be read off


def pins(device: torch.device | str) -> bool:
    """Whether a host buffer whose copies go to ``device`` is page-locked: only when that is a
    GPU (torch names ROCm's ``cuda`` too). The run's device decides, not the machine."""
    return torch.device(device).type == "cuda"


def _code(result: Any) -> int:
    """A cudaError as an int. torch's binding returns a pybind11 enum that names only
    ``success`` (any failure prints as ``cudaError.???``; ``.value`` is the code); an int is
    taken as it is."""
    return int(getattr(result, "value", result))


def _describe(cudart: Any, result: Any) -> str:
    try:
        text = str(cudart.cudaGetErrorString(result))
    except Exception:  # no such binding, or it refuses the value: the number alone
        text = ""
    return f"error {_code(result)}" + (f": {text}" if text else "")


def runtime_paths(maps_lines: Iterable[str]) -> list[str]:
    """The CUDA (``libcudart*``) or HIP (``libamdhip64*``) runtime libraries among the lines
    of ``/proc/self/maps``, each once; torch's wheels may name them with a hash
    (``libcudart-1a2b3c4d.so.12``)."""
    paths: list[str] = []
    for line in maps_lines:
        fields = line.split(maxsplit=5)
        if len(fields) < 6:
            continue
        path = fields[5].strip().removesuffix(" (deleted)")
        name = os.path.basename(path)
        if (name.startswith("libcudart") or name.startswith("libamdhip64")) and path not in paths:
            paths.append(path)
    return paths


def _drain_pending_error(cudart: Any) -> None:
    """Read off the error a failed runtime call leaves pending on this thread. Left there, the
    next kernel launch's check (``cudaGetLastError``) reports it as its own failure: a
    training step would die of "CUDA error: out of memory" from an unrelated op. torch 2.7's
    binding has no ``cudaGetLastError``, so the runtime torch loaded is called directly
    (loading a library already loaded gives the same instance, whose error state this is).
    When no runtime can be called, one line per process says so."""
    get = getattr(cudart, "cudaGetLastError", None)
    if get is not None:
        get()
        return
    try:
        with open("/proc/self/maps") as f:
            paths = runtime_paths(f)
    except OSError as e:  # not Linux
        paths, why = [], f"/proc/self/maps unreadable: {e}"
    else:
        why = "no CUDA or HIP runtime library (libcudart, libamdhip64) in /proc/self/maps"
    drained = [path for path in paths if _get_last_error(path)]
    if not drained:
        _say_undrained(why if not paths else f"none of {', '.join(paths)} answered")


def _get_last_error(path: str) -> bool:
    """Call the runtime library at ``path``'s ``cudaGetLastError`` (``hipGetLastError``);
    whether it could be called."""
    try:
        lib = ctypes.CDLL(path)
        getattr(lib, "hipGetLastError" if "amdhip" in path else "cudaGetLastError")()
    except (OSError, AttributeError):
        return False
    return True


def _say_undrained(why: str) -> None:
    global _undrained_said
    if _undrained_said:
        return
    _undrained_said = True
    log.warning("could not read off the error a failed cudaHostRegister/cudaHostUnregister left "
                "pending (this torch's binding has no cudaGetLastError, and %s): the next CUDA "
                "call may report it as its own failure", why)


def _warn_once(nbytes: int, error: str) -> None:
    global _warned
    if _warned:
        return
    _warned = True
    log.warning("could not pin the %.2f GiB host buffer of offloaded weights in place "
                "(cudaHostRegister: %s): %s. Fix: %s.", nbytes / 2**30, error, COST, FIX)


def _unregister(cudart: Any, ptr: int) -> None:
    if torch.cuda.is_initialized():  # no copy from these pages may still be in flight
        torch.cuda.synchronize()
    result = cudart.cudaHostUnregister(ptr)
    if _code(result) != 0:
        _drain_pending_error(cudart)
        log.debug("cudaHostUnregister of a host buffer: %s", _describe(cudart, result))


class HostPin:
    """``tensor``'s bytes (a contiguous host tensor) page-locked in place when ``device``, the
    device its copies go to (the run's), is a GPU (:func:`pins`), while this object lives or
    until :meth:`unpin`. It holds the tensor, so keep this object
    (not only the tensor) for as long as the buffer is in use: the pages are unregistered
    (:meth:`unpin`, or a finalizer when this object is collected) before they can be freed.
    ``pinned`` says whether the host accepted; a refusal is logged once per process."""

    def __init__(self, tensor: torch.Tensor, device: torch.device | str) -> None:
        self.tensor = tensor
        self.pinned = False
        self._unpin: weakref.finalize | None = None
        nbytes = tensor.numel() * tensor.element_size()
        if not (nbytes and pins(device)):  # a CPU run: no CUDA call at all
            return
        cudart, ptr = torch.cuda.cudart(), tensor.data_ptr()
        result = cudart.cudaHostRegister(ptr, nbytes, 0)  # 0: cudaHostRegisterDefault
        if _code(result) != 0:
            _drain_pending_error(cudart)
            _warn_once(nbytes, _describe(cudart, result))
            return
        self.pinned = True
        # Runs at most once: from unpin(), or when this object (and so not yet the tensor it
        # holds) is collected. Not at exit: the process's memory goes back to the OS anyway.
        self._unpin = weakref.finalize(self, _unregister, cudart, ptr)
        self._unpin.atexit = False

    def unpin(self) -> None:
        """Unregister the pages now (once; nothing when they were never pinned)."""
        if self._unpin is not None:
            self._unpin()
        self.pinned = False
