"""Where a shard-on-read load's host memory goes: per rank, peak RSS above the baseline and by
stage (build, prepare + parallelize, load, after), sampled every 20 ms (issue 23).

    python benchmarks/load_stages.py FOLDER [frozen_base dtype: fp8] [ranks: 2]

FOLDER: a bf16 Llama safetensors folder (``benchmarks/load_memory.py --folder`` writes one).
Each of N fresh processes (gloo) runs what ``foundryx train`` runs for an ``hf_causal_lm`` with
LoRA r16 on all linear layers, ``frozen_base`` and ``init_device: meta``:
``builders.build_model`` then ``builders.parallelize_and_load`` (FSDP2, default mixed
precision). ``benchmarks/load_memory.py`` measures the grid and the throughput; this one says
where the memory is, stage by stage and at the tensor that set the peak.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

ROOT = Path(__file__).resolve().parents[1]
STAGE = ["start"]


def rss_gib(field: str = "VmRSS") -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 2**20
    return float("nan")


def _sample(trace: list, stop: threading.Event) -> None:
    while not stop.is_set():
        trace.append((STAGE[0], rss_gib()))
        time.sleep(0.02)


def rank_main(rank: int, world: int, init: str, folder: str, dtype: str, out: str) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), NODE_RANK="0")
    torch.set_num_threads(1)
    import composer.models  # noqa: F401  (imports are in the baseline, not the loader's)
    import peft  # noqa: F401
    import torchao.dtypes.nf4tensor  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    from foundryx import builders
    from foundryx.config.schema import ParallelismConfig
    from foundryx.models.peft.frozen_base import stored_bytes

    loader = importlib.import_module("foundryx.loading.load")
    torch.distributed.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    trace: list = []
    stop = threading.Event()
    threading.Thread(target=_sample, args=(trace, stop), daemon=True).start()
    base = rss_gib()
    section = {"name": "hf_causal_lm", "pretrained_model_name_or_path": folder,
               "init_device": "meta",
               "peft_config": {"target_modules": "all-linear", "r": 16, "lora_alpha": 32}}
    if dtype != "none":
        section["frozen_base"] = {"dtype": dtype, "offload_fraction": 0.0}
    STAGE[0] = "build"
    model = builders.build_model(SimpleNamespace(model=section), None)
    convert, load = loader._convert, builders.load_pretrained

    def traced_convert(t, *a, **k):
        STAGE[0] = "load:" + t.key
        return convert(t, *a, **k)

    def traced_load(*a, **k):
        STAGE[0] = "load"
        return load(*a, **k)

    loader._convert, builders.load_pretrained = traced_convert, traced_load
    STAGE[0] = "prepare+parallelize"
    builders.parallelize_and_load(model, ParallelismConfig(), device=torch.device("cpu"))
    STAGE[0] = "after"
    time.sleep(0.1)
    stop.set()
    by_stage: dict[str, float] = {}
    for stage, r in trace:
        key = "load" if stage.startswith("load") else stage
        by_stage[key] = max(by_stage.get(key, 0.0), r - base)
    peak_at = max(((r, s) for s, r in trace if s.startswith("load:")), default=(0, ""))[1]
    kept: dict[str, float] = {}
    for p in model.parameters():
        local = getattr(p, "_local_tensor", p)
        key = f"{type(local).__name__} {str(p.dtype).removeprefix('torch.')}"
        kept[key] = kept.get(key, 0.0) + stored_bytes(p) / 2**30
    Path(out).write_text(json.dumps({
        "rank": rank, "peak_above_base": rss_gib("VmHWM") - base, "by_stage": by_stage,
        "peak_at": peak_at.removeprefix("load:"), "kept_gib": kept}))
    torch.distributed.destroy_process_group()


def main() -> None:
    folder = sys.argv[1]
    dtype = sys.argv[2] if len(sys.argv) > 2 else "fp8"
    world = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    stored = sum(f.stat().st_size for f in Path(folder).glob("*.safetensors")) / 2**30
    with tempfile.TemporaryDirectory() as tmp:
        procs = [subprocess.Popen(
            [sys.executable, "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r}); "
             f"from benchmarks.load_stages import rank_main; rank_main({r}, {world}, "
             f"'file://{tmp}/pg', {folder!r}, {dtype!r}, '{tmp}/r{r}.json')"],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
            for r in range(world)]
        errs = [p.communicate()[1] for p in procs]
        if any(p.returncode for p in procs):
            raise SystemExit("\n".join(e[-3000:] for e in errs))
        for r in range(world):
            d = json.loads(Path(f"{tmp}/r{r}.json").read_text())
            print(f"rank {r}: peak {d['peak_above_base']:.2f} GiB above base = "
                  f"{d['peak_above_base'] / (stored / world):.2f} x stored / N ({stored / world:.2f} "
                  f"GiB); by stage {({k: round(v, 2) for k, v in d['by_stage'].items()})}; peak "
                  f"while loading {d['peak_at']}; kept {({k: round(v, 3) for k, v in d['kept_gib'].items()})}")


if __name__ == "__main__":
    main()
