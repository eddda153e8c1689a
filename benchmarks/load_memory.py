"""Shard-on-read: per-rank peak host memory, load throughput against `cat`, and the
planner's host-memory prediction beside each row (issue 23).

One command reruns it all (the model is written once, cached; no download):

    nice python -m benchmarks.load_memory --out benchmarks/RESULTS.md      # the whole grid
    python -m benchmarks.load_memory --ranks 2 --dtypes bf16 fp8 int8 nf4  # a subset
    python -m benchmarks.load_memory --table results.json                  # re-render, re-plan

The model: a Llama-style 1.1B (TinyLlama's shape: hidden 2048, 22 layers, vocab 32000) in
bf16 safetensors, several files with an index, random values, written once to
``~/.cache/foundryx-bench/llama-1.1b-bf16`` (``--folder`` for another). For each (ranks,
frozen-base dtype, offload fraction) N fresh processes (gloo) each build the model on meta
with LoRA (r16, all linear layers) and ``frozen_base``, shard it with FSDP2 and read their
shards (``foundryx.loading``). Each rank reports its resident memory just before building
(its baseline: torch, transformers, peft, torchao and composer imported), its peak (VmHWM,
the whole process, loading included) after the load, the load's time and the CPU seconds
its threads spent loading.

``cat`` of the same files runs just before and just after each case (alternating with the
loads, in this invocation; the row's ``cat`` is their mean: a virtual disk's speed drifts).
With ``--cache cold`` (the default when /proc/sys/vm/drop_caches is writable,
i.e. as root) the page cache is dropped before every ``cat`` and every load, so both read
from the disk; ``--cache warm`` reads the files once first and never drops. Throughput is
stored bytes / seconds (the slowest rank's load; all ranks together read the files once).
The CPU columns (user + system seconds of the load's process per GiB, and ``cat``'s) do not
depend on how busy a shared machine is.

The planner column is ``foundryx plan``'s per-rank host memory of the loading phase
(``make_plan`` on yamls/finetune/llama-8b-lora-fp8.yaml with this model, dtype, offload,
``--gpu cpu --gpus N``, no dataloader workers), against the measured VmHWM of the worst rank.
Every row's raw numbers go to ``--json`` (default next to ``--out``) so that ``--table``
re-renders the table, and re-plans, without loading again.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
            "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000,
            "max_position_embeddings": 2048}
CACHE = Path.home() / ".cache" / "foundryx-bench"
DROP = Path("/proc/sys/vm/drop_caches")
RECIPE = ROOT / "yamls" / "finetune" / "llama-8b-lora-fp8.yaml"
GiB = 2**30

def write_model(folder: Path, sizes: dict, shard_bytes: int, device: str = "cpu") -> int:
    """Random bf16 weights of a Llama with ``sizes``, in files of at most ``shard_bytes`` (a
    tensor that would overflow a file starts the next, as ``save_pretrained``'s
    ``max_shard_size`` does) with an index; returns the stored bytes. Each file is written as
    soon as its tensors are drawn (host memory: one file's worth); ``device``: where the
    values are drawn (``cuda``: seconds for an 8B model, against minutes on a CPU)."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", **sizes, torch_dtype="bfloat16")
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(cfg).state_dict().items()}
    folder.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(folder)
    files, size, total = [[]], 0, 0
    for name, shape in shapes.items():
        nbytes = 2 * shape.numel()
        if files[-1] and size + nbytes > shard_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
        total += nbytes
    gen = torch.Generator(device=device).manual_seed(0)
    weight_map = {}
    for i, names in enumerate(files, 1):
        tensors = {n: (torch.randn(shapes[n], generator=gen, device=device) * 0.02)
                   .to(torch.bfloat16).cpu() for n in names}
        fname = f"model-{i:05d}-of-{len(files):05d}.safetensors"
        save_file(tensors, folder / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, fname))
        del tensors
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total


