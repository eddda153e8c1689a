"""foundryx's ShardWriter writes the files mosaicml-streaming's MDSWriter writes, byte for byte
(shards, their headers and index.json), whether rows come one by one or through write_rows, at
every shape dtype and across shard boundaries; streaming reads them back."""

from __future__ import annotations

import numpy as np
import pytest

from foundryx.data.chunk_writer import COLUMN, SHARD_HASH, new_writer, write_rows
from foundryx.data.mds_writer import ShardWriter


def _files(folder):
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.mark.parametrize("seq", [7, 256, 70_000])  # shape dtypes uint8, uint16, uint32
@pytest.mark.parametrize("rows_at_once", [False, True, "mixed"])
def test_the_same_files_as_streamings_writer(tmp_path, seq, rows_at_once):
    from streaming import MDSWriter

    rng = np.random.default_rng(seq)
    rows = rng.integers(0, 50_000, size=(max(3, 600_000 // seq), seq), dtype=np.int32)
    limit = 200_000  # several shards
    ours = ShardWriter(tmp_path / "ours", {COLUMN: "ndarray:int32"}, [SHARD_HASH], size_limit=limit)
    theirs = MDSWriter(out=str(tmp_path / "theirs"), columns={COLUMN: "ndarray:int32"},
                       hashes=[SHARD_HASH], size_limit=limit)
    for writer in (ours, theirs):
        if rows_at_once == "mixed":  # single samples between blocks, in one shard
            writer.write({COLUMN: rows[0]})
            write_rows(writer, rows[1:-2])
            writer.write({COLUMN: rows[-2]})
            write_rows(writer, rows[-1:])
        elif rows_at_once:
            write_rows(writer, rows[:2])
            write_rows(writer, rows[2:])
        else:
            for row in rows:
                writer.write({COLUMN: row})
        writer.finish()
    mine, want = _files(tmp_path / "ours"), _files(tmp_path / "theirs")
    assert mine == want and len(want) >= 3  # index.json and two shards or more
    assert ours.shards == theirs.shards


def test_streaming_reads_it_back(tmp_path):
    from streaming import StreamingDataset

    rows = np.arange(5 * 256, dtype=np.int32).reshape(5, 256)
    writer = new_writer(str(tmp_path / "mds"), None)
    assert isinstance(writer, ShardWriter)  # local, uncompressed: foundryx's
    write_rows(writer, rows)
    writer.finish()
    data = StreamingDataset(local=str(tmp_path / "mds"), batch_size=1, shuffle=False)
    assert [data[i][COLUMN].tolist() for i in range(5)] == rows.tolist()


def test_compressed_or_remote_output_keeps_streamings_writer(tmp_path):
    from streaming import MDSWriter

    assert isinstance(new_writer(str(tmp_path / "z"), "zstd"), MDSWriter)
    assert isinstance(new_writer((str(tmp_path / "l"), str(tmp_path / "r")), None), MDSWriter)


def test_bad_samples_are_refused(tmp_path):
    writer = ShardWriter(tmp_path / "w", {COLUMN: "ndarray:int32"})
    with pytest.raises(ValueError, match="Wrong dtype"):
        writer.write({COLUMN: np.zeros(3, np.int64)})
    with pytest.raises(ValueError, match="1 to 63 axes"):
        writer.write({COLUMN: np.zeros(0, np.int32)})
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(FileExistsError, match="not empty"):
        ShardWriter(tmp_path / "full", {COLUMN: "ndarray:int32"})
