"""What a checkpoint upload to a bucket costs the training loop: background vs synchronous.

A training loop (an MLP's forward/backward/step on CPU, fixed size) runs STEPS steps, three
ways per round, the order rotating round by round:

- ``base``: no checkpoint;
- ``sync``: at step STEPS/4 the staged checkpoint is uploaded and the loop waits for it;
- ``thread``: at step STEPS/4 the upload starts in an uploader thread of the training process
  (foundryx.checkpoint.upload.Upload, rank 0's path: files, wait for every file, manifest,
  retention) and the loop goes on; the run then waits for it, outside the timed loop;
- ``process``: the same upload run by the rank's upload process, as ``foundryx train`` does
  (foundryx.checkpoint.upload_process.UploadWorker, started once before the rounds, as a run's
  later checkpoints find it).

Training time lost to a save = loop time - base loop time of the same round. Target (issue 14):
background (thread or process) loss < 10% of the synchronous upload time of the same
checkpoint. The bucket is moto's S3 server in its own process on localhost (``moto_server``), so the upload's cost on the
loop is real client work (hashing, HTTP, copies) without a network in the way.

    python -m benchmarks.remote_checkpoint [--mb 256] [--rounds 5] [--steps 120] [--pin]

``--pin`` (2+ CPUs) models a training node whose upload has a core of its own and a store on
another machine: the training thread runs on CPU 0, the S3 server and the uploader's threads on
CPU 1 (the uploader thread and the upload process are created while the main thread sits on
CPU 1, so they and the transfer threads they start inherit that CPU). What the loop still loses
then is what the upload costs it through the interpreter (the GIL: the thread side), not
through a shared core.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from foundryx.checkpoint.layout import Manifest
from foundryx.checkpoint.remote import RemoteFolder, client
from foundryx.checkpoint.upload import Upload
from foundryx.checkpoint.upload_process import UploadWorker
from foundryx.checkpoint.verify import file_digest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stage(folder: Path, mb: int, files: int = 4) -> dict:
    """A staged checkpoint of ``mb`` MB in ``files`` files, with its manifest."""
    folder.mkdir(parents=True)
    for i in range(files):
        (folder / f"dcp/__{i}_0.distcp").parent.mkdir(exist_ok=True)
        (folder / f"dcp/__{i}_0.distcp").write_bytes(os.urandom(mb * 2**20 // files))
    digests = {str(p.relative_to(folder)): file_digest(p) for p in folder.rglob("*") if p.is_file()}
    Manifest(batch=1, epoch=0, world_size=1, run_name="bench", model_class="MLP",
             model_signature="-", num_params=0, files=digests).write(folder)
    return digests


def loop(steps: int, at: int, on_save) -> float:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.GELU(), torch.nn.Linear(2048, 512))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(64, 512)
    start = time.perf_counter()
    for step in range(steps):
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if step == at:
            on_save()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--pin", action="store_true",
                    help="training on CPU 0; the S3 server and the upload on CPU 1")
    args = ap.parse_args()
    torch.set_num_threads(1)
    port = free_port()
    moto = [str(Path(sys.executable).parent / "moto_server"), "-p", str(port)]
    if args.pin:
        if len(os.sched_getaffinity(0)) < 2:
            sys.exit("remote_checkpoint: --pin needs 2 CPUs")
        moto = ["taskset", "-c", "1", *moto]
        os.sched_setaffinity(0, {0})  # this (the training) thread
    server = subprocess.Popen(moto, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    os.environ.update({"S3_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "x",
                       "AWS_SECRET_ACCESS_KEY": "x", "AWS_DEFAULT_REGION": "us-east-1"})
    try:
        for _ in range(100):
            try:
                client().create_bucket(Bucket="bench")
                break
            except Exception:
                time.sleep(0.1)
        remote = RemoteFolder("bench", "run")
        with tempfile.TemporaryDirectory() as tmp:
            folder = Path(tmp) / "staged"
            digests = stage(folder, args.mb)
            files = sorted(digests)
            s3 = client()
            counter = iter(range(10**6))
            sides = ["base", "sync", "thread", "process"]
            results: dict[str, list[float]] = {side: [] for side in sides}
            uploads: list[float] = []
            lost: dict[str, list[float]] = {side: [] for side in sides[1:]}
            worker = UploadWorker()
            overran: list[int] = []

            def staged_copy() -> Path:
                """A hard-linked copy of the staged checkpoint (the upload deletes its folder)."""
                copy = Path(tmp) / f"copy{next(counter)}"
                shutil.copytree(folder, copy, copy_function=os.link)
                return copy

            def upload(copy: Path, wait: bool, where: str = "thread"):
                name = f"ep0-ba{next(counter)}"
                t = time.perf_counter()
                if args.pin:  # a thread or process inherits the CPU of the thread that starts it
                    os.sched_setaffinity(0, {1})
                if where == "process":
                    up = worker.submit(remote, name, copy, files, manifest=digests, keep=1,
                                       replace=set(), newest_complete=None)
                else:
                    up = Upload(s3, remote, name, copy, files, manifest=digests, keep=1).start()
                if args.pin:
                    os.sched_setaffinity(0, {0})
                if wait:
                    up.join()
                    if up.error:
                        raise up.error
                    uploads.append(time.perf_counter() - t)
                return up

            loop(20, -1, lambda: None)  # warm-up
            first = upload(staged_copy(), False, "process")  # starts the upload process
            first.join()
            if first.error:
                raise first.error
            for r in range(args.rounds):
                order = sides[r % 4:] + sides[:r % 4]
                times = {}
                for side in order:
                    pending: list[Upload] = []
                    if side == "base":
                        times[side] = loop(args.steps, -1, lambda: None)
                    elif side == "sync":
                        copy = staged_copy()
                        times[side] = loop(args.steps, args.steps // 4,
                                           lambda copy=copy: upload(copy, True))
                    else:
                        copy = staged_copy()
                        times[side] = loop(args.steps, args.steps // 4,
                                           lambda copy=copy, pending=pending, side=side:
                                           pending.append(upload(copy, False, side)))
                        if pending[0].running():
                            overran.append(r + 1)  # the upload outlived the loop: raise --steps
                        pending[0].join()
                        if pending[0].error:
                            raise pending[0].error
                    results[side].append(times[side])
                for side in sides[1:]:
                    lost[side].append(times[side] - times["base"])
                print(f"round {r + 1} ({', '.join(order)}): base {times['base']:.2f} s, "
                      f"sync {times['sync']:.2f} s (upload {uploads[-1]:.2f} s), "
                      f"thread {times['thread']:.2f} s, process {times['process']:.2f} s",
                      flush=True)
            worker.close()
            mb_s = [args.mb / u for u in uploads]
            pinned = "; pinned (training CPU 0, server and upload CPU 1)" if args.pin else ""
            print(f"\ncheckpoint {args.mb} MB in {len(files)} files; {args.rounds} rounds of "
                  f"{args.steps} steps{pinned}")
            print(f"synchronous upload: median {statistics.median(uploads):.2f} s "
                  f"({min(uploads):.2f}-{max(uploads):.2f}; {statistics.median(mb_s):.0f} MB/s)")
            for side in sides[1:]:
                print(f"training time lost, {side}: median {statistics.median(lost[side]):.3f} s "
                      f"({min(lost[side]):.3f}-{max(lost[side]):.3f})")
            if overran:
                print(f"rounds {overran}: a background upload outlived the loop (its tail was "
                      "not measured against training); use more --steps")
            for side in ("thread", "process"):
                ratios = [b / u for b, u in zip(lost[side], uploads)]
                print(f"{side} loss / sync upload time: median {statistics.median(ratios):.3f} "
                      f"({min(ratios):.3f}-{max(ratios):.3f}); target < 0.10")
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()
