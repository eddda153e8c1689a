"""Training throughput (tokens/s) and MFU through the real training path (`foundryx train`).

  python benchmarks/train_throughput.py cpu              # quickstart model, 1 and 2 processes
  python benchmarks/train_throughput.py gpu              # MPT-125M/350M/1B, seq 2048, bf16, on
                                                         # one GPU: each activation-checkpointing
                                                         # and compile setting
  python benchmarks/train_throughput.py gpu --models 1b --batches 40 --out results.json

Each case is a separate run of this file as the training script (under the composer launcher
for several processes): it registers a ``synthetic`` dataloader (random tokens, for the GPU
cases, which have no 2048-token corpus offline) and calls ``foundryx train``. Tokens/s and
MFU are the speed_monitor's numbers (MFU = model FLOPs per second / the GPU's peak dense bf16
FLOP/s from foundryx/devices.py), averaged over the batches after ``--warmup``. The GPU cases
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
GPU_SETTINGS = [  # (label, overrides)
    ("no AC, eager", ["activation_checkpointing.enabled=false", "compile.enabled=false"]),
    ("no AC, compile", ["activation_checkpointing.enabled=false", "compile.enabled=true"]),
    ("AC every block, eager", ["activation_checkpointing.enabled=true", "compile.enabled=false"]),
    ("AC every block, compile", ["activation_checkpointing.enabled=true", "compile.enabled=true"]),
]
SETTING_KEYS = ["eager", "compile", "ac-eager", "ac-compile"]  # --settings: GPU_SETTINGS in order
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


def worker(argv: list[str]) -> int:
    from foundryx import registry
    from foundryx.cli import main

    registry.dataloaders.register("synthetic", synthetic_loader)
    return main(["train", *argv])


def run_case(config: str, overrides: list[str], nproc: int, out: Path, warmup: int) -> dict[str, float]:
    metrics = out / "metrics.jsonl"
    args = [config, *overrides, f"loggers.jsonl.path={metrics}", "save_folder=null",
            "eval_loader=null", "eval_first=false", "callbacks.speed_monitor.window_size=5",
            "console_log_interval=1000ba", "python_log_level=warning"]
    script = [str(Path(__file__).resolve()), "--worker", *args]
    cmd = [str(BIN / "composer"), "-n", str(nproc), *script] if nproc > 1 else [sys.executable, *script]
    threads = str(max(1, (os.cpu_count() or 1) // nproc))  # no oversubscription on CPU
    env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", threads)}
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"case failed: {' '.join(cmd)}\n{r.stderr[-3000:]}")
    rows = [json.loads(line) for line in metrics.read_text().splitlines()]
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


def gpu_cases(models: list[str], batches: int,
              settings: list[str] | None = None) -> list[tuple[str, str, list[str], int]]:
    tokenizer = gpu_tokenizer()
    chosen = [GPU_SETTINGS[SETTING_KEYS.index(k)] for k in settings] if settings else GPU_SETTINGS
    cases = []
    for m in models:
        micro = GPU_MICROBATCH[m]
        base = [f"variables.tokenizer_name={tokenizer}", "train_loader.name=synthetic",
                f"max_duration={batches}ba", f"global_train_batch_size={micro}",
                f"device_train_microbatch_size={micro}", "device=gpu", "precision=amp_bf16"]
        cases += [(f"MPT-{m.upper()}, {label}", f"yamls/mpt-{m}.yaml", base + extra, 1)
                  for label, extra in chosen]
    return cases



def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.exit(worker(sys.argv[2:]))
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["cpu", "gpu"])
    p.add_argument("--models", nargs="+", default=["125m", "350m", "1b"], choices=list(GPU_MICROBATCH))
    p.add_argument("--batches", type=int, default=None, help="batches per case (cpu 40, gpu 30)")
    p.add_argument("--warmup", type=int, default=10, help="batches left out of the average")
    p.add_argument("--settings", nargs="+", choices=SETTING_KEYS, default=None,
                   help="gpu: only these settings (default all: no AC / AC every block x eager / "
                        "compile)")
    p.add_argument("--out", type=Path, help="also write the results as JSON")
    args = p.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    batches = args.batches or (40 if args.mode == "cpu" else 30)
    cases = cpu_cases(batches) if args.mode == "cpu" else gpu_cases(args.models, batches, args.settings)
    from tqdm import tqdm

    results = []
    for label, config, overrides, nproc in tqdm(cases, desc="cases"):
        with tempfile.TemporaryDirectory() as tmp:
            results.append({"case": label, **run_case(config, overrides, nproc, Path(tmp), args.warmup)})
    base = results[0]["tokens_per_sec"]
    print("\n| case | tokens/s | vs first | MFU |\n|---|---|---|---|")
    for r in results:
        mfu = "n/a" if r["mfu"] != r["mfu"] else f"{100 * r['mfu']:.1f}%"
        print(f"| {r['case']} | {r['tokens_per_sec']:,.0f} | {r['tokens_per_sec'] / base:.2f}x | {mfu} |")
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
