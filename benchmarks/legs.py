"""The two torch legs side by side: the quickstart, the LoRA fine-tune of its Llama export and
the quickstart eval suite, each run as a user runs it (``train.py``, ``foundryx export``,
``foundryx eval``) in the pinned venv (torch 2.7, transformers 4.57) and the modern one (torch
2.15, transformers 5.x), the legs alternating within each round.

    python -m benchmarks.legs [--rounds 3] [--batches 60] [--lora-batches 30] [--out benchmarks/RESULTS.md]

Per run: tokens/s (the median of the run's ``throughput/tokens_per_sec`` after its first 10
batches), wall seconds, and the peak RSS of the process (``ru_maxrss`` from ``wait4``, loading
included). Prints a table per round and the modern/pinned ratio of each figure (median over
rounds, min..max). Needs ``make data`` (data/quickstart), ``.venv`` and ``.venv-modern``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LEGS = {"pinned": ROOT / ".venv" / "bin", "modern": ROOT / ".venv-modern" / "bin"}


def run(argv: list[str], log: Path) -> tuple[float, float]:
    """(wall seconds, peak RSS GiB) of one command, its output to ``log``; raises on failure."""
    start = time.perf_counter()
    with log.open("w") as out:
        proc = subprocess.Popen(argv, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"{' '.join(argv)} failed; see {log}")
    return wall, usage.ru_maxrss / 2**20  # kB -> GiB


def tokens_per_sec(metrics: Path, skip: int = 10) -> float:
    rates = [row["throughput/tokens_per_sec"] for row in map(json.loads, metrics.open())
             if "throughput/tokens_per_sec" in row and row.get("batch", 0) > skip]
    return statistics.median(rates)


def one_leg(leg: str, args: argparse.Namespace, work: Path) -> dict[str, float]:
    bin_ = LEGS[leg]
    name = f"bench-legs-{leg}"
    shutil.rmtree(ROOT / "runs" / name, ignore_errors=True)
    shutil.rmtree(ROOT / "runs" / f"{name}-lora", ignore_errors=True)
    out: dict[str, float] = {}
    wall, rss = run([str(bin_ / "python"), "train.py", "yamls/quickstart.yaml",
                     f"variables.run_name={name}", f"max_duration={args.batches}ba",
                     f"eval_interval={args.batches}ba", f"save_interval={args.batches}ba"],
                    work / f"{leg}-train.log")
    out.update(train_tok_s=tokens_per_sec(ROOT / "runs" / name / "metrics.jsonl"),
               train_s=wall, train_rss=rss)
    export = ROOT / "runs" / name / "export" / "hf"
    run([str(bin_ / "foundryx"), "export", f"runs/{name}/checkpoints", str(export)],
        work / f"{leg}-export.log")
    wall, rss = run([str(bin_ / "python"), "train.py", "yamls/finetune/llama-lora.yaml",
                     f"variables.run_name={name}-lora", f"variables.model_path={export}",
                     f"max_duration={args.lora_batches}ba", f"eval_interval={args.lora_batches}ba",
                     f"save_interval={args.lora_batches}ba"], work / f"{leg}-lora.log")
    out.update(lora_tok_s=tokens_per_sec(ROOT / "runs" / f"{name}-lora" / "metrics.jsonl"),
               lora_s=wall, lora_rss=rss)
    wall, rss = run([str(bin_ / "foundryx"), "eval", "eval/yamls/quickstart.yaml",
                     f"variables.run_name={name}", f"output_dir=runs/{name}/eval"],
                    work / f"{leg}-eval.log")
    out.update(eval_s=wall, eval_rss=rss)
    return out


def versions(leg: str) -> str:
    code = ("import torch, transformers, numpy; print(f'torch {torch.__version__}, "
            "transformers {transformers.__version__}, numpy {numpy.__version__}')")
    return subprocess.run([str(LEGS[leg] / "python"), "-c", code], capture_output=True,
                          text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--lora-batches", type=int, default=30)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    work = Path("/tmp/foundryx-bench-legs")
    work.mkdir(exist_ok=True)
    rounds: list[dict[str, dict[str, float]]] = []
    for r in range(args.rounds):
        order = ["pinned", "modern"] if r % 2 == 0 else ["modern", "pinned"]
        rounds.append({leg: one_leg(leg, args, work) for leg in order})
        print(f"round {r + 1}: " + "; ".join(
            f"{leg}: " + ", ".join(f"{k} {v:,.2f}" for k, v in res.items())
            for leg, res in rounds[-1].items()), flush=True)
    keys = list(rounds[0]["pinned"])
    lines = ["| figure | pinned (median) | modern (median) | modern / pinned: median (min..max) |",
             "|---|---|---|---|"]
    for k in keys:
        p = [x["pinned"][k] for x in rounds]
        m = [x["modern"][k] for x in rounds]
        ratios = [b / a for a, b in zip(p, m)]
        lines.append(f"| {k} | {statistics.median(p):,.2f} | {statistics.median(m):,.2f} | "
                     f"{statistics.median(ratios):.3f} ({min(ratios):.3f}..{max(ratios):.3f}) |")
    table = "\n".join(lines)
    head = (f"`python -m benchmarks.legs --rounds {args.rounds} --batches {args.batches} "
            f"--lora-batches {args.lora_batches}`, {datetime.date.today()}, "
            f"{platform.processor() or platform.machine()} ({os.cpu_count()} cores); "
            f"pinned: {versions('pinned')}; modern: {versions('modern')}.")
    print(head + "\n\n" + table)
    if args.out:
        with args.out.open("a") as f:
            f.write("\n" + head + "\n\n" + table + "\n")


if __name__ == "__main__":
    main()
