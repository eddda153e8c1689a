"""Datasets in object storage (a real S3 API on localhost): conversion into a bucket (index
last), partitioned conversion and merge (locally and in a bucket) compared token by token with
one conversion, loaders streaming from a bucket, and bad remotes as one message, exit 2."""

from __future__ import annotations

import json
import logging
import os
import urllib.parse
from pathlib import Path

import numpy as np
import pytest
from test_cli import in_process
from test_convert import stored, write_txt
from test_finetuning import CHATS

from foundryx.data import partitions, remote
from foundryx.data.convert import convert_to_mds
from foundryx.data.synthetic import generate_corpus
from foundryx.errors import DataError

SEQ = 32
SMALL = {"batch_chars": 400, "chunk_chars": 1500, "workers": 1, "progress": False}


@pytest.fixture
def corpus(tmp_path):
    docs = generate_corpus(60, seed=5)
    return docs, write_txt(tmp_path / "corpus.txt", docs)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv(remote.CACHE_ENV, str(root))
    return root


def token_stream(tokenizer, docs) -> tuple[np.ndarray, set[int]]:
    """Every document's tokens + eos, concatenated; and the offsets where documents start."""
    ids: list[int] = []
    starts = set()
    for doc in docs:
        starts.add(len(ids))
        ids += [*tokenizer(doc, add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]
    return np.asarray(ids, dtype=np.int32), starts


def one_message(r) -> str:
    """The one error line of a CLI call that stopped on bad input (exit 2, no traceback)."""
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    [message] = [line for line in r.stderr.splitlines() if line.startswith("foundryx: error:")]
    return message


def upload_folder(s3, folder: Path, bucket: str, prefix: str) -> None:
    client = s3.client()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(folder)}")


def test_convert_into_bucket_uploads_shards_then_index(s3, cache, corpus, tiny_tokenizer,
                                                       monkeypatch, tmp_path):
    from streaming.base.storage.upload import S3Uploader

    docs, src = corpus
    bucket = s3.bucket()
    url = f"s3://{bucket}/data/mds"
    events = []  # (object key, whether the dataset's index.json existed when it was uploaded)
    upload_file = S3Uploader.upload_file

    def recording(self, filename):
        key = urllib.parse.urlparse(os.path.join(self.remote, filename)).path.lstrip("/")
        events.append((key, "data/mds/index.json" in s3.keys(bucket)))
        upload_file(self, filename)

    monkeypatch.setattr(S3Uploader, "upload_file", recording)
    manifest = convert_to_mds(src, url, tiny_tokenizer, SEQ, **SMALL)

    index = json.loads(s3.client().get_object(Bucket=bucket, Key="data/mds/index.json")["Body"]
                       .read())
    shards = [f"data/mds/{s['raw_data']['basename']}" for s in index["shards"]]
    uploaded = [key for key, _ in events]
    assert len(shards) >= 3 and set(shards) <= set(uploaded)
    assert uploaded[-2:] == ["data/mds/foundryx_manifest.json", "data/mds/index.json"]
    assert not any(index_there for _, index_there in events)  # nothing before it saw an index
    # shards are deleted locally once uploaded; the work folder is gone at the end
    assert not list(cache.rglob("*.mds")) and not list(cache.rglob("ledger.jsonl"))
    # the bucket's dataset reads back as the same sequences as a local conversion
    local = convert_to_mds(src, tmp_path / "local", tiny_tokenizer, SEQ, **SMALL)
    assert manifest == local
    fetched = remote.fetch_dataset(url, str(tmp_path / "fetched"), None, "test")
    np.testing.assert_array_equal(stored(fetched), stored(tmp_path / "local"))
    with pytest.raises(DataError, match=f"output {url} already holds a dataset"):
        convert_to_mds(src, url, tiny_tokenizer, SEQ, **SMALL)


