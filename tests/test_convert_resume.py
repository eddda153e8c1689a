"""Resuming an interrupted conversion: no duplicated or lost data, restarts when inputs change."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from test_convert import SEQ, expected, stored, write_txt

from foundryx.data import chunk_writer, parallel
from foundryx.data.convert import convert_to_mds
from foundryx.data.partial import LEDGER, Partial
from foundryx.data.synthetic import generate_corpus
from foundryx.errors import DataError

SMALL = {"batch_chars": 1500, "chunk_chars": 6000, "progress": False, "workers": 1}


@pytest.fixture
def corpus(tmp_path):
    docs = generate_corpus(300, seed=11)
    return write_txt(tmp_path / "c.txt", docs), docs


def count_tokenized(monkeypatch) -> list[int]:
    """Record the number of documents of each batch tokenized in this process."""
    seen: list[int] = []
    original = parallel.tokenize_batch

    def counting(docs):
        seen.append(len(docs))
        return original(docs)

    monkeypatch.setattr(parallel, "tokenize_batch", counting)
    return seen


def interrupted(src, out, tokenizer, monkeypatch, n_writes: int = 250) -> None:
    """A conversion stopped by Ctrl-C at its ``n_writes``-th sequence."""
    calls = []
    original = chunk_writer.write_rows

    def write_rows(writer, rows):  # one sequence at a time, to stop at the n-th
        for i in range(len(rows)):
            calls.append(1)
            if len(calls) == n_writes:
                raise KeyboardInterrupt
            original(writer, rows[i:i + 1])

    monkeypatch.setattr(chunk_writer, "write_rows", write_rows)
    with pytest.raises(KeyboardInterrupt):
        convert_to_mds(src, out, tokenizer, SEQ, **SMALL)
    monkeypatch.undo()


def test_resume_skips_finished_chunks_and_matches_a_straight_run(tmp_path, tiny_tokenizer,
                                                                  corpus, monkeypatch, caplog):
    src, docs = corpus
    out = tmp_path / "mds"
    interrupted(src, out, tiny_tokenizer, monkeypatch)
    ledger = (out.with_name(".mds.partial") / LEDGER).read_text().splitlines()
    finished = [json.loads(line) for line in ledger[1:]]
    assert len(finished) >= 2 and not out.exists()

    seen = count_tokenized(monkeypatch)
    with caplog.at_level("INFO", logger="foundryx.data.partial"):
        manifest = convert_to_mds(src, out, tiny_tokenizer, SEQ, **SMALL)
    assert f"{len(finished)} chunks" in caplog.text and "resuming" in caplog.text
    # the second run tokenized exactly the documents of the unfinished chunks
    assert sum(seen) == len(docs) - sum(c["docs"] for c in finished)
    np.testing.assert_array_equal(stored(out), expected(tiny_tokenizer, docs))
    assert manifest["documents"] == len(docs)
    straight = convert_to_mds(src, tmp_path / "straight", tiny_tokenizer, SEQ, **SMALL)
    assert manifest == straight
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt", "mds", "straight"]


@pytest.mark.parametrize("change", ["input", "max_seq_len", "no_resume"])
def test_changed_conversion_starts_over(tmp_path, tiny_tokenizer, corpus, monkeypatch, change):
    src, docs = corpus
    out = tmp_path / "mds"
    interrupted(src, out, tiny_tokenizer, monkeypatch)
    seq, resume = SEQ, True
    if change == "input":
        docs = docs[:-1]
        write_txt(src, docs)
    elif change == "max_seq_len":
        seq = 16
    else:
        resume = False
    seen = count_tokenized(monkeypatch)
    convert_to_mds(src, out, tiny_tokenizer, seq, resume=resume, **SMALL)
    assert sum(seen) == len(docs)
    np.testing.assert_array_equal(stored(out), expected(tiny_tokenizer, docs, seq=seq))


def test_two_conversions_to_one_folder_are_refused(tmp_path, tiny_tokenizer, corpus):
    src, _ = corpus
    out = tmp_path / "mds"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from pathlib import Path; "
         "from foundryx.data.partial import Partial; p = Partial(Path(sys.argv[1])).__enter__(); "
         "print('locked', flush=True); time.sleep(60)", str(out)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "locked"
        with pytest.raises(DataError, match="another conversion is writing to"):
            convert_to_mds(src, out, tiny_tokenizer, SEQ, **SMALL)
    finally:
        holder.kill()
        holder.wait()
    assert not out.exists()
    with Partial(out):  # free again once the holder is gone, even killed
        pass


def test_bad_input_leaves_nothing_to_resume(tmp_path, tiny_tokenizer):
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in generate_corpus(80, seed=1))
                   + '{"txt": "typo"}\n')
    with pytest.raises(DataError, match=r"c.jsonl:81: no field 'text'"):
        convert_to_mds(src, tmp_path / "mds", tiny_tokenizer, SEQ, **SMALL)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]


KILL_SCRIPT = """
import sys
from transformers import AutoTokenizer
from foundryx.data.convert import convert_to_mds
convert_to_mds(sys.argv[1], sys.argv[2], AutoTokenizer.from_pretrained(sys.argv[3]), 32,
               workers=2, batch_chars=3000, chunk_chars=20000, progress=False)
"""


@pytest.mark.slow
def test_resume_after_kill_9(tmp_path, tiny_tokenizer):
    docs = generate_corpus(6000, seed=2)
    src = write_txt(tmp_path / "c.txt", docs)
    out = tmp_path / "mds"
    ledger = tmp_path / ".mds.partial" / LEDGER
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT, str(src), str(out),
                             tiny_tokenizer.name_or_path])
    deadline = time.time() + 120
    while time.time() < deadline and proc.poll() is None:
        if ledger.is_file() and len(ledger.read_text().splitlines()) >= 4:
            break
        time.sleep(0.05)
    assert proc.poll() is None, "the conversion finished before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)  # its workers exit with it
    proc.wait()
    assert not out.exists()
    manifest = convert_to_mds(src, out, tiny_tokenizer, SEQ, workers=2, batch_chars=3000,
                              chunk_chars=20000, progress=False)
    np.testing.assert_array_equal(stored(out), expected(tiny_tokenizer, docs))
    assert manifest["documents"] == len(docs)


@pytest.mark.timeout(120)
def test_bad_input_with_workers_ends_promptly(tmp_path, tiny_tokenizer):
    """A bad document found while workers run stops the conversion at once, leaving nothing,
    even when the parent handles SIGTERM (as some libraries make it do)."""
    previous = signal.signal(signal.SIGTERM, lambda *_: None)
    try:
        src = tmp_path / "c.jsonl"
        src.write_text("".join(json.dumps({"text": d}) + "\n" for d in generate_corpus(200, 3))
                       + '{"txt": "typo"}\n')
        with pytest.raises(DataError, match=r"c.jsonl:201: no field 'text'"):
            convert_to_mds(src, tmp_path / "mds", tiny_tokenizer, SEQ, workers=2,
                           batch_chars=500, chunk_chars=4000, progress=False)
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.jsonl"]
