"""Conversion speed: tokens/s of `foundryx data convert` with 1 and 2 worker processes.

    python -m benchmarks.convert                       # tinyshakespeare x ~45 = ~50 MB
    python -m benchmarks.convert --mb 10 --repeats 1   # a quick look

The corpus is ../shared/corpus/tinyshakespeare.txt repeated to about ``--mb`` MB (documents
are its blank-line-separated speeches); the tokenizer is a byte-level BPE (vocab 4096) trained
on it. Runs alternate 1, 2, 1, 2, ... workers, so load from other processes hits both alike;
each row is the best of ``--repeats`` runs, with the CPU seconds it used (this process and its
workers) and the cores it kept busy. The load average is printed with every run: on a shared
machine a ratio measured under load understates the parallel speed-up.
"""

from __future__ import annotations

import argparse
import datetime
import os
import resource
import tempfile
import time
from pathlib import Path

from foundryx.data.convert import convert_to_mds
from foundryx.data.sources import read_documents
from foundryx.data.tokenizers import train_bpe_tokenizer

ROOT = Path(__file__).resolve().parents[1]


def cpu_seconds() -> float:
    """User + system CPU time of this process and its finished children."""
    own, kids = (resource.getrusage(w) for w in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN))
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default=str(ROOT.parent / "shared/corpus/tinyshakespeare.txt"))
    ap.add_argument("--mb", type=float, default=50)
    ap.add_argument("--max-seq-len", type=int, default=2048)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()

    text = Path(args.corpus).read_text(encoding="utf-8").strip() + "\n\n"
    copies = max(1, round(args.mb * 2**20 / len(text.encode())))
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "corpus.txt"
        src.write_text(text * copies, encoding="utf-8")
        size_mb = src.stat().st_size / 2**20
        tok = train_bpe_tokenizer(read_documents(args.corpus), 4096, Path(tmp) / "tok")
        best: dict[int, float] = {}
        cpu: dict[int, float] = {}
        tokens = 0
        print(f"corpus: {size_mb:.1f} MB ({copies} copies); load average before: "
              f"{os.getloadavg()}", flush=True)
        for r in range(args.repeats):
            for w in args.workers:
                start, cpu0 = time.perf_counter(), cpu_seconds()
                manifest = convert_to_mds(src, Path(tmp) / f"out{w}", tok, args.max_seq_len,
                                          workers=w, overwrite=True, progress=False)
                wall, used = time.perf_counter() - start, cpu_seconds() - cpu0
                tokens = manifest["tokens"] + manifest["tokens_dropped"]
                if wall < best.get(w, float("inf")):
                    best[w], cpu[w] = wall, used
                print(f"  run {r + 1}, {w} worker(s): {wall:.1f} s, {tokens / wall:,.0f} tokens/s, "
                      f"{used:.1f} CPU s, load {os.getloadavg()[0]:.2f}", flush=True)
        load = os.getloadavg()
    print(f"\nload average after: {load}\n")
    print(f"{datetime.date.today()}: {size_mb:.1f} MB, {tokens:,} tokens, max_seq_len "
          f"{args.max_seq_len}, best of {args.repeats}\n")
    print("| workers | wall s | tokens/s | speed-up vs 1 | CPU s | cores busy (CPU s / wall s) |")
    print("|---|---|---|---|---|---|")
    for w in args.workers:
        print(f"| {w} | {best[w]:.1f} | {tokens / best[w]:,.0f} | "
              f"{best[args.workers[0]] / best[w]:.2f}x | {cpu[w]:.1f} | {cpu[w] / best[w]:.2f} |")


if __name__ == "__main__":
    main()
