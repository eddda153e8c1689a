"""The flagship path, measured (issue 36): a Llama-3.1-8B-shaped model read shard by shard and
LoRA-trained over a bf16, an FP8 and an NF4 frozen base, each with none and half of it
offloaded: tokens/s, peak GPU memory and peak host memory beside `foundryx plan`'s figures for
the same run, and the load's GB/s.

    python -m benchmarks.flagship --device cuda --out flagship.md        # 8B shape, 6 runs
    python -m benchmarks.flagship --device cpu --shape benchmarks/gpu_runbook/shapes/llama-tiny \\
        --steps 2 --out tiny.md                                           # a CPU smoke run

The model: ``--shape`` is a folder with a Hugging Face ``config.json`` (default
yamls/shapes/llama-3.1-8b). Random bf16 weights of that shape are written once as sharded
safetensors with an index, as ``save_pretrained`` shards a release (files of at most 5 GB:
the 8B model's 16.1 GB in 4 files), with a small BPE tokenizer, under ``--cache`` (default
~/.cache/foundryx-bench/<shape>-bf16); every run reads that folder, and a later invocation
reuses it. On a GPU the values are drawn on the GPU (seconds; a CPU takes minutes for 8B).

Each (base, offload) pair is one `foundryx train` of the large-model recipe
(yamls/finetune/llama-8b-lora-fp8.yaml: init_device meta, LoRA r16 on all linear layers,
FSDP2, activation checkpointing) in a fresh process (``--nproc`` ranks; more than one under
the composer launcher), this file being the training script: it registers a ``synthetic``
loader of random tokens with their labels and calls foundryx's CLI. Only
these are overridden: the model folder, ``model.frozen_base`` (dtype, offload_fraction), the
sizes (``--seq`` tokens x ``--microbatch`` sequences per rank, one optimizer step per batch,
``--steps`` batches, no warmup), device and precision (cuda: amp_bf16; cpu: fp32), the
synthetic loader, no eval loader, no checkpoints, and compile off (compiling 32 blocks would
take most of a short run; ``--compile auto`` runs the recipe's own setting, as
benchmarks/flagship_vs_peer.py does beside compile off). Each rank records:

- tokens/s: the speed monitor's (window of 1 batch), mean over batches 2..N (the first
  batch's kernel selection and allocations are left out);
- peak GPU memory: ``torch.cuda.max_memory_allocated`` and ``max_memory_reserved`` over the
  training steps (the memory monitor resets the peak when fitting starts), against the
  plan's per-device total less its assumed 1 GiB context (which torch does not count);
- peak host memory: ``VmHWM`` of ``/proc/self/status`` at exit, the whole process (loading,
  training), against the plan's per-rank host peak (the larger of loading and training);
- the load: seconds and bytes of foundryx's loader (its own summary, caught on its way
  back), as GB/s. The files were just written or read by the run before, so this is a load
  from the page cache: the loader's own rate (reading, converting, quantizing), not the disk.

The plan is `foundryx plan`'s library function on the same config and overrides, where the
run is (this GPU and its memory; a CPU process for ``--device cpu``). ``--time-limit``
bounds the whole invocation: each run gets what is left (at most ``--run-timeout``), and the
markdown file is rewritten after each run, so a run cut off leaves the others' rows. Exit
code 1 when any run failed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
RECIPE = "yamls/finetune/llama-8b-lora-fp8.yaml"
CACHE = Path.home() / ".cache" / "foundryx-bench"
SHARD_BYTES = 5 * 10**9  # save_pretrained's default max_shard_size ("5GB")
GiB = 2**30
DONE = ".flagship-complete"  # written last: a folder cut off while writing is written again


# ---------------------------------------------------------------------------------------
# The model folder, written once
# ---------------------------------------------------------------------------------------
def shape_config(shape: Path) -> dict:
    cfg = json.loads((shape / "config.json").read_text())
    if cfg.get("model_type") != "llama":
        raise SystemExit(f"{shape}/config.json: model_type {cfg.get('model_type')!r}; this "
                         "benchmark writes Llama-shaped weights (model_type llama)")
    return cfg


def ensure_model(shape: Path, folder: Path, device: str) -> tuple[float | None, int]:
    """Write ``folder`` from ``shape`` unless it already holds it, in a process of its own (so
    that no GPU memory of this one stays held while the runs train): (seconds spent writing,
    None when it was there; the stored bytes)."""
    cfg = shape_config(shape)
    marker = folder / DONE
    wrote = not (marker.is_file() and json.loads(marker.read_text()).get("config") == cfg)
    if wrote:
        subprocess.run([sys.executable, "-m", "benchmarks.flagship", "--write", str(shape),
                        str(folder), device], cwd=ROOT, check=True)
    done = json.loads(marker.read_text())
    return done["seconds"] if wrote else None, done["bytes"]


def write(shape: Path, folder: Path, device: str) -> None:
    """The model folder: random bf16 weights of ``shape``, sharded, a tokenizer, the marker."""
    import shutil

    from benchmarks.load_memory import write_model  # the benchmarks' sharded random-weights writer
    from foundryx.data.synthetic import generate_corpus
    from foundryx.data.tokenizers import train_bpe_tokenizer

    cfg = shape_config(shape)
    shutil.rmtree(folder, ignore_errors=True)
    start = time.perf_counter()
    sizes = {k: v for k, v in cfg.items() if k not in ("model_type", "torch_dtype")}
    small = total_params(cfg) < 5e8  # a test shape: still several files
    total = write_model(folder, sizes, max(total_params(cfg) * 2 // 3, 1) if small else SHARD_BYTES,
                        device)
    train_bpe_tokenizer(generate_corpus(300, seed=1), vocab_size=min(400, cfg["vocab_size"]),
                        out_dir=folder)
    seconds = time.perf_counter() - start
    (folder / DONE).write_text(json.dumps({"config": cfg, "bytes": total, "seconds": seconds}))


def total_params(cfg: dict) -> int:
    """Parameters of a Llama config (for the shard size of small test shapes)."""
    d, f, n, v = (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"],
                  cfg["vocab_size"])
    kv = d // cfg["num_attention_heads"] * cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    return n * (2 * d * d + 2 * d * kv + 3 * d * f + 2 * d) + 2 * v * d + d


# ---------------------------------------------------------------------------------------
# One run (a training process per rank)
# ---------------------------------------------------------------------------------------
def overrides_for(folder: Path, base: str, offload: float, a: argparse.Namespace, world: int,
                  metrics: Path) -> list[str]:
    gpu = a.device == "cuda"
    return [f"variables.model_path={folder}", "variables.data_root=/nonexistent",
            f"variables.max_seq_len={a.seq}", f"variables.run_name=flagship-{base}-{offload:g}",
            f"model.frozen_base.dtype={base}", f"model.frozen_base.offload_fraction={offload}",
            f"device={'gpu' if gpu else 'cpu'}",
            f"precision={a.precision or ('amp_bf16' if gpu else 'fp32')}",
            "train_loader.name=synthetic", "train_loader.num_workers=0", "eval_loader=null",
            "eval_first=false", f"device_train_microbatch_size={a.microbatch}",
            f"global_train_batch_size={a.microbatch * world}", f"max_duration={a.steps}ba",
            "scheduler.t_warmup=0ba", f"compile.enabled={getattr(a, 'compile', 'false')}",
            "save_folder=null", "callbacks.speed_monitor.window_size=1",
            "console_log_interval=1ba", "progress_bar=false", f"loggers.jsonl.path={metrics}",
            *profile_overrides(a, base, offload), *getattr(a, "extra", ())]


def profile_overrides(a: argparse.Namespace, base: str, offload: float) -> list[str]:
    """With ``a.profile_step`` (and ``a.profile_dir``, ``a.profile_side``): one step profiled
    by benchmarks/step_profile.py's callback (benchmarks/flagship_vs_peer.py asks for it)."""
    if not getattr(a, "profile_step", 0):
        return []
    side = getattr(a, "profile_side", None) or f"foundryx-{base}-{offload:g}"
    return [f"callbacks.step_profile.out={a.profile_dir}", f"callbacks.step_profile.side={side}",
            f"callbacks.step_profile.step={a.profile_step}"]


