"""NF4 encoding on the CPU in one pass per element: a small C kernel, built once per machine with
the system's C compiler (``-O3 -march=native``, IEEE arithmetic: no fast-math), loaded with
ctypes.

torchao's NF4 encoder (and foundryx's unfused one, ``foundryx.loading.nf4_encode.nf4_encode``)
runs about eight torch ops per element, each a pass over memory: 3.0-3.4 CPU seconds per GiB
of bfloat16 read into float32 NF4, which made an NF4 load CPU-bound; this kernel takes 0.43. This kernel reads each value
once and computes the same thing, bit for bit: the value in the NF4 dtype (float32, or
bfloat16 rounded to nearest even as torch casts), its block's absmax, the value divided by it
(in float32, rounded to the dtype as torch's bfloat16 division does), and the level's index as
the number of the 15 decision thresholds at or below it (the smallest value of the dtype that
torchao's nearest-level search puts above each level; within [-1, 1] the code only grows with
the value). Two codes a byte, the first in the high half (torchao's order).

A block whose absmax is 0, infinite or NaN (its scaled values leave [-1, 1]) is not encoded:
the kernel counts such blocks and the caller encodes the whole slice with the unfused encoder.

The same idea as DeepSpeed's CPU Adam, which is built with the machine's compiler on first use.
The library is cached under ``~/.cache/foundryx/kernels`` (``FOUNDRYX_KERNEL_CACHE``), keyed by
the source, the flags, the compiler and the CPU's flags; ranks that build it at once each write
their own file and rename it into place. The source needs no ``_Float16`` (float16 values are
converted by bit operations), so any C11 compiler builds it: gcc before 12 on x86-64 too. Without
a C compiler (or where it fails) :func:`library` warns once, with why, the cost and the fix, and
the caller keeps the unfused encoder.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

SOURCE = r"""
#include <stdint.h>
#include <string.h>

/* round to nearest even, as c10::BFloat16 does for a finite value (a NaN whose payload is all in
   the low half comes out infinite: still above every finite value, so its block is left to the
   caller as a NaN's is) */
