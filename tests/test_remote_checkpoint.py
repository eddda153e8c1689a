"""Checkpoints in a bucket (save_folder: s3://...), against a real S3 API server on localhost
(the `s3` fixture): background upload from 2 gloo processes with the manifest last, retention,
a kill -9 in the middle of an upload, autoresume from the bucket into a fresh cache, export and
eval of the remote checkpoint, and the failures (bad bucket, endpoint, credentials; an upload
failing past its retries)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from foundryx.checkpoint.layout import MANIFEST, Manifest
from foundryx.checkpoint.remote import RemoteFolder, check_access, checkpoints, client, fetch
from foundryx.checkpoint.upload import Upload
from foundryx.checkpoint.verify import file_digest
from foundryx.errors import CheckpointError, RunError
from foundryx.loggers.jsonl import read_metrics

ROOT = Path(__file__).parents[1]
BIN = Path(sys.executable).parent
LOSS = "loss/train/total"
TINY = [
    "variables.max_seq_len=32", "model.d_model=32", "model.n_heads=2", "model.n_layers=2",
    "model.init_device=meta", "global_train_batch_size=4", "eval_loader=null", "parallelism={}",
    "scheduler.t_warmup=2ba", "optimizer.lr=0.01", "max_duration=12ba", "save_interval=4ba",
    "save_overwrite=false", "console_log_interval=100ba", "callbacks.speed_monitor.window_size=1",
]


def command(data: Path, out: Path, url: str, *extra: str) -> list[str]:
    return [str(BIN / "composer"), "-n", "2", "--stderr", str(out / "rank{rank}.err"), "--stdout",
            str(out / "rank{rank}.out"), str(ROOT / "train.py"), "yamls/quickstart.yaml",
            f"variables.data_root={data}", f"save_folder={url}",
            f"loggers.jsonl.path={out}/metrics.jsonl", *TINY, *extra]


def environment(s3, cache: Path, **more: str) -> dict[str, str]:
    return {**os.environ, **s3.env, "FOUNDRYX_CHECKPOINT_CACHE": str(cache), "PYTHONUNBUFFERED": "1", **more}


def logs(out: Path, r=None) -> str:
    said = "".join(p.read_text() for p in sorted(out.glob("rank*.*")))
    return said + (r.stdout + r.stderr if r is not None else "")


def losses(out: Path) -> dict[int, float]:
    return {row["batch"]: row[LOSS] for row in read_metrics(out / "metrics.jsonl") if LOSS in row}


def folders(s3, bucket: str, prefix: str = "run/") -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for key in s3.keys(bucket, prefix):
        name, _, rel = key[len(prefix):].partition("/")
        out.setdefault(name, set()).add(rel)
    return out


@pytest.mark.slow
def test_bucket_save_kill_mid_upload_resume_export_eval(s3, quickstart_data, tmp_path, monkeypatch):
    # 1. An uninterrupted run on 2 processes saves to bucket A, keeping the newest 2.
    bucket_a = s3.bucket("ckpt-e2e-a")
    out_a = tmp_path / "a"
    out_a.mkdir()
    r = subprocess.run(command(quickstart_data, out_a, f"s3://{bucket_a}/run",
                               "save_num_checkpoints_to_keep=2"),
                       cwd=ROOT, env=environment(s3, tmp_path / "cache-a"), capture_output=True,
                       text=True, timeout=1500)
    said = logs(out_a, r)
    assert r.returncode == 0, said[-4000:]
    remote = folders(s3, bucket_a)
    assert sorted(remote) == ["ep0-ba12", "ep0-ba8"], remote  # ep0-ba4 deleted by retention
    for name, files in remote.items():
        assert MANIFEST in files and any(f.startswith("dcp/__1_") for f in files), (name, files)
    assert f"checkpoint removed: s3://{bucket_a}/run/ep0-ba4 (save_num_checkpoints_to_keep=2)" in said
    assert "uploading to s3://" in said and "checkpoint uploaded" in said
    staging = tmp_path / "cache-a" / "staging" / bucket_a / "run"
    assert not [p for p in staging.glob("ep*")] if staging.exists() else True  # nothing left staged
    reference = losses(out_a)
    assert sorted(reference) == list(range(1, 13))

    # 2. The same run into bucket B, killed (SIGKILL, every process) while ep0-ba8 uploads.
    bucket_b = s3.bucket("ckpt-e2e-b")
    out_k = tmp_path / "k"
    out_k.mkdir()
    proc = subprocess.Popen(command(quickstart_data, out_k, f"s3://{bucket_b}/run"), cwd=ROOT,
                            env=environment(s3, tmp_path / "cache-k",
                                            FOUNDRYX_TEST_UPLOAD_PAUSE="ep0-ba8"),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.monotonic() + 900
    while "ep0-ba8" not in folders(s3, bucket_b) and proc.poll() is None:
        assert time.monotonic() < deadline, logs(out_k)[-3000:]
        time.sleep(0.2)
    assert proc.poll() is None, logs(out_k)[-3000:]
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=60)
    left = folders(s3, bucket_b)
    assert MANIFEST not in left["ep0-ba8"] and left["ep0-ba8"], left  # half uploaded
    assert MANIFEST in left["ep0-ba4"], left
    complete, _, unfinished = checkpoints(client(), RemoteFolder(bucket_b, "run"))
    assert [n for n, _ in complete] == ["ep0-ba4"] and unfinished == ["ep0-ba8"]

    # 3. Autoresume from the bucket, in a fresh working directory with a fresh local cache.
    out_r = tmp_path / "r"
    out_r.mkdir()
    r = subprocess.run(command(quickstart_data, out_r, f"s3://{bucket_b}/run"), cwd=ROOT,
                       env=environment(s3, tmp_path / "cache-r"), capture_output=True, text=True,
                       timeout=1500)
    said = logs(out_r, r)
    assert r.returncode == 0, said[-4000:]
    assert "removed 1 unfinished upload(s)" in said and "ep0-ba4" in said
    assert "resumed from" in said and "at batch 4" in said
    resumed = losses(out_r)
    assert sorted(resumed) == list(range(5, 13))
    assert resumed[12] == pytest.approx(reference[12], abs=1e-6), (resumed, reference)
    assert all(MANIFEST in files for files in folders(s3, bucket_b).values())

    # 4. Export and eval read the remote checkpoint (a save_folder URL: its newest).
    from foundryx.checkpoint.weights import load_model_weights
    from foundryx.eval.config import EvalModelSpec
    from foundryx.eval.models import load_eval_model
    from foundryx.export import export_checkpoint

    monkeypatch.setenv("FOUNDRYX_CHECKPOINT_CACHE", str(tmp_path / "cache-x"))
    exported = export_checkpoint(f"s3://{bucket_a}/run", tmp_path / "hf", progress=False)
    assert (exported / "config.json").is_file() and list(exported.glob("*.safetensors"))
    model, tokenizer = load_eval_model(EvalModelSpec(label="remote", checkpoint=f"s3://{bucket_a}/run"))
    local = fetch(f"s3://{bucket_a}/run")
    assert local.name == "ep0-ba12" and tokenizer is not None
    weights = load_model_weights(local)
    import torch

    state = model.state_dict()
    assert weights.keys() == state.keys()
    assert all(torch.equal(weights[k], state[k]) for k in weights)


def _checkpoint_in_bucket(s3, bucket: str, tmp: Path, name: str, files: dict[str, bytes]) -> None:
    folder = tmp / name
    for rel, data in files.items():
        (folder / rel).parent.mkdir(parents=True, exist_ok=True)
        (folder / rel).write_bytes(data)
    Manifest(batch=int(name.split("ba")[1]), epoch=0, world_size=1, run_name="t", model_class="M",
             model_signature="s", num_params=1,
             files={rel: file_digest(folder / rel) for rel in files}).write(folder)
    c = s3.client()
    for p in folder.rglob("*"):
        if p.is_file():
            c.upload_file(str(p), bucket, f"run/{name}/{p.relative_to(folder)}")


def test_only_checkpoints_with_every_file_count_and_downloads_are_verified(s3, tmp_path, monkeypatch):
    monkeypatch.setenv("FOUNDRYX_CHECKPOINT_CACHE", str(tmp_path / "cache"))
    bucket = s3.bucket("ckpt-listing")
    _checkpoint_in_bucket(s3, bucket, tmp_path, "ep0-ba4", {"a.bin": b"a" * 100, "dcp/b": b"b" * 10})
    _checkpoint_in_bucket(s3, bucket, tmp_path, "ep0-ba12", {"a.bin": b"c" * 100})
    c = s3.client()
    c.delete_object(Bucket=bucket, Key="run/ep0-ba12/a.bin")  # listed in its manifest, missing
    c.put_object(Bucket=bucket, Key="run/ep0-ba16/a.bin", Body=b"x")  # an upload without manifest
    complete, incomplete, unfinished = checkpoints(client(), RemoteFolder(bucket, "run"))
    assert [n for n, _ in complete] == ["ep0-ba4"]
    assert len(incomplete) == 1 and "ep0-ba12" in incomplete[0] and "a.bin" in incomplete[0]
    assert unfinished == ["ep0-ba16"]
    local = fetch(f"s3://{bucket}/run")
    assert local.name == "ep0-ba4" and (local / "dcp" / "b").read_bytes() == b"b" * 10
    # The same size with other bytes: the download names the object and keeps nothing.
    c.put_object(Bucket=bucket, Key="run/ep0-ba4/dcp/b", Body=b"X" * 10)
    with pytest.raises(CheckpointError, match=rf"s3://{bucket}/run/ep0-ba4/dcp/b: sha256 differs"):
        fetch(f"s3://{bucket}/run/ep0-ba4", tmp_path / "other")
    assert not list((tmp_path / "other").iterdir())


def test_bucket_endpoint_and_credentials_are_checked(s3, monkeypatch):
    assert check_access(f"s3://{s3.bucket('ckpt-access')}/run") is None
    assert "bucket 'no-such-bucket' does not exist" in check_access("s3://no-such-bucket/run")
    monkeypatch.setenv("S3_ENDPOINT_URL", "http://127.0.0.1:9")
    assert "cannot reach the object store at http://127.0.0.1:9" in check_access("s3://b/run")
    monkeypatch.setenv("S3_ENDPOINT_URL", s3.endpoint_url)
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(var)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    assert "no S3 credentials found" in check_access("s3://b/run")


@pytest.mark.slow
def test_missing_bucket_stops_the_run_before_training(s3, quickstart_data, tmp_path, capsys, monkeypatch):
    from foundryx.cli import main

    monkeypatch.setenv("FOUNDRYX_CHECKPOINT_CACHE", str(tmp_path / "cache"))
    rc = main(["train", "yamls/quickstart.yaml", f"variables.data_root={quickstart_data}", *TINY,
               "save_folder=s3://no-such-bucket/run", f"loggers.jsonl.path={tmp_path}/m.jsonl"])
    err = capsys.readouterr().err
    assert rc == 2, err[-3000:]
    lines = [ln for ln in err.splitlines() if ln.startswith("foundryx: error:")]
    assert len(lines) == 1 and "bucket 'no-such-bucket' does not exist" in lines[0], err[-3000:]
    assert "Traceback" not in err
    assert not [row for row in read_metrics(tmp_path / "m.jsonl") if LOSS in row] \
        if (tmp_path / "m.jsonl").exists() else True  # not one batch trained


def test_upload_failing_past_its_retries_is_one_message_naming_the_object(s3, tmp_path):
    (tmp_path / "dcp").mkdir()
    (tmp_path / "dcp" / "__0_0.distcp").write_bytes(b"x" * 64)
    up = Upload(client(attempts=1), RemoteFolder("gone-bucket", "run"), "ep0-ba8", tmp_path,
                ["dcp/__0_0.distcp"], manifest={"dcp/__0_0.distcp": {"size": 64}}, attempts=3,
                backoff_s=0.01, newest_complete="ep0-ba4").start()
    assert up.join(60)
    assert isinstance(up.error, RunError) and not up.committed
    text = str(up.error)
    assert "uploading s3://gone-bucket/run/ep0-ba8/dcp/__0_0.distcp failed 3 times" in text, text
    assert "NoSuchBucket" in text and "s3://gone-bucket/run/ep0-ba4 is still the newest" in text
    assert json.dumps(text).count("\\n") == 0  # one line


def test_one_run_per_remote_save_folder(s3, caplog):
    import dataclasses

    from foundryx.checkpoint.remote_lock import BucketLock

    remote = RemoteFolder(s3.bucket("ckpt-lock"), "run")
    first = BucketLock(client(), remote, "first")
    first.acquire()
    second = BucketLock(client(), remote, "second")
    second.owner = dataclasses.replace(second.owner, pid=first.owner.pid + 1)  # another live run
    second.owner = dataclasses.replace(second.owner, host="other-node")
    with pytest.raises(CheckpointError, match=r"in use by another run \(host .*pid .*run first"):
        second.acquire()
    first.release()
    assert s3.keys(remote.bucket) == []
    second.acquire()  # free again
    assert s3.keys(remote.bucket) == ["run/.lock"]
    # A lock whose pid is gone on this host is taken over, with one line saying so.
    gone = BucketLock(client(), RemoteFolder(remote.bucket, "run2"), "gone")
    gone.owner = dataclasses.replace(gone.owner, pid=2**22 + 7)
    gone.acquire()
    gone._stop.set()  # killed: no heartbeat, no release
    third = BucketLock(client(), RemoteFolder(remote.bucket, "run2"), "third")
    with caplog.at_level("WARNING", logger="foundryx"):
        third.acquire()
    assert f"pid {2**22 + 7} is not running" in caplog.text
    assert json.loads(s3.client().get_object(Bucket=remote.bucket, Key="run2/.lock")["Body"].read())["run_name"] == "third"
    second.release()
    third.release()