def synthetic_loader(cfg, tokenizer, device_batch_size, **_):
    """Random token sequences of the run's max_seq_len with their labels (a Hugging Face
    model takes its loss from ``labels``), different on each rank."""
    import torch
    from composer.utils import dist
    from torch.utils.data import DataLoader

    seq = int(cfg["dataset"]["max_seq_len"])
    g = torch.Generator().manual_seed(dist.get_global_rank())
    data = torch.randint(0, len(tokenizer), (64 * device_batch_size, seq), generator=g)
    return DataLoader([{"input_ids": row, "labels": row, "attention_mask": torch.ones_like(row)}
                       for row in data], batch_size=device_batch_size, drop_last=True)


def worker(stats_dir: str, argv: list[str]) -> int:
    """One rank of one run: plan it (rank 0), train it, record what it measured."""
    import torch

    from foundryx import builders, registry
    from foundryx.cli import main
    from foundryx.config.load import load_config
    from foundryx.plan.planner import plan_here

    registry.dataloaders.register("synthetic", synthetic_loader)
    if any(x.startswith("callbacks.step_profile.") for x in argv):
        from benchmarks.instruments.step_profile import (
            composer_callback,  # a benchmark's own callback
        )

        registry.callbacks.register("step_profile", composer_callback)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    stats: dict = {"rank": rank}
    if rank == 0:
        try:
            loaded = load_config(argv[0], argv[1:], world_size=world,
                                 component_sections=("model", "optimizer"))
            stats["plan"] = plan_here(loaded).to_json()
        except Exception as e:  # noqa: BLE001 - the row says why it has no plan
            stats["plan_error"] = f"{type(e).__name__}: {e}"
    loader = builders.load_pretrained  # the loader's own summary, caught on its way back

    def timed_load(*args, **kwargs):
        stats["load"] = summary = loader(*args, **kwargs)
        return summary

    builders.load_pretrained = timed_load
    start = time.perf_counter()
    try:
        code = main(["train", *argv])
    finally:
        stats["seconds"] = time.perf_counter() - start
        stats["vmhwm_gib"] = status_gib("VmHWM")
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            stats["cuda_max_allocated_gib"] = torch.cuda.max_memory_allocated() / GiB
            stats["cuda_max_reserved_gib"] = torch.cuda.max_memory_reserved() / GiB
        Path(stats_dir, f"rank{rank}.json").write_text(json.dumps(stats, default=float))
    return code


