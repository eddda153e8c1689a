"""MDS shards of one ``ndarray`` column in a local folder, written byte for byte as
mosaicml-streaming's ``MDSWriter`` writes them (no compression), without importing streaming.

``import streaming`` imports transformers, torch's compiler stack and torchvision (5 s of a
2-core machine's CPU, measured): more than a conversion of tens of MB takes. A conversion to a
local folder without compression (:mod:`foundryx.data.chunk_writer`) writes with
:class:`ShardWriter`; compressed or remote output keeps streaming's writer and uploaders.
The format, as streaming 0.13 writes it (``streaming/base/format/mds``):

- a sample: its column's byte length (uint32), then the ``ndarray:<dtype>`` encoding: one byte
  ``ndim << 2 | k`` (the shape's dtype, uint8 / 16 / 32 / 64 for k = 0..3, the smallest that
  holds the largest dimension), the shape, the values;
- a shard ``shard.NNNNN.mds``: the sample count (uint32), the samples' offsets (uint32, one
  more than the samples), the writer's config as sorted JSON, the samples; a new shard starts
  when the next sample would take it past ``size_limit`` (64 MiB) counting 4 bytes a sample
  and the header;
- ``index.json``: ``{"shards": [...], "version": 2}`` sorted, each shard the config, its
  sample count and its file's basename, bytes and hashes.

tests/test_mds_writer.py compares the files with streaming's writer's, and reads them back
with streaming's reader.
"""

from __future__ import annotations

import json
import os
import threading
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["ShardWriter"]

_SHAPE_DTYPES = ("uint8", "uint16", "uint32", "uint64")


def _hasher(algo: str) -> Any:
    """streaming's ``get_hash``'s algorithm as a running hash (``update``, ``hexdigest``):
    hashlib's algorithms, then xxhash's."""
    import hashlib

    if algo in hashlib.algorithms_available and hasattr(hashlib, algo):
        return getattr(hashlib, algo)()
    import xxhash

    return getattr(xxhash, algo)()


class ShardWriter:
    """``MDSWriter(out=folder, columns={name: "ndarray:<dtype>"}, hashes=..., size_limit=...)``
    for a local ``folder`` without compression: the same ``write``, ``finish`` and the cache
    attributes :func:`foundryx.data.chunk_writer.write_rows` fills."""

    format = "mds"
    extra_bytes_per_sample = 4
    compression = None

    def __init__(self, out: str | Path, columns: dict[str, str], hashes: list[str] | None = None,
                 size_limit: int = 1 << 26):
        if len(columns) != 1 or not next(iter(columns.values())).startswith("ndarray:"):
            raise ValueError(f"ShardWriter writes one ndarray:<dtype> column, not {columns}")
        (self.column, encoding), = columns.items()
        self.dtype = np.dtype(encoding.split(":", 1)[1])
        self.local = str(out)
        if os.path.isdir(self.local) and os.listdir(self.local):
            raise FileExistsError(f"Directory is not empty: {self.local}")
        os.makedirs(self.local, exist_ok=True)
        self.hashes, self.size_limit = list(hashes or []), size_limit
        self.column_names, self.column_encodings, self.column_sizes = [self.column], [encoding], [None]
        self.config_data = json.dumps(self.get_config(), sort_keys=True).encode("utf-8")
        self.extra_bytes_per_shard = 4 + 4 + len(self.config_data)
        self.shards: list[dict[str, Any]] = []
        self.event = threading.Event()  # streaming's: set by a failed upload; never here
        self._reset_cache()

    def get_config(self) -> dict[str, Any]:
        return {"version": 2, "format": self.format, "compression": self.compression,
                "hashes": self.hashes, "size_limit": self.size_limit,
                "column_names": self.column_names, "column_encodings": self.column_encodings,
                "column_sizes": self.column_sizes}

    def _reset_cache(self) -> None:
        self.new_samples: list[Any] = []  # encoded samples, or 2-D blocks of equal-sized ones
        self._counts: list[int] = []  # samples in each entry of new_samples
        self.new_shard_size = self.extra_bytes_per_shard

    def cancel_future_jobs(self) -> None:
        """streaming's writer cancels its uploads here; this one uploads nothing."""

    def encode_sample(self, sample: dict[str, Any]) -> bytes:
        value = np.asarray(sample[self.column])
        if value.dtype != self.dtype:
            raise ValueError(f"Wrong dtype: expected {self.dtype}, got {value.dtype}.")
        if value.ndim == 0 or value.ndim >= 64 or min(value.shape) <= 0:
            raise ValueError(f"an ndarray sample needs 1 to 63 axes, each longer than 0: "
                             f"{value.shape}")
        largest = max(value.shape)
        k = next(i for i, bits in enumerate((8, 16, 32, 64)) if largest < (1 << bits))
        datum = (bytes([value.ndim << 2 | k]) + np.array(value.shape, _SHAPE_DTYPES[k]).tobytes()
                 + value.tobytes())
        return np.uint32(len(datum)).tobytes() + datum

    def write(self, sample: dict[str, Any]) -> None:
        new_sample = self.encode_sample(sample)
        size = len(new_sample) + self.extra_bytes_per_sample
        if self.size_limit and self.size_limit < self.new_shard_size + size:
            self.flush_shard()
            self._reset_cache()
        self.new_samples.append(new_sample)
        self._counts.append(1)
        self.new_shard_size += size

    def add_encoded(self, block: np.ndarray) -> None:
        """Add the samples of ``block`` (uint8, a row per encoded sample, C-contiguous) to the
        shard, as many ``write`` calls of them would; the caller keeps them under
        ``size_limit`` (:func:`foundryx.data.chunk_writer.write_rows`). The block is written
        as it is when the shard is flushed: no bytes of each sample, no join."""
        self.new_samples.append(block)
        self._counts.append(len(block))
        self.new_shard_size += len(block) * (block.shape[1] + self.extra_bytes_per_sample)

    def flush_shard(self) -> None:
        counts = np.array(self._counts, np.int64)
        sizes = np.repeat([memoryview(x).nbytes // c for x, c in zip(self.new_samples, counts)],
                          counts)
        n = len(sizes)
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.uint32)
        offsets += 4 + offsets.nbytes + len(self.config_data)
        header = b"".join([np.uint32(n).tobytes(), offsets.tobytes(), self.config_data])
        hashes = [_hasher(algo) for algo in self.hashes]
        basename = f"shard.{len(self.shards):05}.{self.format}"
        with open(os.path.join(self.local, basename), "wb") as f:
            for part in (header, *self.new_samples):
                f.write(part)
                for h in hashes:
                    h.update(part)
        info = {"basename": basename, "bytes": int(offsets[-1]),
                "hashes": {algo: h.hexdigest() for algo, h in zip(self.hashes, hashes)}}
        self.shards.append({"samples": n, "raw_data": info, "zip_data": None,
                            **self.get_config()})

    def finish(self) -> None:
        if self.new_samples:
            self.flush_shard()
            self._reset_cache()
        with open(os.path.join(self.local, "index.json"), "w") as f:
            json.dump({"version": 2, "shards": self.shards}, f, sort_keys=True)
