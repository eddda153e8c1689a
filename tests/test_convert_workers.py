"""How a conversion's worker processes get their work (foundryx.data.parallel): batches cut
into slices for the tokenizer, the last batches in pieces so the workers finish together,
forked workers where no other thread runs, and the same token streams every way."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from foundryx.data import parallel


def _stream(tok, docs, prefix=(), suffix=(0,)):
    return [t for d in docs for t in [*prefix, *tok(d, add_special_tokens=False)["input_ids"],
                                      *suffix]]


@pytest.mark.parametrize("lengths,n,want", [
    ([1, 1, 1, 1, 10, 1, 1, 1], 2, [(0, 5), (5, 8)]),  # 8.5 of 17 passed inside the long one
    ([1, 1, 1, 1, 10, 1, 1, 1], 4, [(0, 5), (5, 8)]),  # 4.25, 8.5, 12.75: all in the same one
    ([2, 2, 2, 2], 4, [(0, 1), (1, 2), (2, 3), (3, 4)]),
    ([2, 2, 2, 2], 1, [(0, 4)]),
    ([1, 1], 5, [(0, 1), (1, 2)]),  # no more pieces than documents
    ([0, 0, 0], 2, [(0, 3)]),  # no text: one piece
])
def test_pieces_cut_where_the_running_characters_pass_each_share(lengths, n, want):
    docs = ["x" * k for k in lengths]
    got = parallel.pieces(docs, n)
    assert got == want
    assert got[0][0] == 0 and got[-1][1] == len(docs)
    assert all(a < b for a, b in got) and all(b == c for (_, b), (c, _) in zip(got, got[1:]))


class _Counting:
    """A Rust tokenizer that counts its batch calls."""

    def __init__(self, tok):
        self.tok, self.calls = tok, []

    def encode_batch_fast(self, docs, add_special_tokens):
        self.calls.append(len(docs))
        return self.tok.encode_batch_fast(docs, add_special_tokens=add_special_tokens)

    encode_batch = encode_batch_fast


def test_a_batch_goes_to_the_tokenizer_in_slices_and_gives_the_same_stream(tiny_tokenizer,
                                                                         monkeypatch):
    docs = [f"document {i} " + "word " * (i % 7) for i in range(40)] + ["é ✓ 漢字", "x"]
    counting = _Counting(parallel.encoder(tiny_tokenizer))
    parallel._init(counting, [7], [0])
    monkeypatch.setattr(parallel, "SLICE_CHARS", 100)
    got = parallel.tokenize_batch(docs)
    chars = sum(map(len, docs))
    assert len(counting.calls) == round(chars / 100) and sum(counting.calls) == len(docs)
    assert got.dtype == np.int32 and got.tolist() == _stream(tiny_tokenizer, docs, [7], [0])
    monkeypatch.setattr(parallel, "SLICE_CHARS", 10 * chars)  # a small batch: one call
    counting.calls.clear()
    assert parallel.tokenize_batch(docs).tolist() == got.tolist() and counting.calls == [42]


class _Pool:
    """A pool that runs each task when its result is asked for, recording what it was sent."""

    def __init__(self):
        self.sent, self.pending, self.most_pending, self.ended = [], set(), 0, []

    def apply_async(self, fn, args):
        self.sent.append(len(args[0]))
        pool, key = self, len(self.sent)
        self.pending.add(key)
        self.most_pending = max(self.most_pending, len(self.pending))

        class Result:
            def get(self):
                pool.pending.discard(key)
                return fn(*args)

        return Result()

    def close(self):
        self.ended.append("close")

    def terminate(self):
        self.ended.append("terminate")

    def join(self):
        self.ended.append("join")


def test_the_last_batches_go_in_pieces_and_come_back_whole_in_order(tiny_tokenizer):
    """With 2 workers the last 2 batches go out in 4 pieces each (the worker with the last
    batch ran on alone for up to a batch's time); each batch's stream comes back whole, in
    input order, with at most 2 x 2 batches in flight."""
    parallel._init(parallel.encoder(tiny_tokenizer), [], [0])
    batches = [((i,), [f"batch {i} doc {j}" for j in range(8)]) for i in range(5)]
    pool = _Pool()
    out = list(parallel._in_order(pool, iter(batches), 2))
    assert pool.sent == [8, 8, 8] + [2, 2, 2, 2] * 2
    assert [tag for tag, _ in out] == [tag for tag, _ in batches]
    for (_, stream), (_, docs) in zip(out, batches):
        assert stream.tolist() == _stream(tiny_tokenizer, docs)
    assert pool.most_pending <= 2 + 2 * 4  # 4 batches: 2 whole, the last 2 in 4 pieces each
    assert pool.ended == ["close", "join"]  # done: no terminate (it can hang after close)
    pool = _Pool()
    stream = parallel._in_order(pool, iter(batches), 2)
    next(stream)
    stream.close()  # the consumer stops early: the workers are stopped
    assert pool.ended == ["terminate", "join"]


def test_the_same_streams_from_spawned_workers(tiny_tokenizer, monkeypatch):
    monkeypatch.setattr(parallel, "start_method", lambda: "spawn")
    batches = [((i,), ["a b c " * (i + 1), "d e", "é ✓"]) for i in range(5)]
    one = [t.tolist() for _, t in parallel.tokenize_in_order(batches, tiny_tokenizer, [], [0])]
    two = [t.tolist() for _, t in parallel.tokenize_in_order(batches, tiny_tokenizer, [], [0],
                                                            workers=2)]
    assert one == two and len(one) == 5


def test_the_backend_is_used_as_it_is_unless_it_truncates_or_pads(tiny_tokenizer):
    from foundryx.data.tokenizers import build_hf_tokenizer

    tok = build_hf_tokenizer(tiny_tokenizer.name_or_path)  # its own: this one is changed
    backend = tok.backend_tokenizer
    assert backend.truncation is None and backend.padding is None
    assert parallel.encoder(tok) is backend  # no copy (a parse of the tokenizer's JSON)
    backend.enable_truncation(3)
    backend.enable_padding(length=9)
    copy = parallel.encoder(tok)
    assert copy is not backend and copy.truncation is None and copy.padding is None
    assert backend.truncation["max_length"] == 3  # the caller's tokenizer as it was


SCRIPT = textwrap.dedent("""
    import logging, sys, threading
    logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="%(message)s")
    from foundryx.data import parallel
    from foundryx.data.convert import convert_to_mds
    from foundryx.data.json_tokenizer import open_json_tokenizer
    src, out, tok = sys.argv[1:4]
    print("method", parallel.start_method())
    for workers in (1, 2):
        convert_to_mds(src, f"{out}{workers}", open_json_tokenizer(tok), 16, workers=workers,
                       batch_chars=300, progress=sys.argv[4] == "bar")
    print("threads", threading.active_count())
    stop = threading.Event()
    t = threading.Thread(target=stop.wait)
    t.start()
    print("with a thread", parallel.start_method())
    stop.set()
    t.join()
    import torch
    print("with torch", parallel.start_method())
