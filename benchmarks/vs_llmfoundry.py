"""foundryx vs LLM Foundry: training tokens/s of the same MPT on the same data, alternating.

    python benchmarks/vs_llmfoundry.py [--rounds 3] [--batches 200] [--no-compile]
            [--cpu-matmul auto|onednn|blas] [--warm-cache] [--out benchmarks/RESULTS.md]

Installs LLM Foundry 0.22 with the same torch and Composer in its own venv (once, under
``--venv``, default ``~/.cache/foundryx-bench/llmfoundry``), trains a byte-level BPE (8192)
on ``../shared/corpus/tinyshakespeare.txt`` and converts it to MDS (``tokens`` as int32,
which both read), then runs the two frameworks in turn, the first side alternating round by
round. Each run is a fresh process training an MPT (d_model 256, 4 layers, seq 256, batch 16,
fp32, AdamW, no eval, no checkpoints) for ``--batches`` batches. The time is that of
``Trainer.fit`` (both call Composer's), so it includes ``torch.compile`` where a side compiles
(foundryx by default) but not the imports; whole-process seconds are reported beside it. Each
run gets an empty Inductor cache (``TORCHINDUCTOR_CACHE_DIR``), so every foundryx run pays its
whole compile, as a first run on a machine does; ``--warm-cache`` shares one cache instead (a
user's later runs: Dynamo still traces, Inductor's code is reused).
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
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT.parent / "shared" / "corpus" / "tinyshakespeare.txt"
# LLM Foundry 0.22's requirements, pinned by hand: with its Composer extras (gcs, oci, mlflow,
# ...) pip's resolver backtracks for many minutes; the package itself goes in with --no-deps.
LLMFOUNDRY_REQS = [
    "torch==2.7.0", "torchvision==0.22.0", "mosaicml==0.32.1", "transformers==4.51.3",
    "mosaicml-streaming==0.12.0", "datasets==3.6.0", "fsspec==2023.6.0", "sentencepiece==0.2.0",
    "einops==0.8.1", "omegaconf>=2.2.3,<3", "accelerate>=0.25,<1.9", "huggingface-hub>=0.30,<0.34",
    "catalogue>=2,<3", "typer<1", "tenacity>=8.2.3,<10", "beautifulsoup4>=4.12.2,<5",
    "GitPython==3.1.44", "boto3>=1.21.45,<2", "slack-sdk<4", "mlflow==2.22.1",
]
SEQ, BATCH, VOCAB = 256, 16, 8192
MODEL = {"name": "mpt_causal_lm", "d_model": 256, "n_heads": 4, "n_layers": 4,
         "expansion_ratio": 4, "max_seq_len": SEQ, "vocab_size": VOCAB, "init_device": "cpu",
         "attn_config": {"attn_impl": "torch"}, "norm_type": "layernorm", "no_bias": True,
         "learned_pos_emb": True}
OPTIMIZER = {"name": "decoupled_adamw", "lr": 6.0e-4, "betas": [0.9, 0.95], "eps": 1.0e-8,
             "weight_decay": 0.0}
SCHEDULER = {"name": "cosine_with_warmup", "t_warmup": "10ba", "alpha_f": 0.1}

# Runs either framework's entry point with Composer's Trainer.fit timed from outside.
TIMED_FIT = """
import json, sys, time
from composer.trainer import trainer as _t
_out = sys.argv[1]
_fit = _t.Trainer.fit
def fit(self, *a, **k):
    t = time.perf_counter(); out = _fit(self, *a, **k); dt = time.perf_counter() - t
    loss = self.state.loss
    json.dump({"fit_s": dt, "batches": int(self.state.timestamp.batch),
               "loss": float(loss.item() if hasattr(loss, "item") else loss)},
              open(_out, "w"))
    return out