@pytest.mark.slow
def test_partitions_merge_to_the_single_conversion(s3, cache, corpus, tiny_tokenizer, tmp_path,
                                                   capsys):
    docs, src = corpus
    single = convert_to_mds(src, tmp_path / "single", tiny_tokenizer, SEQ, **SMALL)
    for i in range(3):
        convert_to_mds(src, tmp_path / "parts", tiny_tokenizer, SEQ, partition=(i, 3), **SMALL)
    merged = partitions.merge(tmp_path / "parts")
    assert [p["documents"] for p in merged["partitions"]] == [20, 20, 20]
    assert merged["documents"] == single["documents"] == len(docs)

    # token by token: each partition's sequences are the single conversion's token stream from
    # a document start on, and between partitions only the partition's tail (< SEQ) is left out
    stream, doc_starts = token_stream(tiny_tokenizer, docs)
    one = stored(tmp_path / "single").ravel()
    np.testing.assert_array_equal(one, stream[:len(one)])
    got = stored(tmp_path / "parts").ravel()
    pos = done = 0
    for part in merged["partitions"]:
        assert pos in doc_starts and 0 <= part["tokens_dropped"] < SEQ
        np.testing.assert_array_equal(got[done:done + part["tokens"]],
                                      stream[pos:pos + part["tokens"]])
        pos += part["tokens"] + part["tokens_dropped"]
        done += part["tokens"]
    assert pos == len(stream) and done == len(got)

    # one partition, merged, is the single conversion itself (through the CLI)
    cli = ["data", "convert", "--input", str(src), "--tokenizer", tiny_tokenizer.name_or_path,
           "--max-seq-len", str(SEQ), "--workers", "1", "--no-progress", "--out",
           str(tmp_path / "one")]
    assert "--partition I together" in one_message(in_process(capsys, *cli, "--partition", "0"))
    r = in_process(capsys, *cli, "--num-partitions", "1", "--partition", "0")
    assert r.returncode == 0 and f"to {tmp_path / 'one' / 'part-00000-of-00001'}" in r.stdout
    r = in_process(capsys, "data", "merge", str(tmp_path / "one"))
    assert r.returncode == 0 and f"merged 1 partition(s) into {tmp_path / 'one'}" in r.stdout
    np.testing.assert_array_equal(stored(tmp_path / "one"), stored(tmp_path / "single"))

    # the same in a bucket: a merge waits for every partition, then equals the local merge
    url = f"s3://{s3.bucket()}/parts"
    for i in (0, 2):
        convert_to_mds(src, url, tiny_tokenizer, SEQ, partition=(i, 3), **SMALL)
    with pytest.raises(DataError, match="1 of 3 partitions are missing or unfinished "
                                        r"\(part-00001-of-00003\)"):
        partitions.merge(url)
    convert_to_mds(src, url, tiny_tokenizer, SEQ, partition=(1, 3), **SMALL)
    assert partitions.merge(url) == merged
    fetched = remote.fetch_dataset(url, str(tmp_path / "fetched"), None, "test")
    np.testing.assert_array_equal(stored(fetched), stored(tmp_path / "parts"))


def test_loaders_stream_from_a_bucket(s3, cache, quickstart_data, tmp_path, caplog):
    from foundryx.data.finetuning.loader import FinetuningDatasetOptions, load_examples
    from foundryx.data.text import build_text_dataloader
    from foundryx.data.tokenizers import build_hf_tokenizer

    bucket = s3.bucket()
    upload_folder(s3, quickstart_data / "mds" / "val", bucket, "qs/val")
    tok = build_hf_tokenizer(str(quickstart_data / "tokenizer"))

    def first_batches(dataset, n=3):
        spec = build_text_dataloader({"dataset": {"max_seq_len": 128, **dataset}}, tok, 4)
        rows = []
        for batch, _ in zip(spec.dataloader, range(n)):
            rows.append(batch["input_ids"])
        return rows

    want = first_batches({"local": str(quickstart_data / "mds"), "split": "val"})
    got = first_batches({"remote": f"s3://{bucket}/qs", "local": str(tmp_path / "c1"),
                         "split": "val"})
    assert all((a == b).all() for a, b in zip(want, got)) and len(got) == 3
    assert list((tmp_path / "c1" / "val").rglob("*.mds"))  # downloaded into the given cache

    with caplog.at_level(logging.INFO, logger="foundryx"):
        mixed = first_batches({"streams": {
            "cloud": {"remote": f"s3://{bucket}/qs", "split": "val", "proportion": 1},
            "disk": {"local": str(quickstart_data / "mds"), "split": "val", "proportion": 1}}})
    assert len(mixed) == 3
    assert f"dataset.streams.cloud.remote: s3://{bucket}/qs is cached in {cache}" in caplog.text

    # fine-tuning examples from an MDS dataset in a bucket
    from streaming import MDSWriter

    with MDSWriter(out=str(tmp_path / "chat" / "train"), columns={"messages": "json"}) as w:
        for row in CHATS:
            w.write(row)
    upload_folder(s3, tmp_path / "chat", bucket, "chat")
    opts = {"max_seq_len": 256, "shuffle": False, "split": "train"}
    assert load_examples(FinetuningDatasetOptions(remote=f"s3://{bucket}/chat", **opts), tok) == \
        load_examples(FinetuningDatasetOptions(path=str(tmp_path / "chat"), **opts), tok)