static inline uint32_t round_bf16(uint32_t u) { return (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u; }

/* A float16's bits as the float32's bits of the same value, exactly as the hardware converts
   (x86's F16C, AArch64's FCVT, and so torch): a NaN keeps its sign and payload and comes out
   quiet. By integer operations rather than _Float16, which gcc has on x86-64 from version 12
   only (Ubuntu 22.04's gcc 11, RHEL 8/9 lack it), and with masks instead of branches or
   selects (which gcc 12 reads as control flow), so that the loop over a block vectorizes. A
   zero or subnormal is its 10-bit mantissa times 2^-24 (an exact float32 product); a normal
   number rebiases its exponent by 127 - 15 = 112; an infinity or NaN (exponent 31) by 112
   more, to 255. */
static inline uint32_t half_to_float(uint32_t h) {
    uint32_t sign = (h & 0x8000u) << 16, em = h & 0x7FFFu;
    float tiny = (float)(int32_t)em * 0x1p-24f;
    uint32_t small; memcpy(&small, &tiny, 4);
    uint32_t is_small = 0u - (uint32_t)(em < 0x0400u), is_special = 0u - (uint32_t)(em >= 0x7C00u);
    uint32_t quiet = (uint32_t)(em > 0x7C00u) << 22;
    uint32_t big = ((em << 13) + (112u << 23) + (is_special & (112u << 23))) | quiet;
    return sign | (small & is_small) | (big & ~is_small);
}

/* One block of n values at a time; each loop written so that the compiler vectorizes it (bits
   as integers, no branches), and inlined with n = 64 (torchao's block) as a constant. */
static inline __attribute__((always_inline)) int64_t encode_blocks(
        const void *src, int src_kind, int64_t nblocks, const int n, int bf16_out,
        const float *thresholds, float *absmax, uint8_t *packed) {
    const float t0 = thresholds[0], t1 = thresholds[1], t2 = thresholds[2], t3 = thresholds[3],
        t4 = thresholds[4], t5 = thresholds[5], t6 = thresholds[6], t7 = thresholds[7],
        t8 = thresholds[8], t9 = thresholds[9], t10 = thresholds[10], t11 = thresholds[11],
        t12 = thresholds[12], t13 = thresholds[13], t14 = thresholds[14];
    uint32_t u[4096];
    float v[4096];
    int32_t c[4096]; /* codes as wide as the floats: no narrowing per comparison */
    int64_t odd = 0;
    for (int64_t b = 0; b < nblocks; b++) {
        int64_t o = b * n;
        if (src_kind == 0) memcpy(u, (const float *)src + o, sizeof(float) * n);
        else if (src_kind == 1) { const uint16_t *s = (const uint16_t *)src + o; for (int i = 0; i < n; i++) u[i] = (uint32_t)s[i] << 16; }
        else { const uint16_t *s = (const uint16_t *)src + o; for (int i = 0; i < n; i++) u[i] = half_to_float(s[i]); }
        if (bf16_out && src_kind != 1) for (int i = 0; i < n; i++) u[i] = round_bf16(u[i]);
        /* magnitudes order as their bits do; NaN and infinity above every finite value */
        uint32_t top = 0;
        for (int i = 0; i < n; i++) { uint32_t m = u[i] & 0x7FFFFFFFu; top = m > top ? m : top; }
        float am; memcpy(&am, &top, 4);
        absmax[b] = am;
        if (top == 0 || top >= 0x7F800000u) { odd++; continue; }
        memcpy(v, u, sizeof(float) * n);
        for (int i = 0; i < n; i++) v[i] = v[i] / am;
        if (bf16_out) {
            memcpy(u, v, sizeof(float) * n);
            for (int i = 0; i < n; i++) u[i] = round_bf16(u[i]);
            memcpy(v, u, sizeof(float) * n);
        }
        for (int i = 0; i < n; i++) {
            float s = v[i];
            c[i] = ((s >= t0) + (s >= t1) + (s >= t2) + (s >= t3) + (s >= t4) + (s >= t5) + (s >= t6)
                             + (s >= t7) + (s >= t8) + (s >= t9) + (s >= t10) + (s >= t11) + (s >= t12)
                             + (s >= t13) + (s >= t14));
        }
        uint8_t *p = packed + o / 2;
        for (int i = 0; i < n / 2; i++) p[i] = (uint8_t)((c[2 * i] << 4) | c[2 * i + 1]);
    }
    return odd;
}

/* src_kind 0: float32, 1: bfloat16, 2: float16. bf16_out: the NF4 dtype is bfloat16.
   Returns the number of blocks left unencoded (absmax 0, infinite or NaN). */
int64_t nf4_encode(const void *src, int src_kind, int64_t nblocks, int64_t block, int bf16_out,
                   const float *thresholds, float *absmax, uint8_t *packed) {
    if (block == 64)
        return encode_blocks(src, src_kind, nblocks, 64, bf16_out, thresholds, absmax, packed);
    return encode_blocks(src, src_kind, nblocks, (int)block, bf16_out, thresholds, absmax, packed);
}
"""
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c11"]
MAX_BLOCK = 4096
_SRC_KIND = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_lib: dict[str, object] = {}
_lock = threading.Lock()
log = logging.getLogger(__name__)


def cache_dir() -> Path:
    return Path(os.environ.get("FOUNDRYX_KERNEL_CACHE") or Path.home() / ".cache" / "foundryx" / "kernels")


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compile(cc: list[str], flags: list[str], path: Path) -> str | None:
    """Compile :data:`SOURCE` with the command ``cc`` and ``flags`` into ``path``; None, or why
    not. A private build directory beside ``path`` and one rename into place: ranks building
    at once each write their own file, and a failed build leaves nothing behind. (Tests build
    the source with other compilers and flags through this.)"""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
            c, so = Path(tmp) / "nf4_cpu.c", Path(tmp) / path.name
            c.write_text(SOURCE)
            done = subprocess.run([*cc, *flags, str(c), "-o", str(so)], capture_output=True, text=True,
                                  timeout=300)
            if done.returncode:
                said = (done.stderr or done.stdout).strip().splitlines() or [f"exit code {done.returncode}"]
                return f"{' '.join(cc)} failed: {said[-1][:200]}"
            os.replace(so, path)  # atomic: a whole file or none
    except (OSError, subprocess.SubprocessError) as e:
        return f"building {path} failed: {e}"
    return None


def _load(path: Path) -> ctypes.CDLL | str:
    """The built library at ``path`` with :func:`encode`'s entry point typed; or why not."""
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        return f"loading {path} failed: {e}"
    lib.nf4_encode.restype = ctypes.c_int64
    lib.nf4_encode.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
                               ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p]
    return lib


