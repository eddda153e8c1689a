"""foundryx vs LLM Foundry: training tokens/s of the same MPT on the same data, alternating.

    python -m benchmarks.vs_llmfoundry [--rounds 3] [--batches 200] [--no-compile]
            [--cpu-matmul auto|onednn|blas] [--warm-cache] [--foundryx-ref REF ...]
            [--skip-checkout] [--profile] [--corpus FILE] [--out benchmarks/RESULTS.md]

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

``--foundryx-ref REF`` (repeatable) adds foundryx at another commit as one more side: a git
worktree of REF in a temporary folder, its ``train.py`` run from there with the same Python and
``PYTHONPATH`` on the worktree, so its own ``foundryx`` package is imported (each run records
``foundryx.__file__`` and is refused if it came from elsewhere). The order of the sides rotates
round by round; every ratio is of two runs of the same round. Besides the whole ``fit``, each
run's steady state is timed from the end of batch 1 (which holds the compile) to the end, in
wall seconds and in the process's CPU seconds (all its threads; less stretched than wall time
by other jobs on a shared machine), and so is its fastest batch after batch 1 (the least
disturbed by other jobs). ``--skip-checkout`` leaves this checkout out (while it has
uncommitted edits, say: compare two refs).
``--profile`` then runs each side once more for 14 batches with ``torch.profiler`` over batches
11-14 and prints its ``key_averages`` table (top 15 by self CPU time).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.instruments.report_out import emit

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

PROFILE_FIRST, PROFILE_BATCHES = 11, 4  # --profile: batches 11-14, after the compile
# Runs either framework's entry point with Composer's Trainer.fit timed from outside; a callback
# notes when batch 1 ends and, given FXBENCH_PROFILE=FIRST,COUNT, profiles those batches.
TIMED_FIT = """
import json, os, resource, sys, time
from composer.core import Callback
from composer.trainer import trainer as _t
_out = sys.argv[1]
_fit = _t.Trainer.fit
class _Clock(Callback):
    def __init__(self):
        self.first_end, self.first_cpu, self.prof, self.ends = None, None, None, []
        spec = os.environ.get("FXBENCH_PROFILE")
        self.span = tuple(map(int, spec.split(","))) if spec else None
    def batch_start(self, state, logger):
        if self.span and int(state.timestamp.batch) + 1 == self.span[0]:
            import torch.profiler
            self.prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU])
            self.prof.__enter__()
    def batch_end(self, state, logger):  # timestamp.batch: the batches done, this one included
        done = int(state.timestamp.batch)
        self.ends.append(time.perf_counter())
        if done == 1:
            self.first_end, self.first_cpu = time.perf_counter(), os.times()
            self.first_faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        if self.prof is not None and done == sum(self.span) - 1:
            self.prof.__exit__(None, None, None)
            open(_out + ".profile.txt", "w").write(self.prof.key_averages().table(
                sort_by="self_cpu_time_total", row_limit=15))
            self.prof = None
