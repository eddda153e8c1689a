"""Shard-on-read: per-rank peak host memory and load throughput (issue 23).

    python benchmarks/load_memory.py                       # the default grid (see --help)
    python benchmarks/load_memory.py --ranks 1 2 4 --dtypes bf16 fp8 int8 nf4 --offload 0 0.5 1

A Llama-style model (default: 1.1B parameters, hidden 2048, 22 layers, vocab 32000, as
TinyLlama) is written once in bf16 safetensors, several files with an index, from random
values (written tensor by tensor; no model is ever built for real). For each (ranks, frozen
base dtype, offload fraction), N fresh processes (gloo) each build the model on meta with
LoRA (r 16, all linear layers) and ``frozen_base``, shard it with FSDP2 and read their shards
(``foundryx.builders.parallelize_and_load``). Each rank reports its resident memory just
before building (its baseline: Python, torch, transformers imported) and its peak (VmHWM)
after the load, and the load's own time. ``cat`` reads the same files for the reference
throughput; the page cache is warm for both (the files were just written or read; dropping it
needs root), which the table says. The table is printed in markdown; ``--out`` appends it to
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import date
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LLAMA_1B = {"hidden_size": 2048, "intermediate_size": 5632, "num_hidden_layers": 22,
            "num_attention_heads": 32, "num_key_value_heads": 4, "vocab_size": 32000,
            "max_position_embeddings": 2048}


def write_model(folder: Path, sizes: dict, shard_bytes: int) -> int:
    """Random bf16 weights of a Llama with ``sizes``, in files of about ``shard_bytes`` with
    an index; returns the stored bytes."""
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.for_model("llama", **sizes, torch_dtype="bfloat16")
    with torch.device("meta"):
        shapes = {k: v.shape for k, v in AutoModelForCausalLM.from_config(cfg).state_dict().items()}
    folder.mkdir(parents=True, exist_ok=True)
    cfg.save_pretrained(folder)
    files, current, size, total = [], {}, 0, 0
    gen = torch.Generator().manual_seed(0)
    for name, shape in shapes.items():
        t = (torch.randn(shape, generator=gen) * 0.02).to(torch.bfloat16)
        current[name] = t
        size += t.nbytes
        total += t.nbytes
        if size >= shard_bytes:
            files.append(current)
            current, size = {}, 0
    if current:
        files.append(current)
    weight_map = {}
    for i, tensors in enumerate(files, 1):
        fname = f"model-{i:05d}-of-{len(files):05d}.safetensors"
        save_file(tensors, folder / fname, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(tensors, fname))
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

    from foundryx import builders, loading
    from foundryx.parallel import parallelize

    base = rss_gb("VmRSS")
    section = {"name": "hf_causal_lm", "pretrained_model_name_or_path": folder,
               "init_device": "meta",
               "peft_config": {"target_modules": "all-linear", "r": 16, "lora_alpha": 32}}
    if dtype != "none":
        section["frozen_base"] = {"dtype": dtype, "offload_fraction": offload}
    start = time.perf_counter()
    model = builders.build_model(SimpleNamespace(model=section), None)
    plan = loading.prepare(model, folder)
    parallelize(model, ParallelismConfig() if world > 1 else None, device=torch.device("cpu"))
    built = time.perf_counter() - start
    seconds = loading.load(model, plan, torch.device("cpu"))["seconds"]
    held = sum(stored_bytes(p) for p in model.parameters())
    off = sum(stored_bytes(m.offload.host) for m in model.modules()
              if isinstance(m, LowPrecisionLinear) and m.offload is not None)
    Path(out).write_text(json.dumps({"rank": rank, "base_gb": base, "peak_gb": rss_gb("VmHWM"),
                                     "seconds": seconds, "built": built, "held": held, "offloaded": off}))
    if world > 1:
        torch.distributed.destroy_process_group()


def run_case(folder: Path, world: int, dtype: str, offload: float) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        init = f"file://{tmp}/pg"
        procs = []
        for r in range(world):
            code = (f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
                    f"from benchmarks.load_memory import rank_main; "
                    f"rank_main({r}, {world}, {init!r}, {str(folder)!r}, {dtype!r}, {offload}, "
                    f"{tmp + f'/r{r}.json'!r})")
            procs.append(subprocess.Popen([sys.executable, "-c", code], cwd=ROOT,
                                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True))
        errs = [p.communicate()[1] for p in procs]
        if any(p.returncode for p in procs):
            raise SystemExit(f"{world} ranks, {dtype}, offload {offload} failed:\n"
                             + "\n".join(e[-3000:] for e in errs))
        return [json.loads(Path(f"{tmp}/r{r}.json").read_text()) for r in range(world)]


def cat_seconds(folder: Path) -> float:
    start = time.perf_counter()
    subprocess.run(f"cat {folder}/*.safetensors > /dev/null", shell=True, check=True)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--dtypes", nargs="+", default=["fp8"], help="none (dense float32 base), bf16, fp8, int8, nf4")
    ap.add_argument("--offload", type=float, nargs="+", default=[0.0])
    ap.add_argument("--layers", type=int, default=LLAMA_1B["num_hidden_layers"])
    ap.add_argument("--folder", type=Path, default=None, help="reuse (or write) the model here")
    ap.add_argument("--shard-mb", type=int, default=500)
    ap.add_argument("--out", type=Path, default=None, help="append the table to this markdown file")
    a = ap.parse_args()
    sizes = {**LLAMA_1B, "num_hidden_layers": a.layers}
    folder = a.folder or Path(tempfile.mkdtemp(prefix="load_memory_")) / "llama"
    if not (folder / "model.safetensors.index.json").is_file():
        write_model(folder, sizes, a.shard_mb * 2**20)
    stored = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
    files = len(list(folder.glob("*.safetensors")))
    params = stored // 2
    cat = min(cat_seconds(folder) for _ in range(2))
    rows = []
    for world in a.ranks:
        for dtype in a.dtypes:
            for offload in a.offload:
                if dtype == "none" and offload:
                    continue
                cat_again = cat_seconds(folder)  # alternating with the loads
                ranks = run_case(folder, world, dtype, offload)
                above = [r["peak_gb"] - r["base_gb"] for r in ranks]
                load_s = max(r["seconds"] for r in ranks)
                built = max(r["built"] for r in ranks)
                offloaded = " / ".join(f"{r['offloaded'] / 2**30:.2f}" for r in ranks)
                rows.append(
                    f"| {world} | {dtype} | {offload:g} | "
                    f"{' / '.join(f'{x:.2f}' for x in above)} | {stored / 2**30 / world:.2f} | "
                    f"{max(above) / (stored / 2**30 / world):.2f} | "
                    f"{(max(above) - min(above)) / max(above) * 100:.0f}% | "
                    f"{offloaded} | "
                    f"{built:.1f} | {load_s:.1f} | {stored / 2**30 / load_s:.2f} | "
                    f"{stored / 2**30 / cat_again:.2f} |")
                print(rows[-1], flush=True)
    header = (
        f"## Shard-on-read: peak host memory per rank and load throughput (issue 23)\n\n"
        f"{date.today()}. {platform.node()}: {os.cpu_count()} CPUs (shared with other jobs), no "
        f"GPU; torch {torch.__version__}, Python {platform.python_version()}. Command: "
        f"`python benchmarks/load_memory.py {' '.join(sys.argv[1:])}`. Model: Llama-style, "
        f"{params / 1e9:.2f}B parameters (hidden {sizes['hidden_size']}, {sizes['num_hidden_layers']} "
        f"layers, vocab {sizes['vocab_size']}), bf16, {stored / 2**30:.2f} GiB in {files} "
        f"safetensors files + index. Each rank: LoRA r16 on all linear layers, the frozen base "
        f"as `dtype`, FSDP2 over the ranks (gloo), `init_device: meta`, 1 torch thread. "
        f"\"above base\": peak RSS (VmHWM) after the load minus RSS before the model is built "
        f"(imports done). Build: meta model + LoRA + frozen_base + FSDP2; load: read + convert/"
        f"quantize + place (the slowest rank; bytes of all ranks together per second). "
        f"Page cache warm for the loads and for `cat` (no root to drop it); `cat` of all files: "
        f"{stored / 2**30 / cat:.2f} GiB/s before the grid, and the last column just before each "
        f"row.\n\n"
        "| ranks | frozen base | offload | peak above base per rank (GiB) | stored / N (GiB) | "
        "max / (stored / N) | spread | offloaded per rank (GiB) | build s | load s | load GiB/s | "
        "cat GiB/s |\n|---:|---|---:|---|---:|---:|---:|---|---:|---:|---:|---:|")
    table = header + "\n" + "\n".join(rows) + "\n"
    print(table)
    if a.out:
        with open(a.out, "a") as f:
            f.write("\n" + table)


if __name__ == "__main__":
    main()
