"""Reading row ranges of checkpoint tensors: one contiguous byte range each, several threads.

A ``Shard(0)`` slice of a row-major tensor is one contiguous range of its bytes, so a rank
maps exactly its share of each file (``mmap`` of that byte range, read ahead with
``MADV_WILLNEED``): the tensor's bytes are used where the page cache holds them, without a
copy into a freshly allocated buffer (first-touch page faults on fresh buffers were most of a
read's time; see benchmarks/RESULTS.md). Reader threads also convert each range into the
form the model keeps (``prepare`` of :func:`read_all`: a dtype cast or a quantization,
torch ops that release the GIL), so reading and converting overlap across tensors; only what
needs a collective (NF4's whole-weight statistic) runs on the calling thread, in order.
Rank 0 logs GB read, GB/s and the time left as it goes. The tensors the model keeps are
plain allocations: advising them as transparent huge pages before first touch was tried and
cost 2.7x the kernel time of a load on the benchmark's VM (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import logging
import mmap
import os
import resource
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from foundryx.loading.files import Entry, PretrainedLoadError

log = logging.getLogger(__name__)

THREADS = 8
LOG_EVERY_S = 5.0


@dataclass(frozen=True)
class Read:
    """Rows ``[start, stop)`` (along dim 0) of checkpoint tensor ``key``."""

    key: str
    entry: Entry
    start: int
    stop: int

    @property
    def shape(self) -> tuple[int, ...]:
        if not self.entry.shape:
            return ()
        return (self.stop - self.start, *self.entry.shape[1:])

    @property
    def byte_range(self) -> tuple[int, int]:
        e = self.entry
        if not e.shape:
            return e.begin, e.end
        row = e.nbytes // max(e.shape[0], 1)
        return e.begin + self.start * row, e.begin + self.stop * row


def read_rows(r: Read) -> torch.Tensor:
    """The rows of ``r`` as a tensor of the checkpoint's dtype, viewing a private mapping of
    exactly their byte range (page-aligned); the mapping is released with the tensor. A
    writable copy-on-write mapping: nothing written to the tensor reaches the file."""
    if sys.byteorder != "little":  # safetensors stores little-endian
        raise PretrainedLoadError("reading safetensors on a big-endian machine is not supported")
    begin, end = r.byte_range
    if end == begin:
        return torch.empty(r.shape, dtype=r.entry.dtype)
    base = begin - begin % mmap.ALLOCATIONGRANULARITY
    try:
        with open(r.entry.file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < end:  # checked again here: touching a mapping past the end is SIGBUS
                raise PretrainedLoadError(
                    f"{r.entry.file}: tensor {r.key!r} is cut short ({max(size - begin, 0)} of "
                    f"{end - begin} bytes); the file is truncated")
            m = mmap.mmap(f.fileno(), end - base, access=mmap.ACCESS_COPY, offset=base)
    except OSError as e:
        raise PretrainedLoadError(f"{r.entry.file}: cannot read tensor {r.key!r} "
                                  f"({e.strerror or e})") from None
    if hasattr(m, "madvise"):
        m.madvise(mmap.MADV_WILLNEED)  # a cold page cache: read the whole range ahead
    out = torch.frombuffer(m, dtype=torch.uint8, count=end - begin, offset=begin - base)
    return out.view(r.entry.dtype).view(r.shape)


def peak_rss_gb() -> float:
    """This process's peak resident memory so far (Linux: ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


class Progress:
    """GB read, GB/s and the time left, logged every few seconds (rank 0 only)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self.start = self.last = time.monotonic()

    def add(self, nbytes: int) -> None:
        self.done += nbytes
        now = time.monotonic()
        if self.enabled and now - self.last >= LOG_EVERY_S and self.done < self.total:
            self.last = now
            rate = self.done / max(now - self.start, 1e-9)
            log.info("loading: %.2f of %.2f GB read (%.0f%%), %.2f GB/s, ~%.0f s left",
                     self.done / 1e9, self.total / 1e9, 100 * self.done / max(self.total, 1),
                     rate / 1e9, (self.total - self.done) / max(rate, 1e-9))

    @property
    def seconds(self) -> float:
        return time.monotonic() - self.start


AHEAD_BYTES = 64 * 2**20  # reads in flight beyond the one being used (at least one)


def read_all(reads: list[Read], use: Callable[[Read, Any], None], progress: Progress,
             threads: int = THREADS,
             prepare: Callable[[Read, torch.Tensor], Any] | None = None) -> None:
    """Read every range with ``threads`` readers, each turning its rows into what ``use``
    takes with ``prepare`` (in the reader thread; default: the rows as read), and hand the
    results to ``use`` in the order of ``reads`` (so collectives inside ``use`` run in the
    same order on every rank), with at most ``AHEAD_BYTES`` (or one read) read ahead, so the
    transient memory is bounded."""
    if not reads:
        return

    def job(r: Read) -> Any:
        rows = read_rows(r)
        return rows if prepare is None else prepare(r, rows)

    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(reads)))) as pool:
        for r, value in zip(reads, _ahead(pool, reads, job), strict=True):
            progress.add(_size(r))
            use(r, value)
            del value


def _size(r: Read) -> int:
    begin, end = r.byte_range
    return end - begin


def _ahead(pool: ThreadPoolExecutor, reads: list[Read], job: Callable[[Read], Any]) -> Iterator[Any]:
    pending: list[tuple[int, Any]] = []
    queued = 0
    for r in reads:
        while pending and queued + _size(r) > AHEAD_BYTES:
            size, first = pending.pop(0)
            queued -= size
            yield first.result()
        pending.append((_size(r), pool.submit(job, r)))
        queued += _size(r)
    for _, f in pending:
        yield f.result()


def gb(nbytes: int | float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e7 else f"{nbytes / 2**20:.1f} MiB"