def fit(self, *a, **k):
    clock = _Clock(); self.state.callbacks.append(clock)
    t = time.perf_counter(); out = _fit(self, *a, **k); end, cpu = time.perf_counter(), os.times()
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - clock.first_faults
    loss = self.state.loss
    json.dump({"fit_s": end - t, "steady_s": end - clock.first_end,
               "steady_cpu_s": cpu.user + cpu.system - clock.first_cpu.user - clock.first_cpu.system,
               "steady_sys_s": cpu.system - clock.first_cpu.system, "steady_minor_faults": faults,
               "batch_s": [b - a for a, b in zip(clock.ends, clock.ends[1:])],
               "batches": int(self.state.timestamp.batch),
               "loss": float(loss.item() if hasattr(loss, "item") else loss),
               "foundryx_file": getattr(sys.modules.get("foundryx"), "__file__", None)},
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


def prepare_data(work: Path, corpus: Path = CORPUS) -> Path:
    """A BPE tokenizer and MDS shards of ``corpus`` (tinyshakespeare) under ``work`` (reused
    when there)."""
    from foundryx.data.tokenizers import train_bpe_tokenizer

    tok, mds = work / "tokenizer", work / "mds"
    if (mds / "train" / "index.json").exists():
        return work
    if not corpus.exists():
        sys.exit(f"vs_llmfoundry: needs {corpus} (../shared beside the checkout)")
    text = corpus.read_text(encoding="utf-8")
    train_bpe_tokenizer(text.split("\n\n"), vocab_size=VOCAB, out_dir=tok)
    cli = Path(sys.executable).parent / "foundryx"
    subprocess.run([cli, "data", "convert", "--input", corpus, "--out", mds / "train",
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


def worktree(ref: str) -> Path:
    """A detached git worktree of ``ref`` in a temporary folder (removed by :func:`drop_worktree`)."""
    path = Path(tempfile.mkdtemp(prefix="fx-worktree-"))
    subprocess.run(["git", "-C", ROOT, "worktree", "add", "--detach", "-q", path, ref], check=True)
    return path


def drop_worktree(path: Path) -> None:
    subprocess.run(["git", "-C", ROOT, "worktree", "remove", "--force", path], check=False)


def run(side: str, py: Path, work: Path, batches: int, i: int, warm_cache: bool,
        compile_blocks: bool = True, cpu_matmul: str = "auto", root: Path | None = None,
        profile: bool = False) -> dict:
    """One run of ``side``: LLM Foundry when ``root`` is None, else foundryx's ``train.py`` and
    ``foundryx`` package from the checkout ``root``."""
    kind = "llmfoundry" if root is None else "foundryx"
    name = re.sub(r"[^\w.-]", "-", side)  # foundryx@REF: a file name
    cfg_path, result = work / f"{name}.yaml", work / f"{name}-{i}.json"
    cfg_path.write_text(yaml.safe_dump(config(work, batches, kind, compile_blocks, cpu_matmul)))
    main = FOUNDRYX_MAIN if root is not None else LLMFOUNDRY_MAIN
    cmd = [py, "-c", TIMED_FIT + main, result, "x", cfg_path]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("FOUNDRYX_COMPILE", None)  # the user's default: compile where supported
    if root is not None:  # this checkout's foundryx before the installed (editable) one
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(root), env.get("PYTHONPATH")]))
    if profile:
        env["FXBENCH_PROFILE"] = f"{PROFILE_FIRST},{PROFILE_BATCHES}"
    cache = work / ("inductor-cache" if warm_cache else f"inductor-cache-{name}-{i}")
    if not warm_cache:
        shutil.rmtree(cache, ignore_errors=True)
    env["TORCHINDUCTOR_CACHE_DIR"] = str(cache)
    start = time.perf_counter()
    p = subprocess.run(cmd, cwd=root or ROOT, capture_output=True, text=True, env=env)
    if not warm_cache:
        shutil.rmtree(cache, ignore_errors=True)
    if p.returncode != 0:
        sys.exit(f"vs_llmfoundry: {side} failed:\n{p.stderr[-4000:]}")
    out = json.loads(result.read_text())
    if root is not None and not Path(out["foundryx_file"]).resolve().is_relative_to(root.resolve()):
        sys.exit(f"vs_llmfoundry: {side} imported foundryx from {out['foundryx_file']}, not {root}")
    if profile:
        out["profile"] = Path(f"{result}.profile.txt").read_text()
    out["process_s"] = time.perf_counter() - start
    out["tokens_per_s"] = out["batches"] * BATCH * SEQ / out["fit_s"]
    out["steady_tokens_per_s"] = (out["batches"] - 1) * BATCH * SEQ / out["steady_s"]
    out["steady_tokens_per_cpu_s"] = (out["batches"] - 1) * BATCH * SEQ / out["steady_cpu_s"]
    out["best_batch_tokens_per_s"] = BATCH * SEQ / min(out["batch_s"])
    return out


def spread(values: list[float], fmt: str = ".2f") -> str:
    return f"{statistics.median(values):{fmt}} ({min(values):{fmt}}-{max(values):{fmt}})"


