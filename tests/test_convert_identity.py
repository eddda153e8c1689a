"""Conversion output pinned to the straightforward conversion it replaced (issue 55).

The reference below is the conversion as it was before it was made fast: the ``.txt`` reader
decodes line by line, each document is tokenized by the Hugging Face tokenizer on its own,
its stream ``prefix + ids + suffix`` is cut into sequences, and every sequence is written by
mosaicml-streaming's ``MDSWriter`` one row at a time, one MDS dataset per chunk. The fast
path must give the same documents, the same files byte for byte (shards, their hashes in
``index.json``) and the same manifest, for 1 and 2 workers, several batches and chunks, with
and without compression, on text that has the awkward cases (``\\r\\n``, lines of Unicode
whitespace only, a trailing ``\\r``, non-ASCII, no final newline).
"""

from __future__ import annotations

import json

import numpy as np
import pytest

from foundryx.data import sources
from foundryx.data.convert import MANIFEST, convert_to_mds
from foundryx.data.synthetic import generate_corpus
from foundryx.errors import DataError

SEQ = 24


def reference_documents(path):
    """Today's ``.txt`` rule, line by line: blocks of non-blank lines joined by ``\\n``."""
    block = []
    with open(path, "rb") as f:
        for raw in f:
            line = raw.decode("utf-8").rstrip("\r\n")
            if line.strip():
                block.append(line)
            elif block:
                yield "\n".join(block)
                block = []
    if block:
        yield "\n".join(block)


def reference_convert(docs, out, tokenizer, seq, batch_chars, chunk_chars, compression):
    """Shards and merged index as the row-by-row MDSWriter conversion wrote them."""
    from streaming import MDSWriter

    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    prefix = [bos] if bos is not None and bos != eos else []
    suffix = [eos] if eos is not None else []
    # the batches and chunks of foundryx.data.convert._batches (they depend on the input only)
    batches, chunk, in_chunk, size, batch = [], 0, 0, 0, []
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        if size >= batch_chars:
            batches.append((chunk, batch))
            in_chunk += size
            if in_chunk >= chunk_chars:
                chunk, in_chunk = chunk + 1, 0
            batch, size = [], 0
    if batch:
        batches.append((chunk, batch))
    carry, writers = np.zeros(0, np.int32), {}
    for chunk, batch in batches:
        ids = []
        for doc in batch:
            ids += prefix + tokenizer(doc, add_special_tokens=False)["input_ids"] + suffix
        stream = np.concatenate([carry, np.asarray(ids, dtype=np.int32)])
        n = len(stream) // seq * seq
        if chunk not in writers:
            for w in writers.values():
                w.finish()
            writers = {chunk: MDSWriter(out=str(out / "chunks" / f"{chunk:06d}"),
                                        columns={"tokens": "ndarray:int32"},
                                        compression=compression, hashes=["xxh3_64"])}
        for row in stream[:n].reshape(-1, seq):
            writers[chunk].write({"tokens": row})
        carry = stream[n:]
    for w in writers.values():
        w.finish()
    shards = []
    for chunk in range(len({c for c, _ in batches})):
        rel = f"chunks/{chunk:06d}"
        for shard in json.loads((out / rel / "index.json").read_text())["shards"]:
            for key in ("raw_data", "zip_data"):
                if shard.get(key):
                    shard[key]["basename"] = f"{rel}/{shard[key]['basename']}"
            shards.append(shard)
    (out / "index.json").write_text(json.dumps({"version": 2, "shards": shards}))


def awkward_text(n_docs: int = 120) -> bytes:
    docs = generate_corpus(n_docs, seed=7)
    parts = []
    for i, doc in enumerate(docs):
        lines = doc.split(" ")
        lines = [" ".join(lines[j:j + 7]) for j in range(0, len(lines), 7)]
        if i % 5 == 1:
            lines = [line + "\r" for line in lines]  # \r\n line ends
        if i % 7 == 2:
            lines[0] += " é ü ✓ 漢字"
        if i % 11 == 3:
            lines[-1] += "\r\r"  # several \r before the \n: all removed
        if i % 13 == 4:
            lines.insert(1, "  \t")  # a whitespace-only line inside: splits the document
        if i % 9 == 5:
            lines.insert(1, "\u3000\x0c\u2003")  # Unicode whitespace only: blank too
        if i % 17 == 6:
            lines[0] = "  leading spaces kept " + lines[0]
        parts.append("\n".join(lines))
        parts.append("\n\n" if i % 3 else "\n \n\n\r\n")
    text = "\n\n" + "".join(parts)
    return (text.rstrip("\n") + " no final newline").encode("utf-8")


def files_of(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file() and p.name != MANIFEST}


WHITESPACE = "".join(c for c in map(chr, range(0x3001)) if c.isspace() and c != "\n")


