"""Writing the token stream of a conversion (:mod:`foundryx.data.convert`) as MDS shards.

:class:`ChunkWriter` cuts the stream into sequences of ``max_seq_len`` tokens, carries the
remainder to the next batch, and writes each chunk as its own MDS dataset in the work folder
(:mod:`foundryx.data.partial`), recording it in the ledger once complete, with foundryx's
:class:`~foundryx.data.mds_writer.ShardWriter` (a local folder, no compression: the same files,
streaming not imported) or mosaicml-streaming's ``MDSWriter`` (:func:`new_writer`).
:func:`write_rows` hands many rows to either at once, with the bytes and shards their ``write``
gives row by row.
"""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from foundryx.data import remote as remotes
from foundryx.data.mds_writer import ShardWriter
from foundryx.data.partial import Partial
from foundryx.errors import DataError

INDEX = "index.json"
COLUMN = "tokens"
# Each shard's hash, recorded in index.json by mosaicml-streaming's writer; loaders check it
# (foundryx.data.options.shard_problems), and streaming's validate_hash can use it on download.
SHARD_HASH = "xxh3_64"


class ChunkWriter:
    """Cuts the token stream into sequences and writes each chunk's MDS dataset."""

    def __init__(self, partial: Partial, max_seq_len: int, compression: str | None,
                 done: list[dict[str, Any]], remote: str | None = None):
        self.partial, self.seq, self.compression = partial, max_seq_len, compression
        self.remote = remote  # shards go there as they are finished; only indexes stay local
        self.chunk = len(done)
        self.carry = np.asarray(done[-1]["carry"] if done else [], dtype=np.int32)
        self.writer: Any = None
        self.counts = {"docs": 0, "tokens": 0, "sequences": 0}

    def add(self, chunk: int, n_docs: int, tokens: np.ndarray) -> int:
        """Add one batch; return the number of tokens it brought."""
        if chunk != self.chunk:
            self.close_chunk()
            self.chunk = chunk
        if self.writer is None:
            local = str(self.partial.chunk_dir(chunk))
            out = local if self.remote is None else (local, remotes.join(
                self.remote, self.partial.chunk_dir(chunk).relative_to(
                    self.partial.folder).as_posix()))
            self.writer = new_writer(out, self.compression)
        stream = np.concatenate([self.carry, tokens]) if len(self.carry) else tokens
        n_full = len(stream) // self.seq * self.seq
        write_rows(self.writer, stream[:n_full].reshape(-1, self.seq))
        self.carry = stream[n_full:]
        self.counts["docs"] += n_docs
        self.counts["tokens"] += len(tokens)
        self.counts["sequences"] += n_full // self.seq
        return len(tokens)

    def close_chunk(self) -> None:
        if self.writer is None:
            return
        shards = self.writer.shards
        try:
            self.writer.finish()
        except Exception as e:  # an upload failed in streaming's threads (it logged which)
            if self.remote is None:
                raise
            raise DataError(f"uploading shards to {self.remote} failed ({e}; the log above says "
                            f"why); the same command resumes from the last finished chunk once "
                            f"that is fixed") from None
        if self.remote is not None:  # the writer removed its local folder: keep the index
            folder = self.partial.chunk_dir(self.chunk)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / INDEX).write_text(json.dumps({"version": 2, "shards": shards},
                                                   sort_keys=True))
        self.writer = None
        self.partial.chunk_done({"chunk": self.chunk, **self.counts, "carry": self.carry.tolist()})
        self.counts = dict.fromkeys(self.counts, 0)
        self.chunk += 1


def new_writer(out: str | tuple[str, str], compression: str | None) -> Any:
    """The chunk's shard writer: foundryx's :class:`~foundryx.data.mds_writer.ShardWriter` (the
    same files, no import of streaming) for a local folder without compression, else
    mosaicml-streaming's ``MDSWriter`` (its compressions and uploads)."""
    columns = {COLUMN: "ndarray:int32"}
    if isinstance(out, str) and compression is None:
        return ShardWriter(out, columns, hashes=[SHARD_HASH])
    from streaming import MDSWriter

    return MDSWriter(out=out, columns=columns, compression=compression, hashes=[SHARD_HASH],
                     keep_local=False)


def write_rows(writer: Any, rows: np.ndarray) -> None:
    """``writer.write({COLUMN: row})`` for each row of ``rows`` (one MDSWriter, one
    ``ndarray:int32`` column), with the same bytes and shards, without encoding each row in
    Python: every row's encoding is the first row's header and the row's own bytes, so the
    rows are encoded as one array, a shard flushed where ``MDSWriter.write`` flushes it (when
    the next sample would pass ``size_limit``). foundryx's ShardWriter takes each shard's part
    of the array as one block, which it writes as it is; streaming's writer gets views of its
    rows in its sample cache (it only takes their lengths and joins them into the shard)."""
    if not len(rows):
        return
    first = writer.encode_sample({COLUMN: rows[0]})
    head = len(first) - rows[0].nbytes
    size = len(first) + writer.extra_bytes_per_sample
    if writer.size_limit and writer.size_limit < writer.extra_bytes_per_shard + size:
        for row in rows:  # a sample larger than a shard: MDSWriter's own way
            writer.write({COLUMN: row})
        return
    encoded = np.empty((len(rows), len(first)), dtype=np.uint8)
    encoded[:, :head] = np.frombuffer(first[:head], dtype=np.uint8)
    encoded[:, head:] = np.ascontiguousarray(rows).view(np.uint8)
    i = 0
    while i < len(rows):
        if writer.event.is_set():  # an upload thread failed: as MDSWriter.write reports it
            writer.cancel_future_jobs()
            raise Exception("One of the threads failed. Check other traceback for more details.")
        room = len(rows) - i
        if writer.size_limit:
            room = min(room, (writer.size_limit - writer.new_shard_size) // size)
        if room <= 0:
            writer.flush_shard()
            writer._reset_cache()
            continue
        if isinstance(writer, ShardWriter):  # the rows as one block, written as it is
            writer.add_encoded(encoded[i:i + room])
        else:
            writer.new_samples.extend(encoded[i:i + room])  # rows: 1-D uint8 views
            writer.new_shard_size += room * size
        i += room
