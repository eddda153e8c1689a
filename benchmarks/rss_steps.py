"""Host memory per rank, step by step, over a long run (issue 38): does a run's RSS stay flat
after its first steps?

    python -m benchmarks.rss_steps [--steps 200] [--configs fp8-offload0.55 ...]
            [--hidden 512] [--layers 4] [--host-heap auto|bounded|glibc] [--out FILE]
            [--data DIR] [--images DIR]

Each configuration is a real run on 2 CPU ranks (``composer -n 2 train.py RECIPE``), the
shipped recipe with only model, data, sizes, device and precision overridden:
``yamls/finetune/llama-3.1-405b-lora-fp8.yaml`` on a Llama of ``--hidden`` x ``--layers`` saved as
bf16 safetensors (LoRA over an FP8, NF4 or bf16 base, offload 0.55 as shipped or 0), and the
quickstart (``yamls/quickstart.yaml``, MPT pretraining). ``callbacks.memory_monitor`` logs every
rank's host RSS after every batch (``memory/host_rss_gib/rank<r>``). Printed per configuration
and rank (:func:`growth`): RSS at step 10 and at the end; the growth after step 10 (the issue's
target: at most 1%) three ways: the median RSS of the last 50 steps over that of steps 11-60
(a trend), the largest of the last 50 over the largest of steps 11-60 (the envelope), and the
largest after step 10 over the RSS at step 10 (which a step's transient allocations alone can
raise); and the peak. A plot of RSS against step, one line per rank, is written to
benchmarks/images/rss-steps.png (``--images``: another folder). ``--data``: the quickstart data
there (built when absent) instead of a fresh copy. Its test runs 11 steps of one configuration
on a 1-layer model: a look at the code path, not a measure of growth.
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
RECIPE = "yamls/finetune/llama-3.1-405b-lora-fp8.yaml"
CONFIGS = {  # name: (recipe, overrides)
    "fp8-offload0.55": (RECIPE, []),
    "fp8-offload0": (RECIPE, ["model.frozen_base.offload_fraction=0"]),
    "nf4-offload0.55": (RECIPE, ["model.frozen_base.dtype=nf4"]),
    "bf16-offload0": (RECIPE, ["model.frozen_base.dtype=bf16", "model.frozen_base.offload_fraction=0"]),
    "quickstart": ("yamls/quickstart.yaml", []),
}
FROM = 10  # growth is measured from this step on


def growth(rss: list[float]) -> dict[str, float]:
    """The growth of ``rss`` (one reading per step) after step FROM, in % (module docstring)."""
    import statistics

    early, late = rss[FROM:FROM + 50], rss[-50:]
    return {"median": 100 * (statistics.median(late) / statistics.median(early) - 1),
            "envelope": 100 * (max(late) / max(early) - 1),
            "largest": 100 * (max(rss[FROM - 1:]) / rss[FROM - 1] - 1)}


def llama(out: Path, tokenizer: Path, hidden: int, layers: int) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    cfg = AutoConfig.for_model("llama", hidden_size=hidden, intermediate_size=3 * hidden,
                               num_hidden_layers=layers, num_attention_heads=hidden // 64,
                               num_key_value_heads=max(1, hidden // 256),
                               max_position_embeddings=512, vocab_size=1024)
    AutoModelForCausalLM.from_config(cfg).to(torch.bfloat16).save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer).save_pretrained(out)
    return out


def run(name: str, model: Path, data: Path, out: Path, steps: int,
        heap: str = "auto") -> list[dict]:
    recipe, extra = CONFIGS[name]
    common = [f"max_duration={steps}ba", f"host_heap={heap}", "global_train_batch_size=2",
              "device_train_microbatch_size=1", "device=cpu", "save_folder=null",
              "eval_loader=null", "eval_interval=100000ba", "console_log_interval=50ba",
              "callbacks.memory_monitor.interval=1", f"loggers.jsonl.path={out}/metrics.jsonl",
              "progress_bar=false"]
    if recipe == RECIPE:
        args = [f"variables.model_path={model}", f"variables.data_root={data}",
                "variables.max_seq_len=128", "precision=fp32", *common, *extra]
    else:
        args = [f"variables.data_root={data}", *common, *extra]
    out.mkdir(parents=True, exist_ok=True)
    cmd = [str(Path(sys.executable).parent / "composer"), "-n", "2", "--stderr",
           str(out / "rank{rank}.err"), "--stdout", str(out / "rank{rank}.out"),
           str(ROOT / "train.py"), str(ROOT / recipe), *args]
    r = subprocess.run(cmd, cwd=out, capture_output=True, text=True, check=False)
    if r.returncode:
        err = "".join(p.read_text()[-3000:] for p in sorted(out.glob("rank*.err")))
        raise SystemExit(f"{name} failed:\n{r.stderr[-2000:]}\n{err}")
    from foundryx.loggers.jsonl import read_metrics

    return [row for row in read_metrics(out / "metrics.jsonl") if "memory/host_rss_gib/rank0" in row]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--host-heap", default="auto", choices=["auto", "bounded", "glibc"],
                    help="the runs' host_heap (auto: glibc on a CPU device)")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--data", type=Path, help="the quickstart data (default: built afresh)")
    ap.add_argument("--images", type=Path, default=ROOT / "benchmarks" / "images",
                    help="the folder the plot is written to")
    args = ap.parse_args()
    if args.steps <= FROM:
        ap.error(f"--steps must be more than {FROM} (growth is measured after step {FROM})")
    import torch

    from foundryx.data.quickstart import prepare_quickstart

    curves, table = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        data = prepare_quickstart(args.data or Path(tmp) / "qs", progress=False)
        model = llama(Path(tmp) / "llama", data / "tokenizer", args.hidden, args.layers)
        for name in args.configs:
            rows = run(name, model, data, Path(tmp) / name, args.steps, args.host_heap)
            for rank in (0, 1):
                rss = [row[f"memory/host_rss_gib/rank{rank}"] for row in rows]
                peak = max(row[f"memory/host_peak_gib/rank{rank}"] for row in rows)
                curves[(name, rank)] = rss
                g = growth(rss)
                table.append((name, rank, rss[FROM - 1], rss[-1], g, peak))
                print(json.dumps({"config": name, "rank": rank, f"rss_step{FROM}": rss[FROM - 1],
                                  "rss_end": rss[-1], "growth_pct": g, "peak": peak,
                                  "rss": [round(x, 4) for x in rss]}), flush=True)
    image = "rss-steps.png" if args.host_heap == "auto" else f"rss-steps-{args.host_heap}.png"
    _plot(curves, args.images / image)
    cmd = (f"python -m benchmarks.rss_steps --steps {args.steps} --hidden {args.hidden} "
           f"--layers {args.layers} --host-heap {args.host_heap}")
    rows = "\n".join(f"| {n} | {r} | {a:.3f} | {b:.3f} | {g['median']:+.2f}% | {g['envelope']:+.2f}% "
                     f"| {g['largest']:+.2f}% | {p:.3f} |" for n, r, a, b, g, p in table)
    text = (f"\n### Host RSS per rank over {args.steps} steps (issue 38)\n\n"
            f"{datetime.date.today()}. {platform.machine()}, {os.cpu_count()} cores, torch "
            f"{torch.__version__}. Command: `{cmd}`. 2 CPU ranks, global batch 2, microbatch 1, "
            f"max_seq_len 128 (the quickstart: its own), fp32. Growth after step {FROM} (see "
            f"the script): median = median of the last 50 steps over that of steps 11-60; "
            f"envelope = their largest readings; largest = the largest after step {FROM} over "
            f"step {FROM}'s reading.\n\n| config | rank | RSS step {FROM} GiB | RSS end GiB | "
            f"median | envelope | largest | peak GiB |\n|---|---:|---:|---:|---:|---:|---:|---:|\n"
            f"{rows}\n\n![RSS per step](images/{image})\n")
    emit(text, args.out)


def _plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for (name, rank), rss in curves.items():
        ax.plot(range(1, len(rss) + 1), rss, label=f"{name} rank {rank}",
                linestyle="-" if rank == 0 else "--")
    ax.axvline(FROM, color="grey", linewidth=0.5)
    ax.set_xlabel("step")
    ax.set_ylabel("host RSS per rank (GiB)")
    ax.set_title("Host memory per rank over a run (2 CPU ranks)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    main()