def status_gib(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024 / GiB
    return float("nan")


def run_one(folder: Path, base: str, offload: float, a: argparse.Namespace, timeout: float,
            logs: Path) -> dict:
    """Train one (base, offload) pair; its row (``error`` set when it failed)."""
    row: dict = {"base": base, "offload": offload}
    with tempfile.TemporaryDirectory() as tmp:
        metrics = Path(tmp) / "metrics.jsonl"
        argv = [RECIPE, *overrides_for(folder, base, offload, a, a.nproc, metrics)]
        script = ["-m", "benchmarks.flagship", "--worker", tmp, *argv]  # run in ROOT
        cmd = ([str(BIN / "composer"), "-n", str(a.nproc), *script] if a.nproc > 1
               else [sys.executable, *script])
        log = logs / f"flagship-{base}-offload{offload:g}{getattr(a, 'log_tag', '')}.log"
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        start = time.perf_counter()
        with log.open("w") as f:
            f.write("$ " + " ".join(cmd) + "\n")
            f.flush()
            try:
                rc = subprocess.run(cmd, cwd=ROOT, stdout=f, stderr=subprocess.STDOUT, env=env,
                                    timeout=max(timeout, 1), start_new_session=True).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
        row["wall_s"] = time.perf_counter() - start
        row["log"] = str(log)
        ranks = [json.loads(p.read_text()) for p in sorted(Path(tmp).glob("rank*.json"))]
        rows = ([json.loads(line) for line in metrics.read_text().splitlines()]
                if metrics.is_file() else [])
    if rc != 0:
        tail = log.read_text().splitlines()[-25:]
        row["error"] = (f"timed out after {timeout:.0f} s" if rc == "timeout" else f"exit {rc}")
        row["tail"] = "\n".join(tail)
    row.update(summarise(ranks, rows, getattr(a, "profile_step", 0)))
    return row


def summarise(ranks: list[dict], rows: list[dict], profiled: int = 0) -> dict:
    """Tokens/s, losses, the worst rank's peaks, the load and the plan of one run (the
    batch ``profiled``, when not 0, left out of tokens/s)."""
    import statistics

    out: dict = {}
    tps = [r["throughput/tokens_per_sec"] for r in rows
           if "throughput/tokens_per_sec" in r and r["batch"] >= 2 and r["batch"] != profiled]
    out["tokens_per_s"] = statistics.mean(tps) if tps else None
    losses = [r["loss/train/total"] for r in rows if "loss/train/total" in r]
    out["losses"] = losses
    if not ranks:
        return out
    out["vmhwm_gib"] = max(r["vmhwm_gib"] for r in ranks)
    for k in ("cuda_max_allocated_gib", "cuda_max_reserved_gib"):
        if all(k in r for r in ranks):
            out[k] = max(r[k] for r in ranks)
    loads = [r["load"] for r in ranks if r.get("load")]
    if loads:
        seconds = max(x["seconds"] for x in loads)
        out["load_s"] = seconds
        out["load_bytes"] = sum(x["bytes_read"] for x in loads)  # the ranks read disjoint parts
        out["load_gb_s"] = out["load_bytes"] / 1e9 / max(seconds, 1e-9)
    r0 = next((r for r in ranks if r["rank"] == 0), {})
    if "plan" in r0:
        p = r0["plan"]
        out["plan_device_gib"] = p["per_device_bytes"] / GiB
        out["plan_context_gib"] = p["terms"].get("context", 0) / GiB
        out["plan_host_gib"] = p["host"]["per_rank"] / GiB if p.get("host") else None
        out["plan_tokens_per_s"] = p["throughput"]["tokens_per_s"]
        out["plan_device"] = p["device"]
    elif "plan_error" in r0:
        out["plan_error"] = r0["plan_error"]
    return out


# ---------------------------------------------------------------------------------------
# The report
# ---------------------------------------------------------------------------------------
def count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def fmt(x, spec: str = ".1f") -> str:
    return "n/a" if x is None or x != x else format(x, spec)


def ratio(a, b) -> str:
    return "n/a" if not a or not b else f"{a / b:.2f}"


def render(meta: dict, rows: list[dict]) -> str:
    gpu = meta["device"] == "cuda"
    lines = [f"Command: `{meta['command']}`", "",
             f"Model: `{meta['shape']}` ({count(meta['params'])} parameters), random bf16 "
             f"weights in {meta['files']} safetensors files ({meta['bytes'] / 1e9:.1f} GB) at "
             f"`{meta['folder']}` ({meta['written']}). Recipe `{RECIPE}` (LoRA r16 on all linear "
             f"layers, init_device meta, FSDP2 (no sharding on one rank), activation "
             f"checkpointing), {meta['nproc']} rank(s) on {meta['where']}, {meta['precision']}, "
             f"{meta['seq']} tokens x "
             f"{meta['microbatch']} sequences per rank per step, {meta['steps']} steps, random "
             f"tokens, compile {meta.get('compile', 'false')}. tokens/s: mean of steps 2..N. "
             "Load: from the page cache "
             "(the files were just written or read), the loader's own time.", ""]
    if gpu:
        head = ("| base | offload | tokens/s | plan tokens/s | GPU peak allocated GiB | "
                "GPU peak reserved GiB | plan GiB (less 1 GiB context) | reserved / plan | "
                "host peak GiB | plan host GiB | host / plan | load s | load GB/s | loss first -> last |")
    else:
        head = ("| base | offload | tokens/s | host peak GiB | plan host GiB | host / plan | "
                "load s | load GB/s | loss first -> last |")
    lines += [head, "|" + "---|" * head.count(" | ") + "---|"]
    for r in rows:
        loss = (f"{r['losses'][0]:.3f} -> {r['losses'][-1]:.3f}" if r.get("losses") else "n/a")
        status = f" **{r['error']}**" if r.get("error") else ""
        cells = [r["base"] + status, f"{r['offload']:g}", fmt(r.get("tokens_per_s"), ",.0f")]
        if gpu:
            plan = (r["plan_device_gib"] - r["plan_context_gib"]) if "plan_device_gib" in r else None
            cells += [fmt(r.get("plan_tokens_per_s"), ",.0f"), fmt(r.get("cuda_max_allocated_gib")),
                      fmt(r.get("cuda_max_reserved_gib")), fmt(plan),
                      ratio(r.get("cuda_max_reserved_gib"), plan)]
        cells += [fmt(r.get("vmhwm_gib")), fmt(r.get("plan_host_gib")),
                  ratio(r.get("vmhwm_gib"), r.get("plan_host_gib")), fmt(r.get("load_s")),
                  fmt(r.get("load_gb_s"), ".2f"), loss]
        lines.append("| " + " | ".join(cells) + " |")
    notes = [r for r in rows if r.get("error") or r.get("plan_error")]
    for r in notes:
        what = f"{r['base']}, offload {r['offload']:g}"
        if r.get("plan_error"):
            lines += ["", f"{what}: no plan: {r['plan_error']}"]
        if r.get("error"):
            lines += ["", f"{what} failed ({r['error']}); the last lines of its log "
                      f"({r['log']}):", "", "```text", r.get("tail", ""), "```"]
    return "\n".join(lines) + "\n"


def csv(text: str, kind):
    return [kind(x) for x in text.split(",") if x.strip()]


def add_run_options(p: argparse.ArgumentParser, run_timeout: float, json_help: str) -> None:
    """The options every flagship benchmark takes for its model folder, time, logs and
    outputs (this file's and flagship_vs_peer.py's)."""
    p.add_argument("--cache", type=Path, default=None,
                   help="the model folder (default ~/.cache/foundryx-bench/<shape>-bf16)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="seconds for the whole invocation; each run gets what is left")
    p.add_argument("--run-timeout", type=float, default=run_timeout, help="seconds per run at most")
    p.add_argument("--logs", type=Path, default=None, help="folder for each run's log")
    p.add_argument("--json", type=Path, default=None, help=json_help)
    p.add_argument("--out", type=Path, required=True, help="the markdown file to write")


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--worker":
        return worker(sys.argv[2], sys.argv[3:])
    if len(sys.argv) == 5 and sys.argv[1] == "--write":
        write(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4])
        return 0
    intro, usage = __doc__.split("\n\n")[:2]
    p = argparse.ArgumentParser(description=intro.replace("\n", " "), epilog=usage,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cuda",
                   help="cuda: one GPU per rank (ROCm too), amp_bf16; cpu: fp32")
    p.add_argument("--shape", type=Path, default=ROOT / "yamls" / "shapes" / "llama-3.1-8b",
                   help="a folder with a Llama config.json (default yamls/shapes/llama-3.1-8b)")
    p.add_argument("--bases", default="bf16,fp8,nf4", help="frozen_base dtypes, comma-separated")
    p.add_argument("--offload", default="0,0.5", help="offload fractions, comma-separated")
    p.add_argument("--steps", type=int, default=3, help="training steps per run (default 3)")
    p.add_argument("--seq", type=int, default=None,
                   help="tokens per sequence (default the recipe's 4096, at most the shape's "
                        "max_position_embeddings)")
    p.add_argument("--microbatch", type=int, default=2, help="sequences per rank per step (2)")
    p.add_argument("--nproc", type=int, default=1, help="ranks (default 1; >1: composer launcher)")
    p.add_argument("--precision", default=None, help="default amp_bf16 on cuda, fp32 on cpu")
    p.add_argument("--compile", choices=["false", "auto", "true"], default="false",
                   help="compile.enabled of the runs (default false; the recipe ships auto)")
    add_run_options(p, run_timeout=600, json_help="also write the rows as JSON")
    a = p.parse_args()
    start = time.perf_counter()
    deadline = start + a.time_limit if a.time_limit else float("inf")
    cfg = shape_config(a.shape)
    a.seq = a.seq or min(4096, cfg.get("max_position_embeddings", 4096))
    if a.device == "cuda":
        import torch

        if not torch.cuda.is_available():  # no CUDA context here: the runs have the GPU
            print("--device cuda: no CUDA or ROCm GPU visible to torch", file=sys.stderr)
            return 2
        where = "GPU"  # named by the first run's plan (the GPU torch reports)
    else:
        import platform

        where = f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    folder = a.cache or CACHE / f"{a.shape.resolve().name}-bf16"
    logs = a.logs or Path(tempfile.mkdtemp(prefix="flagship-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"model folder {folder} ...", flush=True)
    try:
        written, nbytes = ensure_model(a.shape, folder, a.device)
    except subprocess.CalledProcessError as e:
        a.out.write_text(f"Writing the model folder {folder} from {a.shape} failed (exit "
                         f"{e.returncode}); its output is above this step's log's end.\n")
        return 1
    print(f"model folder ready ({f'written in {written:.0f} s' if written else 'reused'})",
          flush=True)
    meta = {"command": "python -m benchmarks.flagship " + " ".join(
                x if " " not in x else repr(x) for x in sys.argv[1:]),
            "shape": str(a.shape), "params": total_params(cfg), "bytes": nbytes,
            "files": len(list(folder.glob("*.safetensors"))), "folder": str(folder),
            "written": f"written in {written:.0f} s" if written else "written by an earlier run",
            "nproc": a.nproc, "where": where, "device": a.device,
            "precision": a.precision or ("amp_bf16" if a.device == "cuda" else "fp32"),
            "seq": a.seq, "microbatch": a.microbatch, "steps": a.steps, "compile": a.compile}
    rows, failed = [], 0
    # every base without offload first: a run cut off by --time-limit loses offloaded rows
    pairs = [(b, o) for o in csv(a.offload, float) for b in csv(a.bases, str)]
    for i, (base, offload) in enumerate(pairs):
        left = deadline - time.perf_counter() - 5
        if left < 10:
            rows.append({"base": base, "offload": offload, "error": "not run: no time left",
                         "log": "-", "tail": ""})
            failed += 1
            continue
        print(f"[{i + 1}/{len(pairs)}] base {base}, offload {offload:g} ...", flush=True)
        row = run_one(folder, base, offload, a, min(a.run_timeout, left), logs)
        failed += bool(row.get("error"))
        rows.append(row)
        if a.device == "cuda" and meta["where"] == "GPU" and row.get("plan_device"):
            meta["where"] = f"1 x {row['plan_device']}" if a.nproc == 1 else \
                f"{a.nproc} x {row['plan_device']}"
        print(f"[{i + 1}/{len(pairs)}] {row.get('error') or 'ok'}: "
              f"{fmt(row.get('tokens_per_s'), ',.0f')} tokens/s, {row['wall_s']:.0f} s", flush=True)
        a.out.write_text(render(meta, rows))  # after each run: a cut-off leaves the others
        if a.json:
            a.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    a.out.write_text(render(meta, rows))
    if a.json:
        a.json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    print(render(meta, rows))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