@pytest.mark.parametrize(("case", "needle"), [
    ("missing-bucket", "bucket 'no-such-bucket' does not exist at http://"),
    ("no-dataset", "/nothing/train/index.json does not exist, so there is no MDS dataset"),
    ("wrong-endpoint", "cannot reach the S3 endpoint http://127.0.0.1:9"),
    ("no-credentials", "no AWS credentials were found to read s3://"),
], ids=["missing-bucket", "no-dataset", "wrong-endpoint", "no-credentials"])
def test_bad_remote_is_one_message_before_training(s3, quickstart_data, tmp_path, monkeypatch,
                                                   capsys, case, needle):
    bucket = s3.bucket()
    url = f"s3://{'no-such-bucket' if case == 'missing-bucket' else bucket}/nothing"
    if case == "wrong-endpoint":
        monkeypatch.setenv("S3_ENDPOINT_URL", "http://127.0.0.1:9")
    if case == "no-credentials":  # a dataset is there; unsigned requests are refused
        s3.client().put_object(Bucket=bucket, Key="nothing/train/index.json", Body=b"{}")
        monkeypatch.delenv("AWS_ACCESS_KEY_ID")
        monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
        monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    r = in_process(capsys, "train", "yamls/quickstart.yaml",
                   f"variables.data_root={quickstart_data}", f"save_folder={tmp_path}/ckpt",
                   f"loggers.jsonl.path={tmp_path}/metrics.jsonl",
                   f"train_loader.dataset.remote={url}",
                   f"train_loader.dataset.local={tmp_path}/cache")
    message = one_message(r)
    assert "dataset.remote: " in message and needle in message, message
    assert "loss/train" not in r.stderr + r.stdout
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "ckpt").exists()
    if case == "missing-bucket":  # writing to it is the same message, before any tokenizing
        src = write_txt(tmp_path / "c.txt", ["one document"])
        r = in_process(capsys, "data", "convert", "--input", str(src), "--out", url,
                       "--tokenizer", str(quickstart_data / "tokenizer"), "--max-seq-len", "8")
        assert f"cannot write to {url}: bucket 'no-such-bucket' does not exist" in one_message(r)


def test_remote_config_problems_name_the_key():
    from config_checks import section_problems

    def problems(loader, dataset):
        return section_problems("dataloaders", loader, {"dataset": dataset})

    assert problems("text", {"remote": "ftp://b/x", "max_seq_len": 8}) == [
        "dataset.remote: 'ftp://b/x' has the scheme 'ftp', which mosaicml-streaming does not read; "
        "use one of s3://, gs://, oci://, azure://, azure-dl://, hf://, dbfs://, sftp://, alipan://"]
    assert problems("text", {"local": "s3://b/x", "max_seq_len": 8})[0].startswith(
        "dataset.local: 's3://b/x' is object storage; write it as remote: s3://b/x")
    assert problems("text", {"remote": "s3://b/x", "max_seq_len": 8}) == []  # checked at build
    mixed = {"max_seq_len": 8, "remote": "s3://b/x",
             "streams": {"web": {"remote": "s3:/b/web"}, "code": {"remote": "s3://b/code"}}}
    assert problems("text", mixed) == [
        "dataset.remote: give either remote (one dataset) or streams, not both",
        "dataset.streams.web.remote: expected the URL of an MDS dataset in object storage, e.g. "
        "s3://bucket/path, got 's3:/b/web'; a local folder goes in local:"]
    assert problems("finetuning", {"remote": "s3://b/chat", "path": "x.jsonl",
                                   "max_seq_len": 8}) == [
        "dataset.path: give either path or remote (an MDS dataset in object storage), not both"]
