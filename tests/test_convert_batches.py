"""The conversion's batch and chunk ends (issue 55): computed per list of documents by
bisection, they must be those of the rule "a batch ends with the first document that brings it
to ``batch_chars``, a chunk with the first batch that brings it to ``chunk_chars``" applied one
document at a time, however the documents come in lists; and the readers' lists must hold the
documents their ``documents()`` gives."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from foundryx.data import partitions, sources
from foundryx.data.convert import _batches
from foundryx.data.sources import Source, slice_lists
from foundryx.errors import DataError


def per_document(docs, batch_chars, chunk_chars, by_doc):
    """The rule, one document at a time: ``[((chunk, docs, units), docs)]``."""
    out, chunk, in_chunk, size, units, batch = [], 0, 0, 0, 0, []
    for doc in docs:
        batch.append(doc)
        size += len(doc)
        units += 1 if by_doc else len(doc.encode("utf-8"))
        if size >= batch_chars:
            out.append(((chunk, len(batch), units), batch))
            in_chunk += size
            if in_chunk >= chunk_chars:
                chunk, in_chunk = chunk + 1, 0
            batch, size, units = [], 0, 0
    if batch:
        out.append(((chunk, len(batch), units), batch))
    return out


def in_lists(docs, rng, empty=True):
    """``docs`` cut into lists of random lengths (some empty when ``empty``)."""
    lists, i = [], 0
    while i < len(docs):
        n = int(rng.integers(0 if empty else 1, 12))
        lists.append(docs[i:i + n])
        i += n
    return lists


def source_of(lists, unit="B"):
    docs = [d for block in lists for d in block]
    return Source("hand-built", "txt", lambda: iter(docs), None, unit,
                  blocks=lambda: iter([list(b) for b in lists]))


def random_docs(rng, n):
    words = ["a", "bb", "ccc " * 9, "é", "漢字", "✓ ok", "x" * 40, "\n"]
    return ["".join(rng.choice(words, size=int(rng.integers(1, 6)))) for _ in range(n)]


@pytest.mark.parametrize("unit", ["B", "docs"])
@pytest.mark.parametrize("batch_chars,chunk_chars", [(1, 1), (7, 20), (25, 60), (60, 150),
                                                      (400, 400), (10**6, 10**6)])
def test_batches_and_chunks_end_where_the_per_document_rule_ends_them(unit, batch_chars,
                                                                      chunk_chars):
    rng = np.random.default_rng(batch_chars * 7 + chunk_chars)
    for trial in range(20):
        docs = random_docs(rng, int(rng.integers(0, 120)))
        if trial % 4 == 1:  # documents longer than a batch, alone and among short ones
            docs[::5] = ["y" * (batch_chars * 3 + 1)] * len(docs[::5])
        want = per_document(docs, batch_chars, chunk_chars, unit == "docs")
        got = list(_batches(source_of(in_lists(docs, rng), unit), batch_chars, chunk_chars))
        assert got == want
        if docs:  # one list of all, one list a document: the same
            for lists in ([docs], [[d] for d in docs]):
                assert list(_batches(source_of(lists, unit), batch_chars, chunk_chars)) == want


def test_progress_units_count_utf8_bytes_of_non_ascii_text():
    docs = ["abc", "é" * 5, "漢字", "✓", "plain"]
    (tag, batch), = _batches(source_of([docs[:2], docs[2:]]), 100, 100)
    assert tag == (0, 5, 3 + 10 + 6 + 3 + 5) and batch == docs
    ((_, _, ascii_units), _), = _batches(source_of([["abc", "de"]]), 100, 100)
    assert ascii_units == 5


def test_a_source_without_lists_is_read_in_groups(monkeypatch):
    monkeypatch.setattr(sources, "GROUP", 3)
    docs = random_docs(np.random.default_rng(1), 50)
    plain = Source("plain", "jsonl", lambda: iter(docs), None, "B")
    assert [len(b) for b in plain.document_lists()] == [3] * 16 + [2]
    assert list(_batches(plain, 30, 70)) == per_document(docs, 30, 70, False)


def test_slice_lists_is_islice_over_the_documents():
    rng = np.random.default_rng(3)
    docs = [str(i) for i in range(40)]
    lists = in_lists(docs, rng)
    for start, stop in itertools.product(range(0, 42, 3), range(0, 43, 4)):
        got = list(slice_lists(iter(lists), start, stop))
        assert [d for b in got for d in b] == docs[start:stop]
        assert all(got)  # no empty lists


def test_a_partition_lists_the_documents_of_its_share(tmp_path):
    src = tmp_path / "c.txt"
    src.write_text("".join(f"doc {i}\nline\n\n" for i in range(101)))
    whole = list(sources.read_documents(src))
    for i in range(3):
        part = partitions.share(sources.open_source(src), i, 3)
        start, stop = partitions.bounds(101, i, 3)
        assert list(part.documents()) == whole[start:stop]
        assert [d for b in part.document_lists() for d in b] == whole[start:stop]


@pytest.mark.parametrize("read_bytes", [5, 64, 1 << 22])
def test_not_utf8_names_the_line_in_any_read(tmp_path, monkeypatch, read_bytes):
    monkeypatch.setattr(sources, "_READ_BYTES", read_bytes)
    lines = [f"line {i} é" for i in range(200)]
    good = "\n".join(lines).encode()
    cut = good.index(b"line 150")
    src = tmp_path / "c.txt"
    src.write_bytes(good[:cut] + b"\xff" + good[cut:])
    with pytest.raises(DataError, match=rf"not UTF-8 at byte {cut} \(line 151: invalid start"):
        list(sources.read_documents(src))


@pytest.mark.parametrize("prefix,suffix", [([], [0]), ([7], [0]), ([7], []), ([], []),
                                           ([5, 6], [1, 2])])
def test_a_batch_stream_is_prefix_ids_suffix_per_document(tiny_tokenizer, prefix, suffix):
    from foundryx.data import parallel

    docs = ["hello world", "é ✓ 漢字", "x", "two\nlines"]
    want = []
    for doc in docs:
        want += prefix + tiny_tokenizer(doc, add_special_tokens=False)["input_ids"] + suffix
    for tok in (parallel.encoder(tiny_tokenizer), tiny_tokenizer):  # Rust backend, HF call
        parallel._init(tok, prefix, suffix)
        got = parallel.tokenize_batch(docs)
        assert got.dtype == np.int32 and got.tolist() == want


def test_in_process_tokenizing_leaves_the_callers_objects_collectable(tiny_tokenizer):
    """workers=1 tokenizes with the objects alive before it frozen out of the cyclic GC (the
    command's imports: full collections walked them all), and unfrozen after: nothing of the
    caller's stays out of garbage collection; a caller that froze objects itself keeps them so."""
    import gc

    from foundryx.data.parallel import tokenize_in_order

    batches = [((i,), ["a b c", "d e"]) for i in range(3)]
    during = [gc.get_freeze_count() for _ in tokenize_in_order(batches, tiny_tokenizer, [], [0])]
    assert len(during) == 3 and all(n > 0 for n in during)
    assert gc.get_freeze_count() == 0
    gc.freeze()
    try:
        list(tokenize_in_order(batches, tiny_tokenizer, [], [0]))
        assert gc.get_freeze_count() > 0  # not unfrozen: left as the caller arranged it
    finally:
        gc.unfreeze()


def test_workers_get_a_rust_tokenizer_as_a_file_and_give_the_same_ids(tiny_tokenizer):
    """The pool's start arguments go down a pipe written before the next worker starts: a
    tokenizer's JSON larger than the pipe made each write wait for its worker's Python (the
    workers started one after another). A Rust tokenizer goes as the path of its JSON (gone
    after), which the worker loads into the same ids; anything else as it is."""
    from foundryx.data import parallel

    rust = parallel.encoder(tiny_tokenizer)
    with parallel._shipped(rust) as shipped:
        assert shipped.is_file() and len(rust.to_str()) > 0
        loaded = parallel._loaded(shipped)
        parallel._init(loaded, [7], [0])
        docs = ["hello world", "é ✓ 漢字"]
        assert parallel.tokenize_batch(docs).tolist() == [
            t for d in docs for t in [7, *rust.encode(d, add_special_tokens=False).ids, 0]]
        assert loaded is not rust and loaded.to_str() == rust.to_str()
    assert not shipped.exists()
    with parallel._shipped(tiny_tokenizer) as same:  # not a Rust tokenizer: as it is
        assert same is tiny_tokenizer and parallel._loaded(same) is tiny_tokenizer
    # two workers' conversion: the same streams as in this process, in order
    batches = [((i,), ["a b c " * (i + 1), "d e"]) for i in range(5)]
    one = [t.tolist() for _, t in parallel.tokenize_in_order(batches, tiny_tokenizer, [], [0])]
    two = [t.tolist() for _, t in parallel.tokenize_in_order(batches, tiny_tokenizer, [], [0],
                                                            workers=2)]
    assert one == two and len(one) == 5
