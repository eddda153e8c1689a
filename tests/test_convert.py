"""Text → MDS conversion: round trips, the separator rule, atomic writes and input errors."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from foundryx.data import chunk_writer, convert
from foundryx.data.convert import MANIFEST, convert_to_mds, vocab_hash
from foundryx.data.synthetic import generate_corpus
from foundryx.errors import DataError

SEQ = 32


def write_txt(path, docs):
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path


def stored(folder) -> np.ndarray:
    """The sequences of an MDS folder (compressed shards are decompressed beside them)."""
    from streaming import LocalDataset
    from streaming.base.compression import decompress

    for shard in json.loads((folder / "index.json").read_text())["shards"]:
        if shard["compression"]:
            packed = (folder / shard["zip_data"]["basename"]).read_bytes()
            raw = decompress(shard["compression"], packed)
            (folder / shard["raw_data"]["basename"]).write_bytes(raw)
    ds = LocalDataset(str(folder))
    return np.stack([ds[i]["tokens"] for i in range(len(ds))])


def expected(tokenizer, docs, prefix=(), seq=SEQ) -> np.ndarray:
    ids: list[int] = []
    for doc in docs:
        ids += [*prefix, *tokenizer(doc, add_special_tokens=False)["input_ids"],
                tokenizer.eos_token_id]
    n = len(ids) // seq * seq
    return np.asarray(ids[:n], dtype=np.int32).reshape(-1, seq)


@pytest.fixture
def docs():
    return generate_corpus(40, seed=3)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_txt_round_trip(tmp_path, tiny_tokenizer, docs, compression):
    src = write_txt(tmp_path / "corpus.txt", docs)
    manifest = convert_to_mds(src, tmp_path / "mds", tiny_tokenizer, SEQ,
                              compression=compression, progress=False)
    want = expected(tiny_tokenizer, docs)
    np.testing.assert_array_equal(stored(tmp_path / "mds"), want)
    assert manifest == json.loads((tmp_path / "mds" / MANIFEST).read_text())
    assert manifest["documents"] == len(docs)
    assert manifest["sequences"] == len(want)
    assert manifest["tokens"] == want.size
    assert manifest["max_seq_len"] == SEQ
    assert manifest["tokenizer"]["vocab_sha256"] == vocab_hash(tiny_tokenizer)
    assert manifest["tokenizer"]["vocab_size"] == len(tiny_tokenizer)


def test_multiline_txt_documents_split_at_blank_lines(tmp_path, tiny_tokenizer):
    src = tmp_path / "c.txt"
    src.write_text("line one\nline two\n\n\n  \nsecond doc\n")
    assert list(convert.read_documents(src)) == ["line one\nline two", "second doc"]


def test_folder_and_jsonl_inputs(tmp_path, tiny_tokenizer, docs):
    folder = tmp_path / "docs"
    (folder / "sub").mkdir(parents=True)
    for i, doc in enumerate(docs):
        (folder / ("sub" if i % 2 else "") / f"{i:03d}.txt").write_text(doc + "\n")
    by_path = sorted(folder.rglob("*.txt"))
    convert_to_mds(folder, tmp_path / "from_folder", tiny_tokenizer, SEQ, progress=False)
    np.testing.assert_array_equal(
        stored(tmp_path / "from_folder"),
        expected(tiny_tokenizer, [p.read_text().strip() for p in by_path]),
    )

    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_text("".join(json.dumps({"body": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    convert_to_mds(jsonl, tmp_path / "from_jsonl", tiny_tokenizer, SEQ, text_field="body",
                   progress=False)
    np.testing.assert_array_equal(stored(tmp_path / "from_jsonl"), expected(tiny_tokenizer, docs))


def test_distinct_bos_is_prepended(tmp_path, tiny_tokenizer, docs):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.add_special_tokens({"bos_token": "<s>"})
    assert tok.bos_token_id != tok.eos_token_id
    src = write_txt(tmp_path / "c.txt", docs)
    convert_to_mds(src, tmp_path / "mds", tok, SEQ, progress=False)
    np.testing.assert_array_equal(
        stored(tmp_path / "mds"), expected(tok, docs, prefix=[tok.bos_token_id])
    )


def test_tokenizer_without_bos_or_eos_is_refused(tmp_path, tiny_tokenizer, docs):
    tok = copy.deepcopy(tiny_tokenizer)
    tok.bos_token = tok.eos_token = None
    with pytest.raises(DataError, match="neither a bos nor an eos"):
        convert_to_mds(write_txt(tmp_path / "c.txt", docs), tmp_path / "mds", tok, SEQ,
                       progress=False)
    assert not (tmp_path / "mds").exists()


def test_existing_dataset_needs_overwrite(tmp_path, tiny_tokenizer, docs):
    src = write_txt(tmp_path / "c.txt", docs)
    out = tmp_path / "mds"
    convert_to_mds(src, out, tiny_tokenizer, SEQ, progress=False)
    with pytest.raises(DataError, match="already holds a dataset.*overwrite"):
        convert_to_mds(src, out, tiny_tokenizer, 16, progress=False)
    assert json.loads((out / MANIFEST).read_text())["max_seq_len"] == SEQ
    convert_to_mds(src, out, tiny_tokenizer, 16, overwrite=True, progress=False)
    assert json.loads((out / MANIFEST).read_text())["max_seq_len"] == 16
    assert stored(out).shape[1] == 16
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c.txt", "mds"]


def test_folder_with_other_files_is_never_replaced(tmp_path, tiny_tokenizer, docs):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.md").write_text("mine")
    with pytest.raises(DataError, match="not a dataset"):
        convert_to_mds(write_txt(tmp_path / "c.txt", docs), out, tiny_tokenizer, SEQ,
                       overwrite=True, progress=False)
    assert (out / "notes.md").read_text() == "mine"


@pytest.mark.parametrize("existing", [False, True])
def test_interrupted_conversion_leaves_no_trusted_output(tmp_path, tiny_tokenizer, docs,
                                                         monkeypatch, existing):
    src = write_txt(tmp_path / "c.txt", docs)
    out = tmp_path / "mds"
    if existing:
        convert_to_mds(src, out, tiny_tokenizer, SEQ, progress=False)
    before = stored(out) if existing else None
    original = chunk_writer.write_rows

    def write_then_fail(writer, rows):  # interrupted after two sequences are written
        original(writer, rows[:2])
        raise KeyboardInterrupt

    monkeypatch.setattr(chunk_writer, "write_rows", write_then_fail)
    with pytest.raises(KeyboardInterrupt):
        convert_to_mds(src, out, tiny_tokenizer, 8, overwrite=True, progress=False)
    left = sorted(p.name for p in tmp_path.iterdir())
    # only the hidden work folder is added (kept for resuming); it is no dataset
    assert left == [".mds.partial", "c.txt"] + (["mds"] if existing else [])
    assert not convert.is_dataset(tmp_path / ".mds.partial")
    if existing:
        np.testing.assert_array_equal(stored(out), before)


def test_missing_input(tmp_path, tiny_tokenizer):
    missing = tmp_path / "nope.txt"
    with pytest.raises(DataError, match=f"{missing} does not exist"):
        convert_to_mds(missing, tmp_path / "mds", tiny_tokenizer, SEQ, progress=False)


@pytest.mark.parametrize("kind", ["blank_txt", "empty_folder", "blank_jsonl"])
def test_empty_corpus(tmp_path, tiny_tokenizer, kind):
    if kind == "blank_txt":
        src = tmp_path / "blank.txt"
        src.write_text("\n \n\n")
    elif kind == "empty_folder":
        src = tmp_path / "empty"
        src.mkdir()
    else:
        src = tmp_path / "blank.jsonl"
        src.write_text('{"text": "  "}\n\n')
    with pytest.raises(DataError, match=str(src)):
        convert_to_mds(src, tmp_path / "mds", tiny_tokenizer, SEQ, progress=False)
    assert not (tmp_path / "mds").exists()


def test_too_short_for_one_sequence(tmp_path, tiny_tokenizer):
    src = write_txt(tmp_path / "short.txt", ["A tiny doc."])
    with pytest.raises(DataError, match="fewer than one sequence"):
        convert_to_mds(src, tmp_path / "mds", tiny_tokenizer, 512, progress=False)


def test_jsonl_errors_name_file_and_line(tmp_path, tiny_tokenizer):
    src = tmp_path / "bad.jsonl"
    src.write_text('{"text": "fine"}\n\n{"body": "no text field"}\n')
    with pytest.raises(DataError, match=rf"{src}:3: no field 'text' \(found: 'body'\)"):
        convert_to_mds(src, tmp_path / "mds", tiny_tokenizer, SEQ, progress=False)
    src.write_text('{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=rf"{src}:2: not valid JSON"):
        convert_to_mds(src, tmp_path / "mds", tiny_tokenizer, SEQ, progress=False)
    src.write_text('{"text": 7}\n')
    with pytest.raises(DataError, match=rf"{src}:1: field 'text' is a int"):
        convert_to_mds(src, tmp_path / "mds", tiny_tokenizer, SEQ, progress=False)
    assert not (tmp_path / "mds").exists()


def test_unsupported_input_type(tmp_path, tiny_tokenizer):
    src = tmp_path / "data.csv"
    src.write_text("a,b\n")
    with pytest.raises(DataError, match="unsupported file type '.csv'"):
        convert_to_mds(src, tmp_path / "mds", tiny_tokenizer, SEQ, progress=False)
