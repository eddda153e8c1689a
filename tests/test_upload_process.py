"""Each rank's checkpoint uploads run in a process of its own
(foundryx/checkpoint/upload_process.py), against the real S3 API server on localhost (the `s3`
fixture): one process per rank for every upload of the run (which ignores the SIGTERM a
scheduler sends the whole job), the manifest last and retention as before, a failure past its
retries is one message naming the object, and a training process killed with kill -9 takes its
upload process with it, leaving no manifest."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from foundryx.checkpoint.layout import MANIFEST, Manifest
from foundryx.checkpoint.remote import RemoteFolder, checkpoints, client
from foundryx.checkpoint.upload_process import UploadWorker
from foundryx.checkpoint.verify import file_digest
from foundryx.errors import RunError


def stage(root: Path, name: str, size: int = 3 * 2**20) -> tuple[Path, list[str], dict]:
    """A staged checkpoint: two shard files and a manifest listing them."""
    folder = root / name
    (folder / "dcp").mkdir(parents=True)
    for i in range(2):
        (folder / f"dcp/__{i}_0.distcp").write_bytes(os.urandom(size))
    files = [f"dcp/__{i}_0.distcp" for i in range(2)]
    digests = {rel: file_digest(folder / rel) for rel in files}
    Manifest(batch=1, epoch=0, world_size=1, run_name="t", model_class="M", model_signature="s",
             num_params=1, files=digests).write(folder)
    return folder, files, digests


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return Path(f"/proc/{pid}/stat").exists() and " Z " not in Path(f"/proc/{pid}/stat").read_text()


def test_one_process_uploads_every_checkpoint_of_a_rank_manifest_last(s3, tmp_path):
    remote = RemoteFolder(s3.bucket("upproc"), "run")
    worker = UploadWorker()
    pids = []
    for name in ("ep0-ba4", "ep0-ba8"):
        folder, files, digests = stage(tmp_path, name)
        up = worker.submit(remote, name, folder, files, manifest=digests, keep=1, replace=set(),
                           newest_complete=None)
        assert up.join(60), up.progress()
        assert up.error is None and up.committed
        assert up.progress() == "6.0/6.0 MB of this rank's files"
        assert not folder.exists()  # every file is in the bucket: the staging copy goes
        pids.append(worker.pid)
        os.kill(worker.pid, signal.SIGTERM)  # a scheduler signals the whole job: not its to act on
    assert pids[0] == pids[1] and alive(pids[0])  # one process for the run
    complete, _, _ = checkpoints(client(), remote)
    assert [n for n, _ in complete] == ["ep0-ba8"]  # keep=1 removed ep0-ba4, remotely
    keys = s3.keys(remote.bucket, "run/")
    assert keys == ["run/ep0-ba8/dcp/__0_0.distcp", "run/ep0-ba8/dcp/__1_0.distcp",
                    f"run/ep0-ba8/{MANIFEST}"]
    worker.close()
    deadline = time.monotonic() + 10
    while alive(pids[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(pids[0])


def test_a_failure_past_its_retries_is_one_message_naming_the_object(s3, tmp_path):
    folder, files, digests = stage(tmp_path, "ep0-ba8", size=64)
    worker = UploadWorker()
    up = worker.submit(RemoteFolder("gone-bucket", "run"), "ep0-ba8", folder, files,
                       manifest=digests, keep=-1, replace=set(), newest_complete="ep0-ba4",
                       attempts=2, backoff_s=0.01)
    assert up.join(60)
    worker.close()
    assert isinstance(up.error, RunError) and not up.committed
    text = str(up.error)
    assert "uploading s3://gone-bucket/run/ep0-ba8/dcp/__0_0.distcp failed 2 times" in text, text
    assert "NoSuchBucket" in text and "s3://gone-bucket/run/ep0-ba4 is still the newest" in text
    assert "\n" not in text


TRAINING = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from foundryx.checkpoint.layout import Manifest
    from foundryx.checkpoint.remote import RemoteFolder
    from foundryx.checkpoint.upload_process import UploadWorker
    folder = Path(sys.argv[2])
    files = sorted(str(p.relative_to(folder)) for p in (folder / "dcp").iterdir())
    worker = UploadWorker()
    up = worker.submit(RemoteFolder(sys.argv[1], "run"), folder.name, folder, files,
                       manifest=Manifest.read(folder).files, keep=-1, replace=set(),
                       newest_complete=None)
    print(worker.pid, flush=True)
    time.sleep(600)  # "training": killed by the test
""")


def test_kill_9_of_the_training_process_ends_its_upload_process_without_a_manifest(s3, tmp_path):
    bucket = s3.bucket("upkill")
    folder, _, _ = stage(tmp_path, "ep0-ba4", size=2**20)
    env = {**os.environ, **s3.env, "FOUNDRYX_TEST_UPLOAD_PAUSE": "ep0-ba4"}  # stops after 1 file
    proc = subprocess.Popen([sys.executable, "-c", TRAINING, bucket, str(folder)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    child = int(proc.stdout.readline())
    deadline = time.monotonic() + 60
    while len(s3.keys(bucket, "run/")) < 1 and time.monotonic() < deadline:
        time.sleep(0.1)  # the first file is in the bucket: the upload is under way
    assert s3.keys(bucket, "run/") == ["run/ep0-ba4/dcp/__0_0.distcp"]
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    deadline = time.monotonic() + 10
    while alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(child), "the upload process outlived the training process"
    assert f"run/ep0-ba4/{MANIFEST}" not in s3.keys(bucket, "run/")
    complete, _, unfinished = checkpoints(client(), RemoteFolder(bucket, "run"))
    assert complete == [] and unfinished == ["ep0-ba4"]
    assert "upload paused after its first file" in proc.stderr.read()  # its log reached stderr