def _build() -> ctypes.CDLL | str:
    """The kernel's library, built here if no cached one matches; or why it cannot be built."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if not cc:
        return "no C compiler on PATH"
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return f"{cc} --version failed: {e}"
    key = hashlib.sha256("\0".join([SOURCE, *FLAGS, version, platform.machine(), _cpu_flags()]).encode())
    path = cache_dir() / f"nf4_cpu-{key.hexdigest()[:20]}.so"
    if not path.exists():
        why = _compile([cc], FLAGS, path)
        if why:
            return why
    return _load(path)


def library() -> ctypes.CDLL | str:
    """The kernel's library (built or loaded once per process), or why there is none: a
    warning, once, in one line, with what the torch-op encoder the loader falls back to costs
    and how to get the kernel (a deliberate fallback, but one that makes an NF4 load CPU-bound:
    worth a user's attention, not an info line that nobody reads)."""
    with _lock:
        if "lib" not in _lib:
            _lib["lib"] = _build()
            if isinstance(_lib["lib"], str):
                log.warning("NF4 on load: encoding with torch ops, about 3x the load's CPU time and "
                            "up to 40 MiB more host memory a rank, because foundryx's C encoder "
                            "is not available: %s. Fix: install a C compiler (gcc or clang) or set "
                            "CC to one", _lib["lib"])
        return _lib["lib"]  # type: ignore[return-value]


def available() -> bool:
    """Whether the library is there (see :func:`library`)."""
    return not isinstance(library(), str)


def supports(src: torch.dtype, dtype: torch.dtype, block: int, device: torch.device) -> bool:
    """Whether the kernel encodes ``src`` values into NF4 of ``dtype`` with blocks of ``block``."""
    return (device.type == "cpu" and src in _SRC_KIND and dtype in (torch.float32, torch.bfloat16)
            and 0 < block <= MAX_BLOCK and block % 2 == 0)


def encode(rows: torch.Tensor, block: int, dtype: torch.dtype, thresholds: torch.Tensor,
           absmax: torch.Tensor, packed: torch.Tensor) -> int:
    """Encode ``rows`` (contiguous, on the CPU, a whole number of blocks) into ``absmax`` (float32,
    one per block) and ``packed`` (uint8, two codes a byte); ``thresholds``: the dtype's 15
    decision thresholds, float32. Returns the number of blocks left unencoded (see the module
    doc). Releases the GIL while it runs (a ctypes call)."""
    lib = library()
    if isinstance(lib, str):
        raise RuntimeError(lib)
    assert rows.is_contiguous() and absmax.dtype == torch.float32 and packed.dtype == torch.uint8
    assert thresholds.dtype == torch.float32 and thresholds.numel() == 15 and thresholds.is_contiguous()
    blocks = rows.numel() // block
    assert blocks * block == rows.numel() and absmax.numel() == blocks and packed.numel() * 2 == rows.numel()
    return lib.nf4_encode(rows.data_ptr(), _SRC_KIND[rows.dtype], blocks, block, int(dtype == torch.bfloat16),
                          thresholds.data_ptr(), absmax.data_ptr(), packed.data_ptr())
