"""Training throughput (tokens/s) and MFU through the real training path (`foundryx train`).

  python -m benchmarks.train_throughput cpu              # quickstart model, 1 and 2 processes
  python -m benchmarks.train_throughput gpu              # MPT-125M/350M/1B, seq 2048, bf16, on
                                                         # one GPU: each activation-checkpointing
                                                         # and compile setting
  python -m benchmarks.train_throughput gpu --models 1b --batches 40 --out results.json
  python -m benchmarks.train_throughput gpu --models 1b --settings compile sel-compile \
      fp8-rowwise --profile profiles/          # + one compiled step's top kernels per case

Each case is a separate run of this file as the training script (under the composer launcher
for several processes): it registers a ``synthetic`` dataloader (random tokens, for the GPU
cases, which have no 2048-token corpus offline) and calls ``foundryx train``. Tokens/s and
MFU are the speed_monitor's numbers, averaged over the batches after ``--warmup``:

    MFU = flops_per_batch / batch seconds / peak
    flops_per_batch = 3 * b * (2 * N * s + 4 * n_layers * d_model * s**2)   (MPT's, per device)

with N the parameters used in matmuls (foundryx/models/mpt/composer.py: every parameter but the
lookup tables), b the sequences of a batch, s its length, and the peak the GPU's dense bf16
FLOP/s from foundryx/runtime/devices.py (989e12 for an H100 SXM), also for the float8 settings (their
MFU is against the bf16 peak, so it can pass what bf16 allows). Settings (``--settings``):
{eager, compile} x {no AC, AC every block (``ac-``), selective AC (``sel-``)}, and compiled
float8 without AC (``fp8-rowwise``, ``fp8-tensorwise``; torchao, GPUs with FP8 tensor cores). A
case that fails (out of memory, float8 on a GPU without FP8) is a row that says so.
``--profile DIR`` profiles the last batch of each compiled case with torch.profiler (left out of
the average) and writes its top kernels by GPU time to DIR/<case>.txt and .json. The GPU cases
need only a tokenizer (the quickstart's, else a small BPE made once under
~/.cache/foundryx-bench); ``--settings eager`` runs only one setting. The CPU cases train the quickstart
on its generated data (``data/quickstart``, created if missing), each process with
``OMP_NUM_THREADS`` = cores / processes unless it is set.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
NO_AC, AC = ["activation_checkpointing.enabled=false"], ["activation_checkpointing.enabled=true"]
SELECTIVE = [*AC, "activation_checkpointing.mode=selective"]
EAGER, COMPILE = ["compile.enabled=false"], ["compile.enabled=true"]
GPU_SETTINGS = [  # (label, overrides)
    ("no AC, eager", NO_AC + EAGER),
    ("no AC, compile", NO_AC + COMPILE),
    ("AC every block, eager", AC + EAGER),
    ("AC every block, compile", AC + COMPILE),
    ("selective AC, eager", SELECTIVE + EAGER),
    ("selective AC, compile", SELECTIVE + COMPILE),
    ("no AC, compile, float8 rowwise", NO_AC + COMPILE + ["float8.enabled=true", "float8.recipe=rowwise"]),
    ("no AC, compile, float8 tensorwise", NO_AC + COMPILE + ["float8.enabled=true", "float8.recipe=tensorwise"]),
]
SETTING_KEYS = ["eager", "compile", "ac-eager", "ac-compile", "sel-eager", "sel-compile",
                "fp8-rowwise", "fp8-tensorwise"]  # --settings: GPU_SETTINGS in order
PROFILE_ROWS = 25
GPU_MICROBATCH = {"125m": 16, "350m": 16, "1b": 8}


def synthetic_loader(cfg, tokenizer, device_batch_size, **_):
    """Random token sequences of the run's max_seq_len (vocab of the tokenizer)."""
    import torch
    from composer.utils import dist
    from torch.utils.data import DataLoader

    seq = int(cfg["dataset"]["max_seq_len"])
    g = torch.Generator().manual_seed(dist.get_global_rank())
    data = torch.randint(0, len(tokenizer), (4096, seq), generator=g)
    return DataLoader([{"input_ids": row} for row in data], batch_size=device_batch_size,
                      drop_last=True)


def profile_callback(path: str, batch: int):
    """A Composer callback that profiles batch ``batch`` (0-based) with torch.profiler and
    writes its top kernels by GPU time to ``path``.txt and .json (small enough to bring back)."""
    from composer.core import Callback

    class ProfileStep(Callback):
        def __init__(self):
            self.prof = None

        def batch_start(self, state, logger):
            if int(state.timestamp.batch) == batch:
                import torch
                from torch.profiler import ProfilerActivity, profile

                gpu = torch.cuda.is_available()
                if gpu:
                    torch.cuda.synchronize()
                self.prof = profile(activities=[ProfilerActivity.CPU]
                                    + ([ProfilerActivity.CUDA] if gpu else []))
                self.prof.__enter__()

        def batch_end(self, state, logger):
            if self.prof is not None:
                import torch

                if torch.cuda.is_available():
                    torch.cuda.synchronize()
                self.prof.__exit__(None, None, None)
                write_profile(self.prof, Path(path))
                self.prof = None

    return ProfileStep()