@pytest.mark.parametrize("read_bytes", [None, 1, 7, 64])
def test_txt_documents_are_the_line_by_line_rule(tmp_path, monkeypatch, read_bytes):
    if read_bytes:  # documents, lines and separators across the reads
        monkeypatch.setattr(sources, "_READ_BYTES", read_bytes)
    src = tmp_path / "c.txt"
    src.write_bytes(awkward_text(40 if read_bytes else 120))
    assert list(sources.read_documents(src)) == list(reference_documents(src))
    src.write_bytes(f"a\n{WHITESPACE}\nb\r\n\r\n\x85c\u2028d\n".encode())  # every blank
    assert list(sources.read_documents(src)) == list(reference_documents(src)) == [
        "a", "b", "\x85c\u2028d"]
    rng = np.random.default_rng(read_bytes or 0)
    alphabet = ["a", "b", " ", "\r", "\n", "\n", "\u3000", "é", "\x0c"]
    for _ in range(30):
        src.write_bytes("".join(rng.choice(alphabet, size=rng.integers(0, 80))).encode())
        assert list(sources.read_documents(src)) == list(reference_documents(src))
    src.write_bytes(b"")
    assert list(sources.read_documents(src)) == []
    src.write_bytes(b"\n\n  \n")
    assert list(sources.read_documents(src)) == []
    src.write_bytes(b"one line")
    assert list(sources.read_documents(src)) == ["one line"]


@pytest.mark.parametrize("workers,compression", [(1, None), (2, None), (2, "zstd")])
def test_shards_are_byte_identical_to_the_row_by_row_conversion(tmp_path, tiny_tokenizer,
                                                                workers, compression):
    src = tmp_path / "c.txt"
    src.write_bytes(awkward_text())
    docs = list(reference_documents(src))
    ref = tmp_path / "ref"
    reference_convert(docs, ref, tiny_tokenizer, SEQ, 1500, 5000, compression)
    manifest = convert_to_mds(src, tmp_path / "out", tiny_tokenizer, SEQ, workers=workers,
                              compression=compression, batch_chars=1500, chunk_chars=5000,
                              progress=False)
    want = files_of(ref)
    assert len([k for k in want if k.startswith("chunks/") and k.endswith("index.json")]) >= 3
    assert files_of(tmp_path / "out") == want
    assert manifest["documents"] == len(docs)
    assert manifest["sequences"] * SEQ == manifest["tokens"]
    assert json.loads((tmp_path / "out" / MANIFEST).read_text()) == manifest


def test_not_utf8_names_the_byte_and_line_and_leaves_nothing(tmp_path, tiny_tokenizer):
    text = awkward_text()
    cut = text.index(b"\n", len(text) // 2) + 5
    bad = text[:cut] + b"\xff" + text[cut:]
    src = tmp_path / "c.txt"
    src.write_bytes(bad)
    line = bad[:cut].count(b"\n") + 1
    with pytest.raises(DataError) as e:
        convert_to_mds(src, tmp_path / "out", tiny_tokenizer, SEQ, workers=1, progress=False)
    msg = str(e.value)
    assert f"{src}: not UTF-8 at byte {cut} (line {line}: invalid start byte)" in msg
    assert "iconv" in msg
    assert not any(tmp_path.glob("*out*"))


@pytest.mark.parametrize("size_limit", [None, 700, 1 << 12, 60])
def test_write_rows_flushes_shards_where_mdswriter_does(tmp_path, size_limit):
    from streaming import MDSWriter

    from foundryx.data.convert import write_rows

    rows = np.arange(97 * 24, dtype=np.int32).reshape(97, 24) * 37 - 1000
    folders = {}
    for how in ("rows", "write"):
        folders[how] = tmp_path / how
        w = MDSWriter(out=str(folders[how]), columns={"tokens": "ndarray:int32"},
                      hashes=["xxh3_64"], size_limit=size_limit)
        for part in (rows[:10], rows[10:11], rows[11:11], rows[11:]):
            if how == "rows":
                write_rows(w, part)
            else:
                for row in part:
                    w.write({"tokens": row})
        w.finish()
    want = files_of(folders["write"])
    assert len(want) > (2 if size_limit in (700, 60) else 1)
    assert files_of(folders["rows"]) == want


def test_workers_do_not_import_the_calling_script(tmp_path, tiny_tokenizer):
    """Spawned workers start with a bare ``__main__``: a script (here without the usual
    ``if __name__ == "__main__"`` guard) runs once, not once more per worker."""
    import os
    import subprocess
    import sys

    src = tmp_path / "c.txt"
    src.write_bytes(awkward_text(60))
    script, marks = tmp_path / "script.py", tmp_path / "marks"
    script.write_text(
        "import os, sys\n"
        "open(sys.argv[1], 'a').write(f'{os.getpid()}\\n')\n"
        "from foundryx.data.convert import convert_to_mds\n"
        "from foundryx.data.tokenizers import build_hf_tokenizer\n"
        "m = convert_to_mds(sys.argv[2], sys.argv[3], build_hf_tokenizer(sys.argv[4]), 24, "
        "workers=2, batch_chars=500, progress=False)\n"
        "print(m['sequences'])\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.run([sys.executable, str(script), str(marks), str(src), str(tmp_path / "out"),
                        tiny_tokenizer.name_or_path], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert len(marks.read_text().splitlines()) == 1
    assert int(p.stdout.split()[-1]) > 0
