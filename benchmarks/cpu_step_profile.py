"""One LoRA step on the CPU, foundryx beside plain transformers + peft, profiled (issue 46,
item 3): where foundryx's per-step time goes that the peer's does not.

    python benchmarks/cpu_step_profile.py --out cpu-profile.md             # all variants
    python benchmarks/cpu_step_profile.py --variants blas-bf16 --steps 4 --out p.md

The model: a Llama of hidden 512, 8 layers (``SHAPE``: 8 heads, 2 KV heads, FFN 1792, vocab
16384: the 8B's proportions), random bf16 weights written once as a model folder under
``--cache`` (benchmarks/flagship.py's writer; nothing is downloaded). The work: ``--batch``
x ``--seq`` random tokens per step, LoRA r8 / alpha 16 / dropout 0.05 on all linear layers,
activation checkpointing on every layer, fp32, one process, AdamW lr 2e-4, one optimizer
step per batch: the issue's GPU comparison at a CPU's size.

Each side runs in a process of its own, the sides alternating, ``--rounds`` times:

- ``peer``: benchmarks/peer_lora.py's method on the CPU (the model in fp32, ``model.train()``,
  ``gradient_checkpointing_enable(use_reentrant=False)``, ``get_peft_model``, unfused AdamW);
- foundryx: ``foundryx train`` of the flagship recipe (yamls/finetune/llama-8b-lora-fp8.yaml:
  init_device meta, FSDP2 on a one-rank mesh, activation checkpointing, gradient clipping)
  on the same folder, device cpu, fp32, with the variant's ``compile``, ``cpu_matmul`` and
  ``frozen_base`` (``blas-bf16``: compile off, ``cpu_matmul: blas``, a bf16 frozen base, as
  the GPU run; ``blas-none``: the same without ``frozen_base``; ``blas-none-peft``: that with
  PEFT's own LoRA layer, ``peft_config.one_pass: false``; ``defaults-bf16``: compile and
  ``cpu_matmul`` as they ship).

A step's time is wall time from one step's end to the next's (foundryx: Composer's
``BATCH_END``, so its per-batch work is in it); steps 2..N are kept. Step ``--profile-step``
(default: the last) runs under ``torch.profiler`` on the CPU, and its per-operator self time
is compared operator by operator with the peer's profiled step. The markdown file has the
step times, the ratios and the table of the largest differences; ``--json`` the raw figures.
Timings on a shared 2-core machine are noisy: alternate rounds and compare medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

SHAPE = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 16384,
         "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
         "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
         "hidden_size": 512, "num_hidden_layers": 8, "num_attention_heads": 8,
         "num_key_value_heads": 2, "intermediate_size": 1792}
R, ALPHA, DROPOUT = 8, 16, 0.05
VARIANTS = {  # name: foundryx overrides beyond the common ones
    "blas-bf16": ["compile.enabled=false", "cpu_matmul=blas", "model.frozen_base.dtype=bf16"],
    "blas-none": ["compile.enabled=false", "cpu_matmul=blas", "model.frozen_base=null"],
    # PEFT's own LoRA layer instead of the one-pass adapter path (issue 51)
    "blas-none-peft": ["compile.enabled=false", "cpu_matmul=blas", "model.frozen_base=null",
                       "model.peft_config.one_pass=false"],
    "defaults-bf16": ["model.frozen_base.dtype=bf16"],
}
TOP = 40  # operators kept per profile


def ensure_folder(cache: Path) -> Path:
    from flagship import ensure_model

    shape = cache / "shape-llama-h512-l8"
    shape.mkdir(parents=True, exist_ok=True)
    (shape / "config.json").write_text(json.dumps(SHAPE, indent=2))
    folder = cache / "llama-h512-l8-bf16"
    ensure_model(shape, folder, "cpu")
    return folder


def weight_shapes() -> set[tuple[int, ...]]:
    """The frozen linear weights' shapes (a copy of one of these is a weight cast)."""
    d, f = SHAPE["hidden_size"], SHAPE["intermediate_size"]
    kv = d // SHAPE["num_attention_heads"] * SHAPE["num_key_value_heads"]
    return {(d, d), (kv, d), (f, d), (d, f)}