def write_profile(prof, out: Path) -> None:
    """The top PROFILE_ROWS kernels (and ops) of a profile by self GPU time (on a CPU run, by
    self CPU time): text and JSON."""
    events = prof.key_averages()

    def device_us(e):  # torch >= 2.4 names it device time; older, cuda time
        return getattr(e, "self_device_time_total", None) or getattr(e, "self_cuda_time_total", 0)

    gpu_us = device_us if any(device_us(e) for e in events) else (lambda e: e.self_cpu_time_total)
    total = sum(gpu_us(e) for e in events) or 1
    top = sorted(events, key=gpu_us, reverse=True)[:PROFILE_ROWS]
    rows = [{"name": e.key[:120], "calls": e.count, "self_gpu_ms": round(gpu_us(e) / 1e3, 3),
             "share": round(gpu_us(e) / total, 4)} for e in top]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"total_gpu_ms": round(total / 1e3, 3),
                                                   "top": rows}, indent=1))
    lines = [f"one step: {total / 1e3:.1f} ms of GPU time (self time summed over kernels and ops)",
             f"{'share':>6} {'ms':>9} {'calls':>6}  name"]
    lines += [f"{100 * r['share']:5.1f}% {r['self_gpu_ms']:9.3f} {r['calls']:6d}  {r['name']}"
              for r in rows]
    out.with_suffix(".txt").write_text("\n".join(lines) + "\n")


def worker(argv: list[str]) -> int:
    from foundryx import registry
    from foundryx.cli import main

    registry.dataloaders.register("synthetic", synthetic_loader)
    if os.environ.get("FOUNDRYX_BENCH_PROFILE"):
        path, batch = os.environ["FOUNDRYX_BENCH_PROFILE"].rsplit("@", 1)
        registry.callbacks.register("bench_profile", lambda: profile_callback(path, int(batch)))
        argv = [*argv, "callbacks.bench_profile={}"]
    return main(["train", *argv])


def run_case(config: str, overrides: list[str], nproc: int, out: Path, warmup: int,
             profile: str | None = None) -> dict[str, float]:
    """tokens/s and MFU of one case; ``profile`` ("PATH@BATCH"): profile that batch (left out
    of the average). A failed case: NaNs and its error's last lines."""
    metrics = out / "metrics.jsonl"
    args = [config, *overrides, f"loggers.jsonl.path={metrics}", "save_folder=null",
            "eval_loader=null", "eval_first=false", "callbacks.speed_monitor.window_size=5",
            "console_log_interval=1000ba", "python_log_level=warning"]
    script = ["-m", "benchmarks.train_throughput", "--worker", *args]  # run in ROOT
    cmd = [str(BIN / "composer"), "-n", str(nproc), *script] if nproc > 1 else [sys.executable, *script]
    threads = str(max(1, (os.cpu_count() or 1) // nproc))  # no oversubscription on CPU
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads)}
    if profile:
        env["FOUNDRYX_BENCH_PROFILE"] = profile
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        print(f"case failed: {' '.join(cmd)}\n{r.stderr[-3000:]}", file=sys.stderr)
        lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
        return {"tokens_per_sec": float("nan"), "mfu": float("nan"),
                "error": (lines[-1] if lines else f"exit {r.returncode}")[:300]}
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
    if profile:  # the profiled (last) batch is out of the average
        last = max((r["batch"] for r in rows if "batch" in r), default=None)
        rows = [r for r in rows if r.get("batch") != last]
    return summarise(rows, warmup)


def summarise(rows: list[dict], warmup: int) -> dict[str, float]:
    """Mean tokens/s and MFU of the batches from ``warmup`` on."""
    tps = [r["throughput/tokens_per_sec"] for r in rows
           if "throughput/tokens_per_sec" in r and r["batch"] >= warmup]
    mfu = [r["throughput/device/mfu"] for r in rows
           if "throughput/device/mfu" in r and r["batch"] >= warmup]
    return {"tokens_per_sec": statistics.mean(tps) if tps else float("nan"),
            "mfu": statistics.mean(mfu) if mfu else float("nan")}


def cpu_cases(batches: int) -> list[tuple[str, str, list[str], int]]:
    data = ROOT / "data" / "quickstart"
    if not (data / "mds").is_dir():
        from foundryx.data.quickstart import prepare_quickstart

        prepare_quickstart(data)
    base = [f"variables.data_root={data}", f"max_duration={batches}ba", "device=cpu"]
    return [("quickstart, 1 process", "yamls/quickstart.yaml", base, 1),
            ("quickstart, 2 processes, DDP", "yamls/quickstart.yaml", base, 2),
            ("quickstart, 2 processes, FSDP2", "yamls/quickstart.yaml", base + ["parallelism={}"], 2)]