def rss_gb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def rank_main(rank: int, world: int, init: str, folder: str, dtype: str, offload: float,
              out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), NODE_RANK="0")
    torch.set_num_threads(1)
    # every library the build imports is in the baseline (imports are not the loader's)
    import composer.models  # noqa: F401
    import peft  # noqa: F401
    import torchao.dtypes.nf4tensor  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    from foundryx.config.schema import ParallelismConfig
    from foundryx.models.peft.frozen_base import LowPrecisionLinear, stored_bytes

    if world > 1:
        torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    from types import SimpleNamespace

    from foundryx import builders

    base = rss_gb("VmRSS")
    section = {"name": "hf_causal_lm", "pretrained_model_name_or_path": folder,
               "init_device": "meta",
               "peft_config": {"target_modules": "all-linear", "r": 16, "lora_alpha": 32}}
    if dtype != "none":
        section["frozen_base"] = {"dtype": dtype, "offload_fraction": offload}
    start = time.perf_counter()
    model = builders.build_model(SimpleNamespace(model=section), None)
    # the path `foundryx train` runs: builders.parallelize_and_load (prepare, the dtype rule of
    # foundryx/loading/dtypes.py, FSDP2 with the default mixed precision, then the load); only
    # the loader's own summary is caught on its way back, to time the load alone
    load, timed = builders.load_pretrained, {}

    def timed_load(*args, **kwargs):
        if world > 1:
            torch.distributed.barrier()  # the ranks start loading together
        timed["built"] = time.perf_counter() - start
        timed["cpu0"] = resource.getrusage(resource.RUSAGE_SELF)
        timed["summary"] = load(*args, **kwargs)
        timed["cpu1"] = resource.getrusage(resource.RUSAGE_SELF)
        return timed["summary"]

    builders.load_pretrained = timed_load
    model = builders.parallelize_and_load(model, ParallelismConfig() if world > 1 else None,
                                          device=torch.device("cpu"), precision="fp32")
    cpu0, cpu1, seconds = timed["cpu0"], timed["cpu1"], timed["summary"]["seconds"]
    built = timed["built"]
    held = sum(stored_bytes(p) for p in model.parameters())
    off = sum(stored_bytes(m.offload.host) for m in model.modules()
              if isinstance(m, LowPrecisionLinear) and m.offload is not None)
    Path(out).write_text(json.dumps({
        "rank": rank, "base_gb": base, "peak_gb": rss_gb("VmHWM"), "seconds": seconds,
        "cpu_s": (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime),
        "built": built, "held": held, "offloaded": off}))
    if world > 1:
        torch.distributed.destroy_process_group()


def run_case(folder: Path, world: int, dtype: str, offload: float) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/pg"
        procs = []
        for r in range(world):
            code = (f"from benchmarks.load_memory import rank_main; "  # cwd: the checkout
                    f"rank_main({r}, {world}, {init!r}, {str(folder)!r}, {dtype!r}, {offload}, "
                    f"{tmp + f'/r{r}.json'!r})")
            procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=ROOT,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        errs = [p.communicate()[1] for p in procs]
        if any(p.returncode for p in procs):
            raise SystemExit(f"{world} ranks, {dtype}, offload {offload} failed:\n"
                             + "\n".join(e[-3000:] for e in errs))
        return [json.loads(Path(f"{tmp}/r{r}.json").read_text()) for r in range(world)]


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    DROP.write_text("3\n")