GEMMS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "mkldnn::_linear_pointwise",
         "foundryx::onednn_mm", "aten::mkldnn_linear")
COPIES = ("aten::copy_", "aten::_to_copy", "aten::clone", "aten::contiguous")


def category(event, weights: set) -> str:
    """Which part of a step one profiled operator's self time belongs to."""
    names, e = [], event
    while e is not None:
        names.append(e.name)
        e = e.cpu_parent
    name = event.name
    # (Composer runs forward and backward in the closure it hands Optimizer.step: the step's
    # record is an ancestor of every op there, so only zero_grad is told apart by ancestry)
    if any(n.startswith("Optimizer.zero_grad") for n in names):
        return "optimizer zero_grad"
    if name in GEMMS:
        return "GEMMs"
    if "scaled_dot_product" in name:
        return "attention (SDPA)"
    if name in COPIES:
        shapes = getattr(event, "input_shapes", None) or []
        if any(tuple(s) in weights for s in shapes if s):
            return "weight-sized copies (frozen base cast)"
        return "other copies and casts"
    if "bernoulli" in name or "dropout" in name:
        return "dropout"
    if "softmax" in name or "nll" in name or "cross_entropy" in name:
        return "loss (log-softmax, NLL)"
    if name.startswith(("aten::", "mkldnn::", "foundryx::")):
        return "other aten ops"
    return "records' own time (Python between ops; foundryx's under Optimizer.step)"


def op_table(prof) -> dict:
    """Every operator's calls, self and total CPU microseconds in a profile, and the self time
    by :func:`category`."""
    from collections import defaultdict

    weights = weight_shapes()
    cats: dict = defaultdict(float)
    for e in prof.events():
        cats[category(e, weights)] += e.self_cpu_time_total
    return {"ops": [{"op": e.key, "calls": e.count, "self_us": e.self_cpu_time_total,
                     "total_us": e.cpu_time_total} for e in prof.key_averages()],
            "categories": dict(cats)}


def profiler():
    from torch.profiler import ProfilerActivity, profile

    return profile(activities=[ProfilerActivity.CPU], record_shapes=True)


# ---------------------------------------------------------------------------------------
# The peer: a plain training loop
# ---------------------------------------------------------------------------------------
def run_peer(a: argparse.Namespace, folder: Path) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    model.train()
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model = get_peft_model(model, LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=DROPOUT,
                                             target_modules="all-linear", task_type="CAUSAL_LM"))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, SHAPE["vocab_size"], (a.steps, a.batch, a.seq), generator=g)
    seconds, cpu, losses, ops, prof = [], [], [], None, None
    last, last_cpu = time.perf_counter(), time.process_time()
    for step in range(1, a.steps + 1):
        if step == a.profile_step:
            prof = profiler().__enter__()
        x = data[step - 1]
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        now, now_cpu = time.perf_counter(), time.process_time()
        seconds.append(now - last)
        cpu.append(now_cpu - last_cpu)
        last, last_cpu = now, now_cpu
        if prof is not None and step == a.profile_step:
            prof.__exit__(None, None, None)
            ops = op_table(prof)
    return {"seconds": seconds, "cpu_seconds": cpu, "losses": losses, "ops": ops}