def gpu_tokenizer() -> Path:
    """A tokenizer for the random tokens: the quickstart's when it is there, else a small BPE
    trained here once (no corpus conversion: the GPU cases need nothing else of the data)."""
    quickstart = ROOT / "data" / "quickstart" / "tokenizer"
    if quickstart.is_dir():
        return quickstart
    out = Path.home() / ".cache" / "foundryx-bench" / "bpe-1024"
    if not (out / "tokenizer.json").is_file():
        from foundryx.data.synthetic import generate_corpus
        from foundryx.data.tokenizers import train_bpe_tokenizer

        train_bpe_tokenizer(generate_corpus(300, seed=1), vocab_size=1024, out_dir=out)
    return out


def gpu_cases(models: list[str], batches: int, settings: list[str] | None = None,
              attn: str | None = None, micro_batch: int | None = None,
              ) -> list[tuple[str, str, list[str], int]]:
    tokenizer = gpu_tokenizer()
    chosen = [GPU_SETTINGS[SETTING_KEYS.index(k)] for k in settings] if settings else GPU_SETTINGS
    cases = []
    for m in models:
        micro = micro_batch or GPU_MICROBATCH[m]
        base = [f"variables.tokenizer_name={tokenizer}", "train_loader.name=synthetic",
                f"max_duration={batches}ba", f"global_train_batch_size={micro}",
                f"device_train_microbatch_size={micro}", "device=gpu", "precision=amp_bf16"]
        if attn:
            base.append(f"model.attn_config.attn_impl={attn}")
        cases += [(f"MPT-{m.upper()}, {label}", f"yamls/mpt-{m}.yaml", base + extra, 1)
                  for label, extra in chosen]
    return cases


def profile_name(case: str) -> str:
    """A file name for a case's profile: "MPT-1B, no AC, compile" -> "mpt-1b-no-ac-compile"."""
    return "-".join("".join(c if c.isalnum() else " " for c in case.lower()).split())



def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2:]))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["cpu", "gpu"])
    p.add_argument("--models", nargs="+", default=["125m", "350m", "1b"], choices=list(GPU_MICROBATCH))
    p.add_argument("--batches", type=int, default=None, help="batches per case (cpu 40, gpu 30)")
    p.add_argument("--warmup", type=int, default=10, help="batches left out of the average")
    p.add_argument("--settings", nargs="+", choices=SETTING_KEYS, default=None,
                   help="gpu: only these settings (default all: {no AC, AC every block, selective "
                        "AC} x {eager, compile}, and compiled float8 rowwise / tensorwise)")
    p.add_argument("--attn", choices=["torch", "triton", "flash", "auto"], default=None,
                   help="gpu: model.attn_config.attn_impl (default: the yamls', torch)")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="gpu: sequences per step (default 125m/350m 16, 1b 8)")
    p.add_argument("--profile", type=Path, metavar="DIR",
                   help="gpu: profile the last batch of each compiled case; top kernels to DIR")
    p.add_argument("--out", type=Path, help="also write the results as JSON")
    args = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    batches = args.batches or (40 if args.mode == "cpu" else 30)
    cases = (cpu_cases(batches) if args.mode == "cpu"
             else gpu_cases(args.models, batches, args.settings, args.attn, args.micro_batch))
    from tqdm import tqdm

    results = []
    for label, config, overrides, nproc in tqdm(cases, desc="cases"):
        profile = None
        if args.profile and "compile.enabled=true" in overrides:
            profile = f"{args.profile / profile_name(label)}@{batches - 1}"
        with tempfile.TemporaryDirectory() as tmp:
            row = run_case(config, overrides, nproc, Path(tmp), args.warmup, profile)
        micro = next((o.split("=")[1] for o in overrides if o.startswith("device_train_micro")), None)
        results.append({"case": label, **row, **({"micro_batch": int(micro)} if micro else {})})
    base = results[0]["tokens_per_sec"]
    print("\n| case | tokens/s | vs first | MFU |\n|---|---|---|---|")
    for r in results:
        mfu = "n/a" if r["mfu"] != r["mfu"] else f"{100 * r['mfu']:.1f}%"
        tps = "n/a" if r["tokens_per_sec"] != r["tokens_per_sec"] else f"{r['tokens_per_sec']:,.0f}"
        ratio = r["tokens_per_sec"] / base
        print(f"| {r['case']} | {tps} | {'n/a' if ratio != ratio else f'{ratio:.2f}x'} | {mfu} |"
              + (f" {r['error']}" if "error" in r else ""))
    if args.mode == "gpu":
        print("\nMFU = flops_per_batch / batch seconds / peak (the speed monitor's); flops_per_batch "
              "= 3 * b * (2 * N * s + 4 * n_layers * d_model * s^2), N the matmul parameters; peak: "
              "the GPU's dense bf16 FLOP/s (foundryx/runtime/devices.py), float8 settings included.")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
