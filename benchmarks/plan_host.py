"""The two measured figures of the planner's host-memory table (foundryx/plan/host.py):

* the process baseline: the resident memory (``VmRSS``, and the peak ``VmHWM``) of a fresh
  Python process after it has imported what ``train.py`` imports (torch, Composer,
  transformers, foundryx.train and its builders), before it builds anything;
* one dataloader worker: the private (unshared) resident memory of each worker process of
  the ``text`` dataloader (MDS shards through mosaicml-streaming, the quickstart data) after
  it has served 20 batches. Workers are forked: what they share with the rank is the rank's,
  counted once there; a worker adds its private pages (``Private_Clean + Private_Dirty`` of
  ``/proc/PID/smaps_rollup``).

    nice .venv/bin/python -m benchmarks.plan_host [--repeats 3] [--workers 2]

Prints one JSON line per measure and a Markdown table for benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MiB = 2**20

IMPORTS = ("import torch, composer, transformers, streaming\n"
           "import foundryx.train, foundryx.builders\n")
READ = ("def status(key, pid='self'):\n"
        "    for line in open(f'/proc/{pid}/status'):\n"
        "        if line.startswith(key):\n"
        "            return int(line.split()[1]) * 1024\n")


def baseline_once() -> dict:
    code = IMPORTS + READ + "import json; print(json.dumps({'rss': status('VmRSS:'), " \
                            "'hwm': status('VmHWM:')}))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    if out.returncode:
        raise SystemExit(f"the baseline process failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def private_bytes(pid: int) -> tuple[int, int]:
    """(private resident bytes, resident bytes) of process ``pid``."""
    fields = {}
    for line in open(f"/proc/{pid}/smaps_rollup"):
        parts = line.split()
        if len(parts) >= 3 and parts[1].isdigit():
            fields[parts[0].rstrip(":")] = int(parts[1]) * 1024
    return fields["Private_Clean"] + fields["Private_Dirty"], fields["Rss"]


def workers_once(workers: int, data: Path) -> list[dict]:
    import torch  # noqa: F401 (the worker processes are forked from this one, as from a rank)
    from transformers import AutoTokenizer

    from foundryx.data.text import build_text_dataloader

    tok = AutoTokenizer.from_pretrained(data / "tokenizer")
    spec = build_text_dataloader(
        {"dataset": {"local": str(data / "mds"), "split": "train", "shuffle": True,
                     "max_seq_len": 128}, "drop_last": True, "num_workers": workers}, tok, 8)
    it = iter(spec.dataloader)
    for _ in range(20):
        next(it)
    time.sleep(0.5)
    pids = [w.pid for w in it._workers]  # the live iterator's worker processes
    rows = []
    for pid in pids:
        priv, rss = private_bytes(pid)
        rows.append({"pid": pid, "private": priv, "rss": rss})
    del it
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--data", type=Path, default=None,
                    help="quickstart data folder (default: built in a temporary folder)")
    args = ap.parse_args()
    base = [baseline_once() for _ in range(args.repeats)]
    for b in base:
        print(json.dumps({"measure": "baseline", **b}))
    with tempfile.TemporaryDirectory() as tmp:
        data = args.data
        if data is None:
            from foundryx.data.quickstart import prepare_quickstart

            data = prepare_quickstart(Path(tmp) / "qs", progress=False)
        rows = [r for _ in range(args.repeats) for r in workers_once(args.workers, data)]
    for r in rows:
        print(json.dumps({"measure": "worker", **r}))
    rss = [b["rss"] / MiB for b in base]
    hwm = [b["hwm"] / MiB for b in base]
    priv = [r["private"] / MiB for r in rows]
    wrss = [r["rss"] / MiB for r in rows]
    import torch

    print(f"\n| measure | median | min-max | n |\n|---|---|---|---|\n"
          f"| baseline VmRSS (MiB) | {statistics.median(rss):.0f} | {min(rss):.0f}-{max(rss):.0f} "
          f"| {len(rss)} |\n"
          f"| baseline VmHWM (MiB) | {statistics.median(hwm):.0f} | {min(hwm):.0f}-{max(hwm):.0f} "
          f"| {len(hwm)} |\n"
          f"| worker private (MiB) | {statistics.median(priv):.0f} | {min(priv):.0f}-{max(priv):.0f} "
          f"| {len(priv)} |\n"
          f"| worker RSS (MiB) | {statistics.median(wrss):.0f} | {min(wrss):.0f}-{max(wrss):.0f} "
          f"| {len(wrss)} |\n\ntorch {torch.__version__}, Python {sys.version.split()[0]}")


if __name__ == "__main__":
    main()
