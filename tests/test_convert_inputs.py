"""Conversion inputs beyond text files: parquet, Hugging Face datasets, workers, the CLI."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest
from test_convert import SEQ, expected, stored, write_txt

from foundryx.cli import main
from foundryx.data.convert import MANIFEST, convert_to_mds
from foundryx.data.synthetic import generate_corpus
from foundryx.errors import DataError


@pytest.fixture
def docs():
    return generate_corpus(60, seed=5)


def test_parquet_file_and_folder(tmp_path, tiny_tokenizer, docs):
    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = tmp_path / "pq"
    folder.mkdir()
    pq.write_table(pa.table({"body": docs[:25], "n": list(range(25))}), folder / "a.parquet")
    pq.write_table(pa.table({"body": docs[25:], "n": list(range(35))}), folder / "b.parquet")
    convert_to_mds(folder / "a.parquet", tmp_path / "one", tiny_tokenizer, SEQ,
                   text_field="body", progress=False)
    np.testing.assert_array_equal(stored(tmp_path / "one"), expected(tiny_tokenizer, docs[:25]))
    manifest = convert_to_mds(folder, tmp_path / "all", tiny_tokenizer, SEQ, text_field="body",
                              progress=False)
    np.testing.assert_array_equal(stored(tmp_path / "all"), expected(tiny_tokenizer, docs))
    assert manifest["documents"] == len(docs)


def test_parquet_errors(tmp_path, tiny_tokenizer, docs):
    import pyarrow as pa
    import pyarrow.parquet as pq

    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"content": docs}), good)
    with pytest.raises(DataError, match=rf"{good}: no column 'text' \(columns: content\)"):
        convert_to_mds(good, tmp_path / "mds", tiny_tokenizer, SEQ, progress=False)
    bad = tmp_path / "bad.parquet"
    bad.write_bytes(good.read_bytes()[:100])  # cut short: no footer
    with pytest.raises(DataError, match=rf"{bad}: unreadable parquet"):
        convert_to_mds(bad, tmp_path / "mds", tiny_tokenizer, SEQ, progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.parquet", "good.parquet"]


def test_hf_save_to_disk_folders(tmp_path, tiny_tokenizer, docs):
    import datasets

    datasets.Dataset.from_dict({"text": docs}).save_to_disk(str(tmp_path / "ds"))
    convert_to_mds(tmp_path / "ds", tmp_path / "from_ds", tiny_tokenizer, SEQ, progress=False)
    np.testing.assert_array_equal(stored(tmp_path / "from_ds"), expected(tiny_tokenizer, docs))

    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": docs[:40]}),
                               "test": datasets.Dataset.from_dict({"text": docs[40:]})})
    dd.save_to_disk(str(tmp_path / "dd"))
    with pytest.raises(DataError, match="holds the splits train, test; choose one with split"):
        convert_to_mds(tmp_path / "dd", tmp_path / "x", tiny_tokenizer, SEQ, progress=False)
    convert_to_mds(tmp_path / "dd", tmp_path / "from_dd", tiny_tokenizer, 16, split="test",
                   progress=False)
    np.testing.assert_array_equal(stored(tmp_path / "from_dd"),
                                  expected(tiny_tokenizer, docs[40:], seq=16))
    with pytest.raises(DataError, match=r"ds: no column 'body' \(columns: text\)"):
        convert_to_mds(tmp_path / "ds", tmp_path / "x", tiny_tokenizer, SEQ, text_field="body",
                       progress=False)


def test_hub_name_offline_fails_fast(tmp_path, tiny_tokenizer, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    start = time.perf_counter()
    with pytest.raises(DataError, match=r"could not load Hugging Face dataset 'nobody/nothing' "
                                        r"\(offline \(HF_HUB_OFFLINE=1\).*save_to_disk"):
        convert_to_mds("hf://nobody/nothing", tmp_path / "mds", tiny_tokenizer, SEQ,
                       progress=False)
    assert time.perf_counter() - start < 20
    assert not any(tmp_path.iterdir())


def test_output_is_identical_for_one_and_two_workers(tmp_path, tiny_tokenizer):
    docs = generate_corpus(400, seed=9)
    src = write_txt(tmp_path / "c.txt", docs)
    small = {"batch_chars": 2000, "chunk_chars": 10_000, "progress": False}
    one = convert_to_mds(src, tmp_path / "w1", tiny_tokenizer, SEQ, workers=1, **small)
    two = convert_to_mds(src, tmp_path / "w2", tiny_tokenizer, SEQ, workers=2, **small)
    assert one == two
    assert len(json.loads((tmp_path / "w1" / "index.json").read_text())["shards"]) > 3
    np.testing.assert_array_equal(stored(tmp_path / "w2"), expected(tiny_tokenizer, docs))
    np.testing.assert_array_equal(stored(tmp_path / "w1"), stored(tmp_path / "w2"))


@pytest.mark.parametrize("bad", ["missing", "empty", "field", "exists"])
def test_cli_bad_input_exit_code_2(tmp_path, tiny_tokenizer, capsys, bad, docs):
    src = tmp_path / "c.jsonl"
    src.write_text("".join(json.dumps({"text": d}) + "\n" for d in docs))
    out = tmp_path / "out"
    if bad == "missing":
        src = tmp_path / "nope.txt"
    elif bad == "empty":
        src.write_text("\n")
    elif bad == "field":
        src.write_text('{"body": "x"}\n')
    else:
        out.mkdir()
        (out / MANIFEST).write_text("{}")
    args = ["data", "convert", "--input", str(src), "--out", str(out), "--tokenizer",
            tiny_tokenizer.name_or_path, "--max-seq-len", str(SEQ), "--no-progress"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.startswith("foundryx: error: ") and "Traceback" not in err
    assert {"missing": "does not exist", "empty": "holds no documents",
            "field": "no field 'text'", "exists": "already holds a dataset"}[bad] in err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["c.jsonl"] + (["out"] if bad == "exists" else []))


def test_cli_converts_with_workers(tmp_path, tiny_tokenizer, docs, capsys):
    src = write_txt(tmp_path / "c.txt", docs)
    args = ["data", "convert", "--input", str(src), "--out", str(tmp_path / "out"),
            "--tokenizer", tiny_tokenizer.name_or_path, "--max-seq-len", str(SEQ),
            "--workers", "2", "--compression", "zstd", "--no-progress"]
    assert main(args) == 0
    assert "sequences of 32 tokens" in capsys.readouterr().out
    np.testing.assert_array_equal(stored(tmp_path / "out"), expected(tiny_tokenizer, docs))


@pytest.mark.parametrize("kind", ["txt", "jsonl", "folder"])
def test_input_that_is_not_utf8_names_the_file_and_byte_and_leaves_nothing(tmp_path, tiny_tokenizer,
                                                                           docs, kind, capsys):
    good = "\n\n".join(docs[:20]).encode()
    bad_bytes = "caf\u00e9".encode("latin-1")  # é as one latin-1 byte: invalid UTF-8
    if kind == "jsonl":
        lines = [json.dumps({"text": d}).encode() for d in docs[:20]]
        data = b"\n".join(lines) + b'\n{"text": "' + bad_bytes + b'"}\n'
        src = tmp_path / "in.jsonl"
        at = len(data) - 4
    else:
        data = good + b"\n\n" + bad_bytes + b"\n"
        at = len(good) + 5
        src = tmp_path / ("in.txt" if kind == "txt" else "docs")
    if kind == "folder":
        src.mkdir()
        (src / "a.txt").write_bytes(good)
        src = src / "b.txt"
        src.write_bytes(bad_bytes)
        at, data = 3, None
    if data is not None:
        src.write_bytes(data)
    out = tmp_path / "out"
    arg = src.parent if kind == "folder" else src
    code = main(["data", "convert", "--input", str(arg), "--out", str(out), "--tokenizer",
                 tiny_tokenizer.name_or_path, "--max-seq-len", str(SEQ), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 2, err
    assert f"{src}: not UTF-8 at byte {at}" in err and "Traceback" not in err
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith((".out", "out"))) == []


def test_cli_converts_without_importing_streaming_transformers_or_torch(tmp_path, tiny_tokenizer,
                                                                         docs):
    """To a local folder without compression, with a tokenizer folder transformers adds nothing
    to: the same tokens, the tokenizer's path said in one line, and none of the packages that
    took ~5 s of the command imported (a process of its own: the test's has them all)."""
    import subprocess
    import sys

    src = write_txt(tmp_path / "c.txt", docs)
    code = ("import logging, sys\nlogging.basicConfig(level=logging.INFO)\n"
            "from foundryx.cli import main\n"
            f"rc = main(['data', 'convert', '--input', {str(src)!r}, '--out', "
            f"{str(tmp_path / 'out')!r}, '--tokenizer', {tiny_tokenizer.name_or_path!r}, "
            f"'--max-seq-len', '{SEQ}', '--workers', '2', '--no-progress'])\n"
            "print('imported:', sorted(m for m in ('streaming', 'transformers', 'torch') "
            "if m in sys.modules))\nsys.exit(rc)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "imported: []" in r.stdout and "sequences of 32 tokens" in r.stdout
    assert f"tokenizer: {tiny_tokenizer.name_or_path}/tokenizer.json through tokenizers alone" \
        in r.stderr
    np.testing.assert_array_equal(stored(tmp_path / "out"), expected(tiny_tokenizer, docs))


def test_a_tokenizer_transformers_changes_is_read_by_transformers_and_said(tmp_path,
                                                                          tiny_tokenizer, caplog):
    import logging
    import shutil

    from foundryx.cli.data_command import _tokenizer
    from foundryx.data.json_tokenizer import JsonTokenizer

    folder = tmp_path / "tok"
    shutil.copytree(tiny_tokenizer.name_or_path, folder)
    with caplog.at_level(logging.INFO, logger="foundryx"):
        assert isinstance(_tokenizer(str(folder)), JsonTokenizer)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["tokenizer_class"] = "GPT2TokenizerFast"  # rules of its own
        (folder / "tokenizer_config.json").write_text(json.dumps(config))
        tok = _tokenizer(str(folder))
    assert not isinstance(tok, JsonTokenizer) and tok.is_fast
    assert "tokenizer: transformers' AutoTokenizer (tokenizer_class GPT2TokenizerFast" in caplog.text
