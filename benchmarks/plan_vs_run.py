"""The planner's host memory per rank against a whole run's measured peak (issue 38), for every
recipe in yamls/finetune/ at the sizes its 2-rank test runs it (tests/test_recipes_2rank.py:
a tiny model of the recipe's family saved as bf16 safetensors, its own precision, init mode,
LoRA, frozen base, offload and workers; 4 batches; CPU).

    python -m benchmarks.plan_vs_run [--recipes finetune/llama-lora.yaml ...] [--out FILE]
            [--data DIR]

Measured: ``memory/host_peak_gib_max`` from ``callbacks.memory_monitor`` (every rank's peak
RSS since its process started, loading included; the largest rank's), the largest reading of
the run. Planned: ``foundryx plan RECIPE OVERRIDES --gpus 2 --json``'s ``host.per_rank`` (on a
CPU device every term is host memory), with the same overrides. Prints a table of both, the
ratio and whether the plan is within 20% (issue 38's target). ``--data``: the quickstart data
there (built when absent) instead of a fresh copy.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.instruments.report_out import emit

ROOT = Path(__file__).resolve().parents[1]
GIB = 2**30


def measure(recipe: str, args: list[str], out: Path) -> float:
    from foundryx.loggers.jsonl import read_metrics

    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    metrics = out / "metrics-bench.jsonl"
    out.mkdir(parents=True, exist_ok=True)
    cmd = [str(Path(sys.executable).parent / "composer"), "-n", "2", "--stdout",
           f"{out}/rank{{rank}}.out", "--stderr", f"{out}/rank{{rank}}.err",
           str(ROOT / "train.py"), str(ROOT / "yamls" / recipe), *args,
           "callbacks.memory_monitor.interval=1", f"loggers.jsonl.path={metrics}"]
    proc = subprocess.run(cmd, cwd=out, env=env, capture_output=True, text=True, timeout=900)
    if proc.returncode:
        err = "".join(p.read_text()[-3000:] for p in sorted(out.glob("rank*.err")))
        raise SystemExit(f"{recipe} failed:\n{err}")
    return max(r["memory/host_peak_gib_max"] for r in read_metrics(metrics)
               if "memory/host_peak_gib_max" in r)


def plan(recipe: str, args: list[str]) -> dict:
    cmd = [str(Path(sys.executable).parent / "foundryx"), "plan", str(ROOT / "yamls" / recipe),
           *args, "--gpus", "2", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, check=False)
    if r.returncode not in (0, 1):
        raise SystemExit(f"plan of {recipe} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout)["host"]


def main() -> None:
    from benchmarks.instruments.recipe_sizes import RECIPES, overrides, tiny_llama, tiny_mpt_export

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--recipes", nargs="+",
                    default=sorted(r for r in RECIPES if r.startswith("finetune/")))
    ap.add_argument("--out", type=Path)
    ap.add_argument("--data", type=Path, help="the quickstart data (default: built afresh)")
    args = ap.parse_args()
    unknown = sorted(set(args.recipes) - set(RECIPES))
    if unknown:
        ap.error(f"--recipes: not a recipe with test sizes: {', '.join(unknown)}; known: "
                 + ", ".join(sorted(r for r in RECIPES if r.startswith("finetune/"))))
    import torch

    from foundryx.data.quickstart import prepare_quickstart

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_quickstart(args.data or Path(tmp) / "qs", progress=False)
        tok = data / "tokenizer"
        models = {}  # the tiny model of each family the recipes fine-tune
        for family in sorted({RECIPES[r][0] for r in args.recipes}):
            models[family] = (tiny_mpt_export(Path(tmp) / family, tok) if family == "mpt"
                              else tiny_llama(family, Path(tmp) / family, tok))
        for recipe in args.recipes:
            ov = overrides(recipe, models, data)
            measured = measure(recipe, ov, Path(tmp) / recipe.replace("/", "_"))
            host = plan(recipe, ov)
            planned = host["per_rank"] / GIB
            rows.append((recipe, planned, host["load_per_rank"] / GIB, host["train_per_rank"] / GIB,
                         measured))
            print(json.dumps({"recipe": recipe, "planned_gib": planned, "measured_gib": measured,
                              "terms": host["terms"]}), flush=True)
    table = "\n".join(
        f"| {r} | {p:.3f} | {ld:.3f} | {tr:.3f} | {m:.3f} | {p / m:.2f} | "
        f"{'yes' if abs(p / m - 1) <= 0.2 else 'NO'} |" for r, p, ld, tr, m in rows)
    text = (f"\n### Planned host memory per rank vs a whole run's measured peak (issue 38)\n\n"
            f"{datetime.date.today()}. {platform.machine()}, {os.cpu_count()} cores, torch "
            f"{torch.__version__}. Command: `python -m benchmarks.plan_vs_run`. 2 CPU ranks, each "
            f"recipe at its 2-rank test's sizes (tests/test_recipes_2rank.py), 4 batches.\n\n"
            f"| recipe | planned GiB per rank | of which: load | train | measured peak GiB "
            f"(largest rank) | planned / measured | within 20% |\n"
            f"|---|---:|---:|---:|---:|---:|---|\n{table}\n")
    emit(text, args.out)


if __name__ == "__main__":
    main()
