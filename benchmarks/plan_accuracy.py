"""The planner's per-device estimate against the peak memory measured on CPU runs of a small
MPT: full fine-tuning, LoRA, LoRA over an int8 and an FP8 frozen base, each with activation
checkpointing off and on, on 1 and 2 processes (FSDP2 over gloo), each configuration in a fresh
process (``torchrun``); and ``foundryx plan --search microbatch`` against a bisection of the
microbatch by real runs under a memory cap.

    nice .venv/bin/python -m benchmarks.plan_accuracy [--procs 1 2] [--cases ...] [--steps 2]
        [--search-cap-mb N] [--out results.jsonl]

Each case is a run config (YAML) that both sides read: the worker builds it the way ``foundryx
train`` does (``builders.build_model`` with ``peft_config`` / ``frozen_base``, then
``build_parallelism``: FSDP2 and activation checkpointing, then ``build_optimizer``) and runs
``--steps`` training steps of ``model.loss(model(batch), batch)``, backward and AdamW; the
planner plans the same file for a CPU device (``make_plan(..., gpu="cpu")``, ``foundryx plan
--gpu cpu``: no CUDA context, no caching-allocator margin). The runs use ``cpu_matmul: blas``
(torch's own matmuls), as the planner models a GPU's memory, not oneDNN's CPU buffers.

Measured memory is the finetune_memory.py measure: the rise of the process's peak RSS
(``VmHWM``) over its RSS before the model was built, with the peak reset
(``/proc/self/clear_refs``) after the model is built, sharded and the optimizer made, after
``malloc_trim``, and glibc serving blocks >= 64 KiB with mmap, so freed tensors leave RSS. For 2
processes the larger rank's.

The microbatch search: a cap of ``--search-cap-mb`` MB per process; a microbatch "fits" when
its measured peak is at most the cap. The bisection over 1..``--search-max`` runs one fresh
process per probe; the planner's answer is ``largest_microbatch`` planned with
``--gpu-memory <cap>MB`` on a CPU device.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

MODEL = {"name": "mpt_causal_lm", "d_model": 256, "n_heads": 4, "n_layers": 4, "expansion_ratio": 4,
         "max_seq_len": 256, "vocab_size": 8192, "attn_config": {"attn_impl": "torch", "rope": True},
         "norm_type": "rmsnorm", "ffn_config": {"ffn_type": "swiglu"}, "no_bias": True}
SEQ = 256
MICROBATCH = 2  # per rank
LORA = {"target_modules": "all-linear", "r": 16, "lora_alpha": 32}
CASES = {  # name: (model additions, activation checkpointing)
    "full": ({}, False),
    "full-ac": ({}, True),
    "lora": ({"peft_config": LORA}, False),
    "lora-ac": ({"peft_config": LORA}, True),
    "lora-int8": ({"peft_config": LORA, "frozen_base": {"dtype": "int8"}}, False),
    "lora-int8-ac": ({"peft_config": LORA, "frozen_base": {"dtype": "int8"}}, True),
    "lora-fp8": ({"peft_config": LORA, "frozen_base": {"dtype": "fp8"}}, False),
    "lora-fp8-ac": ({"peft_config": LORA, "frozen_base": {"dtype": "fp8"}}, True),
}
# A model with next to no tensors: what its training step adds is the CPU runtime's own memory
# (compute-library buffers, thread arenas), the planner's CPU `context`.
TINY = {"d_model": 64, "n_heads": 4, "n_layers": 1, "vocab_size": 256}
EXTRA_CASES = {"tiny": (TINY, False)}
MB = 2**20


def write_config(folder: Path, case: str, procs: int, microbatch: int = MICROBATCH) -> Path:
    import yaml

    extra, ac = {**CASES, **EXTRA_CASES}[case]
    cfg = {
        "max_seq_len": SEQ, "seed": 0,
        "model": {**MODEL, **extra},
        "tokenizer": {"name": "hf", "path": "not/needed"},
        "train_loader": {"name": "text", "dataset": {"local": "not/needed", "split": "train",
                                                     "max_seq_len": SEQ}},
        "max_duration": "10ba", "global_train_batch_size": microbatch * procs,
        "device_train_microbatch_size": microbatch,
        "optimizer": {"name": "decoupled_adamw", "lr": 1e-4},
        "precision": "fp32", "device": "cpu", "compile": False,
        # torch's BLAS: oneDNN's own buffers (primitive cache, GEMM packing; 8-20 MiB more
        # here, RESULTS.md) are a CPU-only cost the planner does not model
        "cpu_matmul": "blas",
        "parallelism": {"sharding_strategy": "FULL_SHARD"},
        "activation_checkpointing": ac,
    }
    path = folder / f"{case}-p{procs}-mb{microbatch}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def rss_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(field)


def worker(config: str, steps: int) -> None:
    import torch
    import torch.distributed as dist

    from foundryx import builders
    from foundryx.config.load import load_config

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    cfg = load_config(config, world_size=world, component_sections=("model", "optimizer")).cfg
    with torch.device("meta"):  # loads the code the build needs (registries, peft, torchao)
        builders.build_optimizer(cfg, builders.build_model(cfg, None))
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc_trim(0)
    before = rss_mb("VmRSS")
    torch.manual_seed(0)
    model = builders.build_model(cfg, None)
    model = builders.build_parallelism(cfg, model)
    opt = builders.build_optimizer(cfg, model)
    mb = cfg.device_train_microbatch_size
    gen = torch.Generator().manual_seed(dist.get_rank() if world > 1 else 0)
    ids = torch.randint(0, cfg.model["vocab_size"], (mb, SEQ), generator=gen)
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    libc.malloc_trim(0)
    built = rss_mb("VmRSS") - before
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    start = time.perf_counter()
    for _ in range(steps):
        loss = model.loss(model(batch), batch)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    result = {"peak_mb": round(rss_mb("VmHWM") - before, 1), "built_mb": round(built, 1),
              "loss": round(loss.item(), 4), "s": round(time.perf_counter() - start, 1)}
    if world > 1:
        everyone: list = [None] * world
        dist.all_gather_object(everyone, result)
        result["peak_mb_per_rank"] = [r["peak_mb"] for r in everyone]
        result["peak_mb"] = max(result["peak_mb_per_rank"])
        dist.destroy_process_group()
        if int(os.environ["RANK"]):
            return
    print("RESULT " + json.dumps(result), flush=True)


def measure(config: Path, procs: int, steps: int) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536",
           "OMP_NUM_THREADS": str(max(1, 2 // procs)), "FOUNDRYX_COMPILE": "0"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={procs}", "-m", "benchmarks.plan_accuracy", "--worker", str(config),
           "--steps", str(steps)]
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode or not lines:
        raise SystemExit(f"{config.name} on {procs} process(es) failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def plan(config: Path, procs: int, cap_mb: float | None = None):
    from foundryx.plan.planner import make_plan

    memory = f"{cap_mb}MiB" if cap_mb else None
    return make_plan(config, gpus=procs, gpu="cpu", gpu_memory=memory)


def compare(folder: Path, cases: list[str], procs_list: list[int], steps: int, out: str | None) -> list[dict]:
    rows = []
    for procs in procs_list:
        for case in cases:
            path = write_config(folder, case, procs)
            p = plan(path, procs)
            m = measure(path, procs, steps)
            est = p.per_device_bytes / MB
            row = {"case": case, "procs": procs, "measured_mb": m["peak_mb"],
                   "estimate_mb": round(est, 1),
                   "error": round((est - m["peak_mb"]) / m["peak_mb"], 4),
                   "terms_mb": {k: round(v / MB, 1) for k, v in p.terms.items() if v},
                   "measured": m}
            rows.append(row)
            print(json.dumps(row), flush=True)
            if out:
                with open(out, "a") as f:
                    f.write(json.dumps(row) + "\n")
    return rows


def search(folder: Path, case: str, procs: int, cap_mb: float, upper: int, steps: int,
           out: str | None) -> dict:
    """Bisection of the microbatch by real runs: the largest in 1..upper whose measured peak is
    at most ``cap_mb``; and the planner's answer for the same cap."""
    probes: dict[int, float] = {}

    def fits(mb: int) -> bool:
        probes[mb] = measure(write_config(folder, case, procs, mb), procs, steps)["peak_mb"]
        print(json.dumps({"probe": mb, "peak_mb": probes[mb], "cap_mb": cap_mb}), flush=True)
        return probes[mb] <= cap_mb

    lo, hi = 0, upper  # invariant: lo fits (0: nothing known to fit), hi+1 does not
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    planned = plan(write_config(folder, case, procs, 1), procs, cap_mb).largest_microbatch
    row = {"search": case, "procs": procs, "cap_mb": cap_mb, "measured_largest": lo,
           "planned_largest": planned, "probes_mb": probes}
    print(json.dumps(row), flush=True)
    if out:
        with open(out, "a") as f:
            f.write(json.dumps(row) + "\n")
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--cases", nargs="*", default=[*CASES, *EXTRA_CASES])
    ap.add_argument("--search-case", default="lora")
    ap.add_argument("--search-cap-mb", type=float, default=0, help="0: no microbatch search")
    ap.add_argument("--search-max", type=int, default=16)
    ap.add_argument("--out", default=None, help="append each result as a JSON line here")
    args = ap.parse_args()
    if args.worker:
        return worker(args.worker, args.steps)
    with tempfile.TemporaryDirectory() as tmp:
        rows = compare(Path(tmp), args.cases, args.procs, args.steps, args.out)
        if rows:
            print("\n| case | processes | measured peak (MiB) | planner (MiB) | error |")
            print("|---|---|---|---|---|")
            for r in rows:
                label = r["case"] + (" (calibrates the CPU context)" if r["case"] in EXTRA_CASES else "")
                print(f"| {label} | {r['procs']} | {r['measured_mb']:.1f} | "
                      f"{r['estimate_mb']:.1f} | {r['error']:+.1%} |")
            errors = [abs(r["error"]) for r in rows if r["case"] in CASES]
            if errors:
                worst = max(errors)
                print(f"\nworst error: {worst:.1%} ({'within' if worst <= 0.15 else 'OUTSIDE'} 15%)")
        if args.search_cap_mb:
            search(Path(tmp), args.search_case, 1, args.search_cap_mb, args.search_max,
                   args.steps, args.out)


if __name__ == "__main__":
    main()