""")


@pytest.mark.skipif(sys.platform != "linux", reason="workers fork on Linux only")
@pytest.mark.parametrize("bar", ["bar", "no bar"])
def test_a_conversion_in_a_plain_process_forks_its_workers_with_the_same_shards(tmp_path,
                                                                               tiny_tokenizer,
                                                                               bar):
    """A conversion in a process of one thread (the command's) forks its workers, with its
    progress bar shown or not (tqdm's monitor thread is not started); the shards are those of
    one worker. A process with another thread, or with torch imported, spawns them."""
    from test_convert_identity import awkward_text

    src = tmp_path / "c.txt"
    src.write_bytes(awkward_text(80))
    script = tmp_path / "convert.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    p = subprocess.run([sys.executable, str(script), str(src), str(tmp_path / "out"),
                        tiny_tokenizer.name_or_path, bar], capture_output=True, text=True,
                       env=env, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = p.stdout.splitlines()
    assert "method fork" in lines and "tokenizing in 2 fork worker processes" in lines
    assert "threads 1" in lines
    assert "with a thread spawn" in lines and "with torch spawn" in lines
    files = [{f.relative_to(d): f.read_bytes() for f in sorted(d.rglob("*")) if f.is_file()}
             for d in (tmp_path / "out1", tmp_path / "out2")]
    assert files[0] == files[1] and any(f.suffix == ".mds" for f in files[0])


KILLED = textwrap.dedent("""
    import logging, os, signal, sys
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from foundryx.data import parallel
    from foundryx.data.convert import convert_to_mds
    from foundryx.data.json_tokenizer import open_json_tokenizer
    from foundryx.errors import RunError
    src, out, tok = sys.argv[1:4]
    small = dict(batch_chars=300, chunk_chars=1200, progress=False)
    original = parallel.tokenize_batch

    def deadly(docs):  # a worker killed as the OOM killer would, at one document
        if "boom" in docs:
            os.kill(os.getpid(), signal.SIGKILL)
        return original(docs)

    parallel.tokenize_batch = deadly
    try:
        convert_to_mds(src, out, open_json_tokenizer(tok), 16, workers=2, **small)
    except RunError as e:
        print("stopped:", e)
    parallel.tokenize_batch = original
    print("method", parallel.start_method())
    convert_to_mds(src, out, open_json_tokenizer(tok), 16, workers=2, **small)  # resumes
    convert_to_mds(src, out + "-clean", open_json_tokenizer(tok), 16, workers=1, **small)
""")


@pytest.mark.skipif(sys.platform != "linux", reason="workers fork on Linux only")
def test_a_killed_worker_stops_the_conversion_and_the_same_command_resumes(tmp_path,
                                                                          tiny_tokenizer):
    """A forked worker killed mid-conversion (the OOM killer) stops it with one message naming
    the worker, instead of the wait for ever of multiprocessing.Pool; the finished chunks stay
    and the same conversion resumes from them to the shards of an uninterrupted one."""
    from foundryx.data.synthetic import generate_corpus

    docs = generate_corpus(200, seed=5)
    docs[150] = "boom"
    src = tmp_path / "c.txt"
    src.write_text("\n\n".join(docs) + "\n")
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, str(script), str(src), str(out),
                        tiny_tokenizer.name_or_path], capture_output=True, text=True, env=env,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "method fork" in p.stdout
    assert "stopped: a worker process (pid " in p.stdout
    assert "was killed by signal SIGKILL" in p.stdout
    assert "its finished chunks stay in" in p.stderr  # the conversion's own warning
    assert re.search(r"resuming the conversion to \S+: [1-9]\d* chunks", p.stderr)
    files = [{f.relative_to(d): f.read_bytes() for f in sorted(d.rglob("*")) if f.is_file()}
             for d in (out, tmp_path / "out-clean")]
    assert files[0] == files[1]


class _Deadly:
    """A tokenizer (not a fast one: it reaches the workers as it is) whose worker is killed,
    as by the out-of-memory killer, at the document "boom"."""

    def __init__(self, backend):
        self.backend = backend

    def __call__(self, docs, **kw):
        if "boom" in docs:
            os.kill(os.getpid(), signal.SIGKILL)
        return {"input_ids": [e.ids for e in self.backend.encode_batch(docs,
                                                                       add_special_tokens=False)]}


@pytest.mark.timeout(180)
@pytest.mark.skipif(sys.platform == "win32", reason="SIGKILL")
def test_a_killed_spawned_worker_is_reported_not_waited_on(tiny_tokenizer, monkeypatch):
    """multiprocessing.Pool (the spawned workers') replaces a worker killed mid-task and waits
    for its result for ever; the conversion's wait raises a RunError naming it instead."""
    from foundryx.errors import RunError

    monkeypatch.setattr(parallel, "start_method", lambda: "spawn")
    monkeypatch.setattr(parallel, "WATCH_S", 0.2)
    batches = [((i,), ["a b c", "d e"]) for i in range(6)]
    batches[2] = ((2,), ["x y", "boom"])
    deadly = _Deadly(parallel.encoder(tiny_tokenizer))
    with pytest.raises(RunError,
                       match=r"a worker process \(pid \d+\) was killed by signal SIGKILL"):
        list(parallel.tokenize_in_order(batches, deadly, [], [0], workers=2))
