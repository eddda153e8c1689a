"""Streaming the quickstart from an S3 API server on localhost vs reading it from local disk.

    python -m benchmarks.remote                     # uses (or builds) data/quickstart
    python -m benchmarks.remote --rounds 5 --batches 200

The S3 server is moto's (``moto_server``, installed with the dev dependencies) in its own
process, so it does not share this process's GIL. The quickstart's MDS ``train`` split is
uploaded to a bucket once. Then, round by round, alternating which side goes first:

* ``disk``: the ``text`` loader of yamls/quickstart.yaml (batch 16 x 128 tokens, shuffled)
  over ``data/quickstart/mds``;
* ``s3 cold``: the same loader with ``remote: s3://...`` and an empty cache (every shard is
  downloaded while batches are read);
* ``s3 warm``: again from the same remote, its cache now full (the index is still fetched and
  compared up front).

Each side reads ``--batches`` batches after the first (the first batch, which builds the
dataset, is timed separately as "start"). Printed: sequences/s per round, the median, and each
S3 side's ratio to the disk side of the same round (median and min-max spread). Checkpoints in
a bucket are measured by benchmarks/remote_checkpoint.py.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from foundryx.data.quickstart import prepare_quickstart
from foundryx.data.text import build_text_dataloader
from foundryx.data.tokenizers import build_hf_tokenizer

ROOT = Path(__file__).resolve().parents[1]

BATCH, SEQ = 16, 128
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench",
               "AWS_DEFAULT_REGION": "us-east-1", "AWS_CONFIG_FILE": os.devnull,
               "AWS_SHARED_CREDENTIALS_FILE": os.devnull}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_s3() -> tuple[subprocess.Popen, str]:
    port = free_port()
    server = subprocess.Popen([str(Path(sys.executable).parent / "moto_server"), "-H",
                               "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    for _ in range(200):
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return server, url
        except OSError:
            time.sleep(0.1)
    server.kill()
    raise SystemExit("moto_server did not start")


def upload(folder: Path, bucket: str) -> str:
    import boto3

    client = boto3.client("s3", endpoint_url=os.environ["S3_ENDPOINT_URL"])
    client.create_bucket(Bucket=bucket)
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            client.upload_file(str(path), bucket, f"mds/train/{path.relative_to(folder)}")
    return f"s3://{bucket}/mds"


def measure(dataset: dict, tokenizer, batches: int) -> tuple[float, float]:
    """(seconds to the first batch, sequences/s over the next ``batches``)."""
    start = time.perf_counter()
    spec = build_text_dataloader({"dataset": {"max_seq_len": SEQ, "split": "train",
                                              "shuffle": True, "shuffle_seed": 17, **dataset}},
                                 tokenizer, BATCH)
    it = iter(spec.dataloader)
    next(it)
    first = time.perf_counter() - start
    start, n = time.perf_counter(), 0
    for _ in range(batches):
        n += len(next(it)["input_ids"])
    rate = n / (time.perf_counter() - start)
    del it, spec
    return first, rate


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default=str(ROOT / "data" / "quickstart"))
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--batches", type=int, default=200)
    args = p.parse_args()
    data = prepare_quickstart(Path(args.data), progress=False)
    tokenizer = build_hf_tokenizer(str(data / "tokenizer"))
    server, url = start_s3()
    os.environ.update({**CREDENTIALS, "S3_ENDPOINT_URL": url})
    work = Path(tempfile.mkdtemp(prefix="foundryx-bench-remote-"))
    try:
        remote = upload(data / "mds" / "train", "bench")
        sides = {
            "disk": lambda r: {"local": str(data / "mds")},
            "s3 cold": lambda r: {"remote": remote, "local": str(work / f"cold{r}")},
            "s3 warm": lambda r: {"remote": remote, "local": str(work / "warm")},
        }
        measure(sides["s3 warm"](0), tokenizer, args.batches)  # fills the warm cache
        rows: dict[str, list[tuple[float, float]]] = {k: [] for k in sides}
        for r in range(args.rounds):
            order = list(sides) if r % 2 == 0 else list(reversed(sides))
            for name in order:
                rows[name].append(measure(sides[name](r), tokenizer, args.batches))
            print(f"round {r + 1}: " + ", ".join(f"{k} {rows[k][-1][1]:,.0f} seq/s"
                                                  for k in sides), flush=True)
    except BaseException:
        server.kill()
        shutil.rmtree(work, ignore_errors=True)
        raise
    report(rows, args)
    # streaming's download threads of the last datasets may still run: stop the server and
    # leave without waiting for them (they would only report the server gone)
    server.kill()
    shutil.rmtree(work, ignore_errors=True)
    sys.stdout.flush()
    os._exit(0)


def report(rows: dict[str, list[tuple[float, float]]], args: argparse.Namespace) -> None:
    print(f"\n{datetime.date.today()}, {args.rounds} rounds x {args.batches} batches of "
          f"{BATCH} x {SEQ} tokens, sides alternating")
    print("| side | seq/s median (min-max) | first batch s, median | ratio to disk, median "
          "(min-max) |")
    print("|---|---|---|---|")
    disk = [rate for _, rate in rows["disk"]]
    for name, values in rows.items():
        rates = [rate for _, rate in values]
        firsts = [first for first, _ in values]
        ratios = [a / b for a, b in zip(rates, disk)]
        print(f"| {name} | {statistics.median(rates):,.0f} ({min(rates):,.0f}-{max(rates):,.0f})"
              f" | {statistics.median(firsts):.2f} | {statistics.median(ratios):.2f} "
              f"({min(ratios):.2f}-{max(ratios):.2f}) |")


if __name__ == "__main__":
    main()