_t.Trainer.fit = fit
sys.argv = sys.argv[2:]
"""
FOUNDRYX_MAIN = "import runpy; runpy.run_path('train.py', run_name='__main__')"
LLMFOUNDRY_MAIN = ("from llmfoundry.command_utils import train_from_yaml; "
                   "train_from_yaml(sys.argv[1], sys.argv[2:])")


def log(msg: str) -> None:
    print(f"[vs_llmfoundry] {msg}", file=sys.stderr, flush=True)


def ensure_llmfoundry(venv: Path) -> Path:
    py = venv / "bin" / "python"
    if py.exists() and subprocess.run([py, "-c", "import llmfoundry"], capture_output=True).returncode == 0:
        return py
    log(f"installing LLM Foundry into {venv} (once; a few minutes)")
    subprocess.run([sys.executable, "-m", "venv", venv], check=True)
    subprocess.run([py, "-m", "pip", "install", "-q", *LLMFOUNDRY_REQS], check=True)
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-deps", "llm-foundry==0.22.0"], check=True)
    return py


def prepare_data(work: Path) -> Path:
    """A BPE tokenizer and MDS shards of tinyshakespeare under ``work`` (reused when there)."""
    from foundryx.data.tokenizers import train_bpe_tokenizer

    tok, mds = work / "tokenizer", work / "mds"
    if (mds / "train" / "index.json").exists():
        return work
    if not CORPUS.exists():
        sys.exit(f"vs_llmfoundry: needs {CORPUS} (../shared beside the checkout)")
    text = CORPUS.read_text(encoding="utf-8")
    train_bpe_tokenizer(text.split("\n\n"), vocab_size=VOCAB, out_dir=tok)
    cli = Path(sys.executable).parent / "foundryx"
    subprocess.run([cli, "data", "convert", "--input", CORPUS, "--out", mds / "train",
                    "--tokenizer", tok, "--max-seq-len", str(SEQ), "--overwrite", "--no-progress"],
                   check=True)
    return work


def config(work: Path, batches: int, side: str, compile_blocks: bool = True,
           cpu_matmul: str = "auto") -> dict:
    loader = {"name": "text", "drop_last": True, "num_workers": 0,
              "dataset": {"local": str(work / "mds"), "split": "train", "shuffle": True,
                          "shuffle_seed": 17, "max_seq_len": SEQ}}
    cfg = {"run_name": f"bench-{side}", "seed": 17, "max_seq_len": SEQ, "model": MODEL,
           "tokenizer": {"name": str(work / "tokenizer")}, "train_loader": loader,
           "optimizer": OPTIMIZER, "scheduler": SCHEDULER, "max_duration": f"{batches}ba",
           "global_train_batch_size": BATCH, "device_train_microbatch_size": BATCH,
           "precision": "fp32", "eval_interval": 1, "progress_bar": False,
           "console_log_interval": f"{batches}ba"}
    if side == "foundryx":
        cfg["tokenizer"] = {"name": "hf", "path": str(work / "tokenizer")}
        cfg["device"] = "cpu"
        cfg["loggers"] = {}
        if not compile_blocks:
            cfg["compile"] = False
        if cpu_matmul != "auto":
            cfg["cpu_matmul"] = cpu_matmul
        for key in ("progress_bar", "eval_interval"):
            cfg.pop(key)
    else:
        cfg["tokenizer"]["kwargs"] = {"model_max_length": SEQ}
        loader.update(prefetch_factor=None, persistent_workers=False, pin_memory=False)
        cfg["model"] = {**MODEL, "loss_fn": "torch_crossentropy"}  # its fused CE needs CUDA
    return cfg


def run(side: str, py: Path, work: Path, batches: int, i: int, warm_cache: bool,
        compile_blocks: bool = True, cpu_matmul: str = "auto") -> dict:
    cfg_path, result = work / f"{side}.yaml", work / f"{side}-{i}.json"
    cfg_path.write_text(yaml.safe_dump(config(work, batches, side, compile_blocks, cpu_matmul)))
    main = FOUNDRYX_MAIN if side == "foundryx" else LLMFOUNDRY_MAIN
    cmd = [py, "-c", TIMED_FIT + main, result, "x", cfg_path]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("FOUNDRYX_COMPILE", None)  # the user's default: compile where supported
    cache = work / ("inductor-cache" if warm_cache else f"inductor-cache-{side}-{i}")
    if not warm_cache:
        shutil.rmtree(cache, ignore_errors=True)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    start = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    if not warm_cache:
        shutil.rmtree(cache, ignore_errors=True)
    if p.returncode != 0:
        sys.exit(f"vs_llmfoundry: {side} failed:\n{p.stderr[-4000:]}")
    out = json.loads(result.read_text())
    out["process_s"] = time.perf_counter() - start
    out["tokens_per_s"] = out["batches"] * BATCH * SEQ / out["fit_s"]
    return out


def table(rows: list[dict]) -> str:
    lines = ["| round | first | foundryx tok/s | LLM Foundry tok/s | ratio | foundryx fit / process s "
             "| LLM Foundry fit / process s | final loss fx / lf |", "|---|---|---:|---:|---:|---|---|---|"]
    for r in rows:
        f, lf = r["foundryx"], r["llmfoundry"]
        lines.append(f"| {r['round']} | {r['first']} | {f['tokens_per_s']:.0f} | {lf['tokens_per_s']:.0f} "
                     f"| {f['tokens_per_s'] / lf['tokens_per_s']:.2f} | {f['fit_s']:.0f} / "
                     f"{f['process_s']:.0f} | {lf['fit_s']:.0f} / {lf['process_s']:.0f} "
                     f"| {f['loss']:.3f} / {lf['loss']:.3f} |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--venv", type=Path, default=Path.home() / ".cache/foundryx-bench/llmfoundry")
    ap.add_argument("--work", type=Path, default=Path("/tmp/foundryx-vs-llmfoundry"))
    ap.add_argument("--warm-cache", action="store_true",
                    help="one Inductor cache for every run instead of an empty one per run")
    ap.add_argument("--no-compile", action="store_true",
                    help="foundryx with compile: false (its default compiles each block)")
    ap.add_argument("--cpu-matmul", choices=["auto", "onednn", "blas"], default="auto",
                    help="foundryx's cpu_matmul (default auto: oneDNN on x86-64)")
    ap.add_argument("--out", type=Path, help="append the result section to this markdown file")
    args = ap.parse_args()
    lf_py = ensure_llmfoundry(args.venv)
    work = prepare_data(args.work)
    rows = []
    for i in range(args.rounds):
        order = ["foundryx", "llmfoundry"] if i % 2 == 0 else ["llmfoundry", "foundryx"]
        row = {"round": i + 1, "first": order[0]}
        for side in order:
            log(f"round {i + 1}/{args.rounds}: {side} ({args.batches} batches)")
            row[side] = run(side, Path(sys.executable) if side == "foundryx" else lf_py, work,
                            args.batches, i, args.warm_cache, not args.no_compile, args.cpu_matmul)
            log(f"  {row[side]['tokens_per_s']:.0f} tokens/s (fit {row[side]['fit_s']:.0f} s)")
            with (work / "runs.jsonl").open("a") as f:  # each run kept, should the rest stop
                f.write(json.dumps({"round": i + 1, "side": side, **row[side]}) + "\n")
        rows.append(row)
    ratios = [r["foundryx"]["tokens_per_s"] / r["llmfoundry"]["tokens_per_s"] for r in rows]
    summary = (f"median ratio {statistics.median(ratios):.2f} (min {min(ratios):.2f}, "
               f"max {max(ratios):.2f}) over {len(rows)} alternating rounds")
    import torch
    text = (f"\n## foundryx vs LLM Foundry 0.22 on CPU (issue 15)\n\n{datetime.date.today()}. "
            f"{platform.machine()}, {os.cpu_count()} cores; torch {torch.__version__}, both sides. "
            f"Command: `python benchmarks/vs_llmfoundry.py --rounds {args.rounds} --batches "
            f"{args.batches}{' --warm-cache' if args.warm_cache else ''}"
            f"{' --no-compile' if args.no_compile else ''}"
            f"{'' if args.cpu_matmul == 'auto' else ' --cpu-matmul ' + args.cpu_matmul}` (Inductor cache: "
            f"{'shared by the runs' if args.warm_cache else 'empty for each run'}).\n\n"
            f"{table(rows)}\n\nfoundryx / LLM Foundry tokens/s: {summary}.\n")
    print(text)
    if args.out:
        with args.out.open("a") as f:
            f.write(text)


if __name__ == "__main__":
    main()