def table(rows: list[dict], sides: list[str]) -> str:
    """One line per round: each side's tokens/s (whole fit / steady), fit and process seconds
    and final loss, then the ratios of the round's sides, two by two."""
    pairs = list(itertools.combinations(sides, 2))
    head = (["round", "order"] + [f"{s} tok/s fit / steady" for s in sides]
            + [f"{a} / {b}" for a, b in pairs] + [f"{s} fit / process s" for s in sides]
            + ["final loss " + " / ".join(sides)])
    aligns = ["---"] * 2 + ["---:"] * (len(sides) + len(pairs)) + ["---"] * (len(sides) + 1)
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join(aligns) + "|"]
    for r in rows:
        cells = [str(r["round"]), ", ".join(r["order"])]
        cells += [f"{r[s]['tokens_per_s']:,.0f} / {r[s]['steady_tokens_per_s']:,.0f}" for s in sides]
        cells += [f"{r[a]['tokens_per_s'] / r[b]['tokens_per_s']:.2f}" for a, b in pairs]
        cells += [f"{r[s]['fit_s']:.0f} / {r[s]['process_s']:.0f}" for s in sides]
        cells.append(" / ".join(f"{r[s]['loss']:.3f}" for s in sides))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def summary(rows: list[dict], sides: list[str]) -> str:
    """Per side the median tokens/s and its range, then per pair of sides the median ratio of
    the two runs of a round and its range, for the whole fit and for the steady state."""
    lines = []
    for key, what in (("tokens_per_s", "whole fit"), ("steady_tokens_per_s", "steady (after batch 1)"),
                      ("steady_tokens_per_cpu_s", "steady, per CPU second of the process"),
                      ("best_batch_tokens_per_s", "the run's fastest batch after batch 1")):
        lines.append(f"- tokens/{'CPU ' if 'cpu' in key else ''}s, {what}: " + "; ".join(
            f"{s} {spread([r[s][key] for r in rows], ',.0f')}" for s in sides))
        lines.append(f"- ratios, {what}: " + "; ".join(
            f"{a} / {b} {spread([r[a][key] / r[b][key] for r in rows])}"
            for a, b in itertools.combinations(sides, 2)))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--venv", type=Path, default=Path.home() / ".cache/foundryx-bench/llmfoundry")
    ap.add_argument("--work", type=Path,
                    default=Path(tempfile.gettempdir()) / "foundryx-vs-llmfoundry")
    ap.add_argument("--corpus", type=Path, default=CORPUS,
                    help="the text the tokenizer and the data are made of (a quick look: any "
                         "small text)")
    ap.add_argument("--warm-cache", action="store_true",
                    help="one Inductor cache for every run instead of an empty one per run")
    ap.add_argument("--no-compile", action="store_true",
                    help="foundryx with compile: false (its default compiles each block)")
    ap.add_argument("--cpu-matmul", choices=["auto", "onednn", "blas"], default="auto",
                    help="foundryx's cpu_matmul (default auto: oneDNN on x86-64)")
    ap.add_argument("--foundryx-ref", action="append", default=[], metavar="REF",
                    help="add foundryx at this git commit as a side (a temporary worktree); "
                    "repeatable")
    ap.add_argument("--skip-checkout", action="store_true",
                    help="leave this checkout's foundryx out (compare the --foundryx-ref sides)")
    ap.add_argument("--profile", action="store_true",
                    help=f"then run each side once for {PROFILE_FIRST + PROFILE_BATCHES - 1} batches "
                    f"under torch.profiler (batches {PROFILE_FIRST}-"
                    f"{PROFILE_FIRST + PROFILE_BATCHES - 1}) and print the tables")
    ap.add_argument("--out", type=Path, help="append the result section to this markdown file")
    args = ap.parse_args()
    lf_py = ensure_llmfoundry(args.venv)
    work = prepare_data(args.work, args.corpus)
    head = subprocess.run(["git", "-C", ROOT, "describe", "--always", "--dirty"], capture_output=True,
                          text=True).stdout.strip()
    roots: dict[str, Path | None] = {}  # side -> its foundryx checkout (None: LLM Foundry)
    if not args.skip_checkout:
        roots["foundryx"] = ROOT
    try:
        for ref in args.foundryx_ref:
            roots[f"foundryx@{ref}"] = worktree(ref)
        roots["llmfoundry"] = None
        sides = list(roots)
        pythons = {s: Path(sys.executable) if r is not None else lf_py for s, r in roots.items()}
        rows = []
        for i in range(args.rounds):
            order = sides[i % len(sides):] + sides[:i % len(sides)]  # each side first in turn
            row = {"round": i + 1, "order": order}
            for side in order:
                log(f"round {i + 1}/{args.rounds}: {side} ({args.batches} batches)")
                row[side] = run(side, pythons[side], work, args.batches, i, args.warm_cache,
                                not args.no_compile, args.cpu_matmul, roots[side])
                log(f"  {row[side]['tokens_per_s']:.0f} tokens/s, steady "
                    f"{row[side]['steady_tokens_per_s']:.0f} (fit {row[side]['fit_s']:.0f} s)"
                    + (f"; foundryx from {row[side]['foundryx_file']}" if roots[side] else ""))
                with (work / "runs.jsonl").open("a") as f:  # each run kept, should the rest stop
                    f.write(json.dumps({"round": i + 1, "side": side, **row[side]}) + "\n")
            rows.append(row)
        profiles = {}
        if args.profile:
            for side in sides:
                log(f"profile: {side}")
                profiles[side] = run(side, pythons[side], work, PROFILE_FIRST + PROFILE_BATCHES - 1,
                                     args.rounds, args.warm_cache, not args.no_compile,
                                     args.cpu_matmul, roots[side], profile=True)["profile"]
    finally:
        for root in roots.values():
            if root not in (None, ROOT):  # None: LLM Foundry
                drop_worktree(root)
    import torch
    flags = "".join(f" --foundryx-ref {r}" for r in args.foundryx_ref)
    flags += " --skip-checkout" * args.skip_checkout + " --profile" * args.profile
    text = (f"\n## foundryx vs LLM Foundry 0.22 on CPU\n\n{datetime.date.today()}. "
            f"{platform.machine()}, {os.cpu_count()} cores; torch {torch.__version__}, all sides"
            f"{'' if args.skip_checkout else f'; foundryx = this checkout ({head})'}. "
            f"Command: `python -m benchmarks.vs_llmfoundry --rounds {args.rounds} --batches "
            f"{args.batches}{' --warm-cache' if args.warm_cache else ''}"
            f"{' --no-compile' if args.no_compile else ''}"
            f"{'' if args.cpu_matmul == 'auto' else ' --cpu-matmul ' + args.cpu_matmul}{flags}` (Inductor cache: "
            f"{'shared by the runs' if args.warm_cache else 'empty for each run'}).\n\n")
    if rows:
        text += f"{table(rows, sides)}\n\nMedian (min-max) over {len(rows)} rounds:\n{summary(rows, sides)}\n"
    for side, tab in profiles.items():
        text += (f"\nProfile of {side}, batches {PROFILE_FIRST}-{PROFILE_FIRST + PROFILE_BATCHES - 1}:"
                 f"\n\n```\n{tab.strip()}\n```\n")
    emit(text, args.out)


if __name__ == "__main__":
    main()
