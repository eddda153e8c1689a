"""Reading row ranges of checkpoint tensors: one contiguous byte range each, several threads.

A ``Shard(0)`` slice of a row-major tensor is one contiguous range of its bytes, so a rank
reads exactly its share of each file with one positioned read into a tensor it allocated
(``readinto``, which releases the GIL, so reader threads overlap). Rank 0 logs GB read, GB/s
and the time left as it goes.
"""

from __future__ import annotations

import logging
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
    """The rows of ``r`` as a tensor of the checkpoint's dtype (one positioned read)."""
    begin, end = r.byte_range
    out = torch.empty(end - begin, dtype=torch.uint8)
    try:
        with open(r.entry.file, "rb", buffering=0) as f:
            f.seek(begin)
            got = f.readinto(memoryview(out.numpy())) if end > begin else 0
    except OSError as e:
        raise PretrainedLoadError(f"{r.entry.file}: cannot read tensor {r.key!r} "
                                  f"({e.strerror or e})") from None
    if got != end - begin:
        raise PretrainedLoadError(f"{r.entry.file}: tensor {r.key!r} is cut short ({got} of "
                                  f"{end - begin} bytes); the file is truncated")
    if sys.byteorder != "little":  # safetensors stores little-endian
        raise PretrainedLoadError("reading safetensors on a big-endian machine is not supported")
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


def read_all(reads: list[Read], use: Callable[[Read, torch.Tensor], None],
             progress: Progress, threads: int = THREADS) -> None:
    """Read every range with ``threads`` readers and hand each tensor to ``use`` in the order
    of ``reads`` (so collectives inside ``use`` run in the same order on every rank), with at
    most ``AHEAD_BYTES`` (or one read) read ahead, so the transient memory is bounded."""
    if not reads:
        return
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(reads)))) as pool:
        for r, tensor in zip(reads, _ahead(pool, reads), strict=True):
            progress.add(tensor.numel() * tensor.element_size())
            use(r, tensor)
            del tensor


def _size(r: Read) -> int:
    begin, end = r.byte_range
    return end - begin


def _ahead(pool: ThreadPoolExecutor, reads: list[Read]) -> Iterator[torch.Tensor]:
    pending: list[tuple[int, Any]] = []
    queued = 0
    for r in reads:
        while pending and queued + _size(r) > AHEAD_BYTES:
            size, first = pending.pop(0)
            queued -= size
            yield first.result()
        pending.append((_size(r), pool.submit(read_rows, r)))
        queued += _size(r)
    for _, f in pending:
        yield f.result()


def gb(nbytes: int | float) -> str:
    return f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e7 else f"{nbytes / 2**20:.1f} MiB"