# ---------------------------------------------------------------------------------------
# foundryx: `foundryx train` of the flagship recipe, timed and profiled from a callback
# ---------------------------------------------------------------------------------------
def run_foundryx(a: argparse.Namespace, folder: Path, variant: str) -> dict:
    from composer.core import Callback
    from flagship import RECIPE, synthetic_loader

    from foundryx import registry
    from foundryx.cli import main

    out: dict = {"seconds": [], "cpu_seconds": [], "ops": None}
    state = {"step": 0, "last": None, "last_cpu": None, "prof": None}

    class StepClock(Callback):
        """Wall time from one BATCH_END to the next; the profiler around step K."""

        def batch_end(self, _state, _logger) -> None:
            state["step"] += 1
            now, now_cpu = time.perf_counter(), time.process_time()
            if state["last"] is not None:
                out["seconds"].append(now - state["last"])
                out["cpu_seconds"].append(now_cpu - state["last_cpu"])
            state["last"], state["last_cpu"] = now, now_cpu
            if state["prof"] is not None:
                state["prof"].__exit__(None, None, None)
                out["ops"] = op_table(state["prof"])
                state["prof"] = None
            if state["step"] == a.profile_step - 1:
                state["prof"] = profiler().__enter__()

        def fit_start(self, _state, _logger) -> None:
            state["last"], state["last_cpu"] = time.perf_counter(), time.process_time()

    registry.dataloaders.register("synthetic", synthetic_loader, override=True)
    registry.callbacks.register("step_clock", StepClock, override=True)
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        argv = [RECIPE, f"variables.model_path={folder}", "variables.data_root=/nonexistent",
                f"variables.max_seq_len={a.seq}", "variables.run_name=cpu-step-profile",
                f"model.peft_config.r={R}", f"model.peft_config.lora_alpha={ALPHA}",
                f"model.peft_config.lora_dropout={DROPOUT}",
                "model.frozen_base.offload_fraction=0", "device=cpu", "precision=fp32",
                "train_loader.name=synthetic", "train_loader.num_workers=0", "eval_loader=null",
                "eval_first=false", f"device_train_microbatch_size={a.batch}",
                f"global_train_batch_size={a.batch}", f"max_duration={a.steps}ba",
                "scheduler.t_warmup=0ba", "save_folder=null", "progress_bar=false",
                "console_log_interval=1ba", f"loggers.jsonl.path={metrics}",
                "callbacks.step_clock={}", *VARIANTS[variant]]
        code = main(["train", *argv])
        rows = [json.loads(line) for line in metrics.read_text().splitlines()] \
            if metrics.is_file() else []
    if code:
        raise SystemExit(f"foundryx train exited {code}")
    out["losses"] = [r["loss/train/total"] for r in rows if "loss/train/total" in r]
    return out


# ---------------------------------------------------------------------------------------
# The comparison
# ---------------------------------------------------------------------------------------
def steady(seconds: list[float]) -> float:
    kept = seconds[1:] if len(seconds) > 1 else seconds
    return statistics.median(kept)


def op_diff(mine: list[dict], peer: list[dict], top: int = TOP) -> list[dict]:
    """Per operator: self milliseconds and calls on each side, the difference; the largest
    differences (either sign) first."""
    a = {r["op"]: r for r in mine}
    b = {r["op"]: r for r in peer}
    rows = []
    for op in set(a) | set(b):
        x, y = a.get(op, {}), b.get(op, {})
        rows.append({"op": op, "foundryx_ms": x.get("self_us", 0) / 1e3,
                     "peer_ms": y.get("self_us", 0) / 1e3, "foundryx_calls": x.get("calls", 0),
                     "peer_calls": y.get("calls", 0)})
    for r in rows:
        r["diff_ms"] = r["foundryx_ms"] - r["peer_ms"]
    rows.sort(key=lambda r: -abs(r["diff_ms"]))
    return rows[:top]