def cat_run(folder: Path, cold: bool) -> tuple[float, float]:
    """(seconds, CPU seconds) of ``cat`` reading every safetensors file of ``folder``."""
    if cold:
        drop_caches()
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(f"cat {folder}/*.safetensors > /dev/null", shell=True, check=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def planned_gib(folder: Path, world: int, dtype: str, offload: float) -> dict | None:
    """``foundryx plan``'s host memory per rank (GiB) for the case: the loading phase's peak
    and its terms; None when the planner cannot plan it (the reason printed)."""
    from foundryx.plan.planner import make_plan

    ov = [f"variables.model_path={folder}", "variables.data_root=/nonexistent", "precision=fp32",
          "device=cpu", "train_loader.num_workers=0", "eval_loader.num_workers=0",
          "model.peft_config.lora_dropout=0"]
    ov += ([f"model.frozen_base.dtype={dtype}", f"model.frozen_base.offload_fraction={offload}"]
           if dtype != "none" else ["~model.frozen_base"])
    try:
        p = make_plan(RECIPE, ov, gpus=world, gpu="cpu")
    except Exception as e:  # noqa: BLE001 - a benchmark row says why it has no prediction
        print(f"planner: {world} ranks {dtype} offload {offload}: {e}", file=sys.stderr)
        return None
    return {"load_per_rank": p.host.load_per_rank / GiB,
            "terms": {k: v / GiB for k, v in p.host.terms.items() if v}}


def _cat_s(row: dict) -> float:
    """``cat``'s time for a row: the mean of its runs just before and just after the load
    (rows measured before the second run was added have only the first)."""
    return (row["cat_s"] + row.get("cat_after_s", row["cat_s"])) / 2


def render(meta: dict, rows: list[dict], folder: Path) -> str:
    stored, files, params = meta["stored"], meta["files"], meta["params"]
    sizes = meta["sizes"]
    cats = [_cat_s(r) for r in rows]
    cat_rates = [stored / GiB / c for c in cats] or [float("nan")]
    lines = []
    for r in rows:
        world, ranks = r["world"], r["ranks"]
        above = [x["peak_gb"] - x["base_gb"] for x in ranks]
        peak = max(x["peak_gb"] for x in ranks)
        load_s = max(x["seconds"] for x in ranks)
        cpu = sum(x["cpu_s"] for x in ranks)
        rate = stored / GiB / load_s
        cat_rate = stored / GiB / _cat_s(r)
        offloaded = " / ".join(f"{x['offloaded'] / GiB:.2f}" for x in ranks)
        plan = planned_gib(folder, world, r["dtype"], r["offload"])
        pred = f"{plan['load_per_rank']:.2f} | {(plan['load_per_rank'] - peak) / peak * 100:+.0f}%" \
            if plan else "- | -"
        lines.append(
            f"| {world} | {r['dtype']} | {r['offload']:g} | "
            f"{' / '.join(f'{x:.2f}' for x in above)} | {stored / GiB / world:.2f} | "
            f"{max(above) / (stored / GiB / world):.2f} | "
            f"{(max(above) - min(above)) / max(above) * 100:.0f}% | "
            f"{offloaded} | "
            f"{peak:.2f} | {pred} | "
            f"{load_s:.1f} | {rate:.2f} | {cat_rate:.2f} | {rate / cat_rate:.2f} | "
            f"{cpu / (stored / GiB):.2f} | {r['cat_cpu_s'] / (stored / GiB):.2f} |")
    cold = meta["cache"] == "cold"
    header = (
        f"## Shard-on-read: peak host memory per rank, load throughput, planner (issue 23)\n\n"
        f"{meta['date']}. {meta['machine']}; torch {meta['torch']}, Python {meta['python']}. "
        f"Command: `{meta['command']}`. Model: Llama-style, {params / 1e9:.2f}B parameters "
        f"(hidden {sizes['hidden_size']}, {sizes['num_hidden_layers']} layers, vocab "
        f"{sizes['vocab_size']}), bf16, {stored / GiB:.2f} GiB in {files} safetensors files + "
        f"index. Each rank: LoRA r16 on all linear layers, the frozen base as `dtype`, FSDP2 "
        f"over the ranks (gloo), `init_device: meta`, 1 torch thread. \"above base\": VmHWM "
        f"after the load minus VmRSS before the model is built (imports done); \"VmHWM\": "
        f"the whole process's peak (the worst rank), against the planner's loading-phase "
        f"per-rank host memory (`foundryx plan`, {RECIPE.relative_to(ROOT)} with this model "
        f"and dtype, `--gpu cpu --gpus N`). Load: read + convert/quantize + place, the slowest "
        f"rank. Page cache: "
        + ("**dropped** (`echo 3 > /proc/sys/vm/drop_caches`) before every `cat` and every "
           "load: both read from the disk." if cold else
           "**warm** for both (the files read once before; nothing dropped).")
        + " `cat` of all files just before and just after each row (their mean): "
        f"{min(cat_rates):.2f}-{max(cat_rates):.2f}"
        f" GiB/s (median {statistics.median(cat_rates):.2f}). CPU s/GiB: user + system "
        f"seconds of all ranks' loads (or of `cat`) per GiB stored.\n\n"
        "| ranks | frozen base | offload | above base per rank (GiB) | stored / N (GiB) | "
        "max / (stored / N) | spread | offloaded per rank (GiB) | VmHWM (GiB) | planned (GiB) | "
        "planned vs VmHWM | load s | load GiB/s | cat GiB/s | load / cat | load CPU s/GiB | "
        "cat CPU s/GiB |\n"
        "|---:|---|---:|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    return header + "\n" + "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--dtypes", nargs="+", default=["bf16", "fp8", "int8", "nf4"],
                    help="none (dense float32 base), bf16, fp8, int8, nf4")
    ap.add_argument("--offload", type=float, nargs="+", default=[0.0, 0.5, 1.0])
    ap.add_argument("--cases", nargs="+", default=None, metavar="N:DTYPE:OFFLOAD",
                    help="exactly these cases (e.g. 2:fp8:0 1:bf16:0) instead of the grid")
    ap.add_argument("--cache", choices=("cold", "warm"), default=None,
                    help="cold: drop the page cache before every cat and load (needs root; "
                    "the default where it is allowed); warm: never drop")
    ap.add_argument("--layers", type=int, default=LLAMA_1B["num_hidden_layers"])
    ap.add_argument("--folder", type=Path, default=None,
                    help="reuse (or write) the model here (default: ~/.cache/foundryx-bench/)")
    ap.add_argument("--shard-mb", type=int, default=500)
    ap.add_argument("--out", type=Path, default=None, help="append the table to this markdown file")
    ap.add_argument("--json", type=Path, default=None, help="the raw rows (default: "
                    "~/.cache/foundryx-bench/load_memory-<time>.json)")
    ap.add_argument("--table", type=Path, default=None,
                    help="render (and re-plan) the rows of this --json file; nothing is loaded")
    a = ap.parse_args()
    if a.table:
        data = json.loads(a.table.read_text())
        table = render(data["meta"], data["rows"], Path(data["meta"]["folder"]))
        print(table)
        if a.out:
            with open(a.out, "a") as f:
                f.write("\n" + table)
        return
    sizes = {**LLAMA_1B, "num_hidden_layers": a.layers}
    folder = a.folder or CACHE / ("llama-1.1b-bf16" if a.layers == LLAMA_1B["num_hidden_layers"]
                                  else f"llama-{a.layers}layers-bf16")
    if not (folder / "model.safetensors.index.json").is_file():
        print(f"writing the model to {folder} (once) ...", flush=True)
        write_model(folder, sizes, a.shard_mb * 2**20)
    cache = a.cache or ("cold" if os.access(DROP, os.W_OK) else "warm")
    if cache == "cold" and not os.access(DROP, os.W_OK):
        raise SystemExit(f"--cache cold needs to write {DROP} (root); use --cache warm")
    if a.cases:
        cases = [(int(w), d, float(o)) for w, d, o in (c.split(":") for c in a.cases)]
    else:
        cases = [(w, d, o) for w in a.ranks for d in a.dtypes for o in a.offload
                 if not (d == "none" and o)]
    stored = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    meta = {"date": str(date.today()), "folder": str(folder), "cache": cache, "sizes": sizes,
            "stored": stored, "files": len(list(folder.glob("*.safetensors"))),
            "params": stored // 2, "torch": torch.__version__, "python": platform.python_version(),
            "machine": f"{platform.machine()} {platform.system()}, {os.cpu_count()} CPUs "
                       f"(shared with other jobs: load average {os.getloadavg()[0]:.1f} at the "
                       "start), no GPU",
            "command": "python -m benchmarks.load_memory " + " ".join(sys.argv[1:])}
    out_json = a.json or CACHE / f"load_memory-{time.strftime('%Y%m%d-%H%M%S')}.json"
    if cache == "warm":
        cat_run(folder, False)  # the files in the page cache before the first row
    rows = []
    for world, dtype, offload in cases:
        cat_s, cat_cpu = cat_run(folder, cache == "cold")  # alternating with the loads
        if cache == "cold":
            drop_caches()
        ranks = run_case(folder, world, dtype, offload)
        after_s, after_cpu = cat_run(folder, cache == "cold")  # the disk's speed may drift
        rows.append({"world": world, "dtype": dtype, "offload": offload, "cat_s": cat_s,
                     "cat_after_s": after_s, "cat_cpu_s": (cat_cpu + after_cpu) / 2, "ranks": ranks,
                     "loadavg": os.getloadavg()[0]})
        out_json.parent.mkdir(parents=True, exist_ok=True)
        out_json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
        r = rows[-1]
        above = " / ".join(f"{x['peak_gb'] - x['base_gb']:.2f}" for x in ranks)
        print(f"{world} ranks {dtype} offload {offload:g}: load "
              f"{max(x['seconds'] for x in ranks):.1f} s, cat {cat_s:.1f} s before, {after_s:.1f} s after, above base "
              f"{above} GiB, load "
              f"average {r['loadavg']:.1f} ({out_json})", flush=True)
    meta["loadavg_end"] = os.getloadavg()[0]
    out_json.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    table = render(meta, rows, folder)
    print(table)
    if a.out:
        with open(a.out, "a") as f:
            f.write("\n" + table)


if __name__ == "__main__":
    main()
