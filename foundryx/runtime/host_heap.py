"""Host memory that a run frees goes back to the OS: glibc's mmap threshold fixed at 128 KiB.

glibc serves an allocation at or above its mmap threshold with its own ``mmap`` and returns it
to the OS when freed; a smaller one comes from its heap, and freed heap memory is kept for
reuse. The threshold starts at 128 KiB, but glibc raises it to the size of each large block
freed, up to 32 MiB. A training step frees many such blocks (activations, dequantized weights,
the loss's chunks), so after the first steps they all come from the heap, and a fragmented
heap keeps what they free: measured on 2 CPU ranks with a 0.65B Llama (the 405B recipe's
LoRA over FP8 with offload, seq 256), 1.6-2.0 GiB per rank kept free by glibc after 12 steps,
the rank's whole-run peak 2.5-3.4 GiB where the plan says 1.63; with the threshold fixed, the
same run peaks at 1.57 GiB and is flat after step 2 (benchmarks/RESULTS.md; the trace's
script, benchmarks/host_trace.py, is in git history). Setting the threshold (``mallopt``) also
stops glibc moving it. Trimming the heap after each step does not help: the peak is inside the
step.

The price is on a CPU device, where every step's large temporaries are then fresh mappings
the kernel zeroes: 21 -> 30 s a step at 0.65B (+45%), and the quickstart's tokens/s about
halved. So the run config's ``host_heap`` chooses (:func:`configure`, called where ``foundryx
train`` starts each rank): ``bounded``, ``glibc`` (as it starts), or ``auto``: bounded on a
GPU (a step frees few host tensors there), glibc on a CPU device; one line says which. A user
who set ``MALLOC_MMAP_THRESHOLD_`` keeps their own value.

``mallopt`` is this process's state: a DataLoader worker started by fork inherits it, one
started by spawn or forkserver (Linux's default from Python 3.14) does not. So the bounded
threshold is also put in the environment (``MALLOC_MMAP_THRESHOLD_=131072``, which glibc reads
when a process starts, with the same effect), where every process the rank starts gets it. Not
glibc (macOS, musl): nothing to do, said in one line. It imports nothing of foundryx, so any
part may use it.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from typing import Any

log = logging.getLogger("foundryx")

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
MMAP_THRESHOLD = 128 * 1024  # glibc's own starting value, kept from then on
ENV = "MALLOC_MMAP_THRESHOLD_"


@functools.cache
def glibc() -> Any:
    """The C library this process runs on when it is glibc (it has ``mallopt`` and
    ``gnu_get_libc_version``), else None. ``CDLL(None)`` is the process's own symbols, its libc
    among them: no search by name (``find_library`` finds nothing without ldconfig or a
    compiler, as in slim containers)."""
    try:
        libc = ctypes.CDLL(None)
    except OSError:  # no dynamic loader to ask (a static build)
        return None
    return libc if hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version") else None


_done = False


def choose(mode: str, device: str) -> bool:
    """Whether ``host_heap: mode`` bounds the heap on ``device`` (``cpu`` or ``gpu``): bounded
    yes, glibc no, auto on a GPU only (there a step frees few host tensors, so fixing the
    threshold should cost nothing: not measured yet; on a CPU device it costs step time, measured
    in the module docstring)."""
    return mode == "bounded" or (mode == "auto" and device == "gpu")


def configure(mode: str, device: str) -> bool:
    """Apply ``host_heap: mode`` (the run config's) on ``device``, once per process, and log
    one line on rank 0 saying what and why; True when the heap is bounded now."""
    if choose(mode, device):
        return bound_host_heap(f"host_heap: {mode}" + (" on a GPU" if mode == "auto" else ""))
    if mode == "auto" and os.environ.get("RANK", "0") == "0" and glibc() is not None:
        log.info("host memory: glibc's allocator left as it starts (host_heap: auto on a CPU "
                 "device, the faster: a step's freed temporaries may stay in its heap, above the "
                 "plan at large sizes; host_heap: bounded returns them, docs/planning.md)")
    return False


def bound_host_heap(why: str = "") -> bool:
    """Fix glibc's mmap threshold at 128 KiB in this process and in every process it starts
    from now on (module docstring), and log one line with ``why``; True when it is fixed now.
    Once per process; not when ``MALLOC_MMAP_THRESHOLD_`` is set (glibc read it at start: the
    user's choice) or the C library is not glibc (one line says so)."""
    global _done
    if _done or os.environ.get(ENV) is not None:
        return False
    _done = True
    libc = glibc()
    if libc is None:
        _say_not_glibc(why)
        return False
    if libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) != 1:
        log.warning("host memory: glibc refused to fix its mmap threshold; freed host memory may "
                    "be kept by the allocator (set %s=%d before the run starts)", ENV,
                    MMAP_THRESHOLD)
        return False
    os.environ[ENV] = str(MMAP_THRESHOLD)  # for spawned and forkserver workers (docstring)
    if os.environ.get("RANK", "0") == "0":
        log.info("host memory: glibc's mmap threshold fixed at 128 KiB on every rank%s and in "
                 "the processes it starts (DataLoader workers, by %s=%d in their environment), so "
                 "that what a step frees goes back to the OS instead of staying in glibc's heap (%s "
                 "in the environment overrides it)", f" ({why})" if why else "", ENV,
                 MMAP_THRESHOLD, ENV)
    return True


def _say_not_glibc(why: str) -> None:
    """The one line when the heap cannot be bounded because this C library has no glibc
    ``mallopt`` (rank 0; every rank runs on the same library)."""
    if os.environ.get("RANK", "0") == "0":
        log.warning("host memory: the heap is left as it is%s: this process's C library is not "
                    "glibc (no mallopt: macOS, musl), so its mmap threshold cannot be fixed; "
                    "freed host memory may stay with the allocator", f" ({why})" if why else "")
