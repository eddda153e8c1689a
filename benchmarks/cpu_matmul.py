"""GFLOP/s of fp32 matrix products on this CPU: torch's BLAS (``torch.mm``) against oneDNN
(``foundryx.kernels.cpu_matmul.onednn_mm``), for the products of a training step of the MPT in
benchmarks/vs_llmfoundry.py (d_model 256, FFN 1024, 16 x 256 tokens, vocabulary 8192 in 512-token
loss chunks): each layer's forward, its input gradient (a transposed weight) and its weight
gradient (a transposed activation).

    python -m benchmarks.cpu_matmul [--rounds 5] [--out benchmarks/RESULTS.md]

The two sides alternate within each round (which goes first alternates too); each number is the
best of 5 calls after a warm-up; the table gives the median over rounds and the spread of the
per-round ratio.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from foundryx.kernels.cpu_matmul import onednn_available, onednn_mm

T, D, F, V, CHUNK = 16 * 256, 256, 1024, 8192, 512
# name: (a's shape, b's shape, transpose a, transpose b): a @ b as the step computes it
SHAPES = {
    "qkv forward (x W^T)": ((T, D), (3 * D, D), False, True),
    "up forward": ((T, D), (F, D), False, True),
    "down forward": ((T, F), (D, F), False, True),
    "up input grad (dy W)": ((T, F), (F, D), False, False),
    "up weight grad (dy^T x)": ((T, F), (T, D), True, False),
    "loss chunk logits": ((CHUNK, D), (V, D), False, True),
    "loss weight grad": ((CHUNK, V), (CHUNK, D), True, False),
}


def operands(a_shape, b_shape, ta, tb):
    a, b = torch.randn(*a_shape), torch.randn(*b_shape)
    return (a.t() if ta else a), (b.t() if tb else b)


def best_s(fn, a, b, calls: int = 5) -> float:
    fn(a, b)
    best = float("inf")
    for _ in range(calls):
        start = time.perf_counter()
        fn(a, b)
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, help="append the result section to this markdown file")
    args = ap.parse_args()
    if not onednn_available():
        raise SystemExit("cpu_matmul.py: this torch has no oneDNN")
    rows = []
    for name, (sa, sb, ta, tb) in SHAPES.items():
        a, b = operands(sa, sb, ta, tb)
        flop = 2 * a.shape[0] * a.shape[1] * b.shape[1]
        sides = {"blas": [], "onednn": []}
        for r in range(args.rounds):
            order = [("blas", torch.mm), ("onednn", onednn_mm)]
            for side, fn in (order if r % 2 == 0 else order[::-1]):
                sides[side].append(flop / best_s(fn, a, b) / 1e9)
        ratios = [o / m for o, m in zip(sides["onednn"], sides["blas"])]
        rows.append((name, f"{a.shape[0]}x{a.shape[1]} @ {b.shape[0]}x{b.shape[1]}",
                     statistics.median(sides["blas"]), statistics.median(sides["onednn"]),
                     statistics.median(ratios), min(ratios), max(ratios)))
        print(f"{name}: blas {rows[-1][2]:.0f}, onednn {rows[-1][3]:.0f} GFLOP/s", flush=True)
    lines = ["| product | shape | torch.mm GFLOP/s | oneDNN GFLOP/s | ratio, median (min-max) |",
             "|---|---|---:|---:|---|"]
    lines += [f"| {n} | {s} | {m:.0f} | {o:.0f} | {r:.2f} ({lo:.2f}-{hi:.2f}) |"
              for n, s, m, o, r, lo, hi in rows]
    section = "\n".join([
        "", "## fp32 matmuls on the CPU: torch's BLAS vs oneDNN", "",
        f"{datetime.date.today()}. {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} cores, {torch.get_num_threads()} threads; torch {torch.__version__}. "
        f"Command: `python -m benchmarks.cpu_matmul --rounds {args.rounds}`.", "", *lines, ""])
    print(section)
    if args.out:  # appended, as the other benchmarks' --out
        args.out.write_text(args.out.read_text() + section if args.out.exists() else section)


if __name__ == "__main__":
    main()