def render(a: argparse.Namespace, results: dict) -> str:
    import torch

    lines = [f"Command: `python benchmarks/cpu_step_profile.py {' '.join(sys.argv[1:])}`", "",
             f"torch {torch.__version__}, {os.cpu_count()} CPUs, {a.threads} thread(s) per "
             f"side. Llama h{SHAPE['hidden_size']} x {SHAPE['num_hidden_layers']} layers (FFN "
             f"{SHAPE['intermediate_size']}, vocab {SHAPE['vocab_size']}), {a.batch} x {a.seq} "
             f"tokens, LoRA r{R} all-linear, checkpointing, fp32. Per round: the median over "
             "steps 2..N of a step's wall seconds and of the process's CPU seconds (user + "
             "system, all threads: less sensitive to a busy machine); ratio = the peer's / "
             "foundryx's (> 1: foundryx faster).", "",
             "| side | wall s per step | CPU s per step | ratio, wall | ratio, CPU |",
             "|---|---|---|---|---|"]
    peer_w = [steady(r["seconds"]) for r in results["peer"]]
    peer_c = [steady(r["cpu_seconds"]) for r in results["peer"]]
    lines.append(f"| peer | {', '.join(f'{s:.2f}' for s in peer_w)} | "
                 f"{', '.join(f'{s:.2f}' for s in peer_c)} | 1 | 1 |")
    for v in a.variants:
        w = [steady(r["seconds"]) for r in results[v]]
        c = [steady(r["cpu_seconds"]) for r in results[v]]
        lines.append(f"| foundryx {v} | {', '.join(f'{s:.2f}' for s in w)} | "
                     f"{', '.join(f'{s:.2f}' for s in c)} | "
                     f"{', '.join(f'{p / m:.2f}' for p, m in zip(peer_w, w))} | "
                     f"{', '.join(f'{p / m:.2f}' for p, m in zip(peer_c, c))} |")
    sides = [s for s in ["peer", *a.variants] if results[s][-1].get("ops")]
    if sides:
        cats = sorted({c for s in sides for c in results[s][-1]["ops"]["categories"]})
        lines += ["", "### The profiled step by part (last round): self time, ms, and its "
                  "share of the step's profiled self time", "",
                  "| part | " + " | ".join(sides) + " |", "|---|" + "---:|" * len(sides)]
        totals = {s: sum(results[s][-1]["ops"]["categories"].values()) for s in sides}
        for c in sorted(cats, key=lambda c: -results[sides[0]][-1]["ops"]["categories"].get(c, 0)):
            cells = []
            for s in sides:
                us = results[s][-1]["ops"]["categories"].get(c, 0)
                cells.append(f"{us / 1e3:,.0f} ({100 * us / totals[s]:.1f}%)")
            lines.append(f"| {c} | " + " | ".join(cells) + " |")
        lines.append("| total | " + " | ".join(f"{totals[s] / 1e3:,.0f}" for s in sides) + " |")
    for v in a.variants:
        mine, theirs = results[v][-1]["ops"], results["peer"][-1]["ops"]
        if not mine or not theirs:
            continue
        lines += ["", f"### Profiled step, foundryx {v} against the peer (last round): the "
                  f"{TOP} operators whose self time differs most", "",
                  "| operator | foundryx ms (calls) | peer ms (calls) | difference ms |",
                  "|---|---:|---:|---:|"]
        for r in op_diff(mine["ops"], theirs["ops"]):
            lines.append(f"| `{r['op']}` | {r['foundryx_ms']:,.1f} ({r['foundryx_calls']}) | "
                         f"{r['peer_ms']:,.1f} ({r['peer_calls']}) | {r['diff_ms']:+,.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--profile-step", type=int, default=0, help="default: the last step")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each side")
    p.add_argument("--cache", type=Path,
                   default=Path.home() / ".cache" / "foundryx-bench")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--side", default=None, help=argparse.SUPPRESS)  # a child: one side
    p.add_argument("--result", type=Path, default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    a.profile_step = a.profile_step or a.steps
    folder = ensure_folder(a.cache)
    if a.side is not None:
        got = run_peer(a, folder) if a.side == "peer" else run_foundryx(a, folder, a.side)
        a.result.write_text(json.dumps(got))
        return 0
    results: dict = {s: [] for s in ["peer", *a.variants]}
    common = [f"--steps={a.steps}", f"--profile-step={a.profile_step}", f"--batch={a.batch}",
              f"--seq={a.seq}", f"--cache={a.cache}"]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": str(a.threads)}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(a.rounds):
            for side in results:
                result = Path(tmp) / f"{side}-{rnd}.json"
                start = time.perf_counter()
                subprocess.run([sys.executable, __file__, f"--side={side}", f"--result={result}",
                                *common], cwd=ROOT, check=True, env=env)
                got = json.loads(result.read_text())
                got["wall_s"] = time.perf_counter() - start
                results[side].append(got)
                print(f"round {rnd + 1} {side}: wall {[round(s, 2) for s in got['seconds']]}, "
                      f"CPU {[round(s, 2) for s in got['cpu_seconds']]}", flush=True)
    text = render(a, results)
    print(text)
    if a.out:
        a.out.write_text(text)
    if a.json:
        a.json.write_text(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
