"""Per-rank peak memory and tokens/s of fine-tuning a 130M-parameter MPT on CPU: full
fine-tuning vs LoRA vs LoRA over a bf16, int8, FP8 or NF4 frozen base (``model.frozen_base``)
vs NF4 with ``offload_fraction: 0.5`` (and the same offload by FSDP2's ``CPUOffloadPolicy``:
the ``fsdp2offload`` rows), on 1 and 2 processes (FSDP2 over gloo), each
configuration in a fresh process (``torchrun``), the order alternated between rounds.

    .venv/bin/python -m benchmarks.finetune_memory [--rounds 1] [--steps 3] [--procs 1 2] [--ac]
        [--configs full lora ...] [--model 130m|tiny]

``--model tiny`` (d_model 128, 2 layers, vocabulary 512) runs the same code in seconds, for a
quick look and the script's test; its memory figures mean nothing. ``--ac``: activation checkpointing of every block in every configuration, as the large-model
recipe (yamls/finetune/llama-8b-lora-fp8.yaml) runs; without it the blocks' activations
(about 100 MB per rank here) sit in every row's peak alike.

The model is shaped like the 7B-405B models the issue's targets are about, where the frozen
linear weights are most of the memory: d_model 1024, 8 layers, 16 heads, SwiGLU FFN of 3584
(3.5 x d_model, as Llama 3), vocabulary 8192 (random token ids), tied embedding: 130.0M
parameters, 121.6M (93.5%) of them in the 40 linear layers that ``frozen_base`` stores.
Llama-3-8B has 87% of its parameters in such layers (6.98B of 8.03B; its 128k vocabulary's
embedding and output head are the rest) and Llama-3-70B 97%. An earlier shape (d_model 768,
12 layers, vocabulary 50368: 74% in linear layers) had its peak dominated by the tied 38.7M
embedding (fp32) and the 50k-vocabulary activations, which no base dtype touches. Sequence 128,
batch 1 per rank, AdamW, LoRA r=16 on all linear layers, activation checkpointing only with
``--ac``.

Memory is the rise of the process's peak RSS (``VmHWM``) over its RSS before the model was
built, measured over the training steps only: the peak is reset (``/proc/self/clear_refs``)
after the model is built, quantized and sharded, so the build's one-off full-precision copy is
not counted, while everything training holds is (weights, gradients, optimizer state, FSDP2's
all-gather buffers, activations). Before ``before``, each process runs one step of the same
configuration on a tiny model, so its one-off costs (lazy imports, kernel and thread-pool
setup: ~60 MB) are not counted as training memory. glibc is told to serve large blocks with
mmap and is trimmed before the reset, so freed tensors leave RSS. On CPU torch has no
allocator statistics (no ``max_memory_allocated``), so RSS is the measure; it includes
non-tensor memory (a few MB). ``state_mb`` is the rise right after the build (the sharded
weights the rank holds before training).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CONFIGS = {  # name: (peft?, frozen_base dtype, offload_fraction; negative: by FSDP2 instead)
    "full": (False, None, 0.0),
    "lora": (True, None, 0.0),
    "lora-bf16": (True, "bf16", 0.0),
    "lora-int8": (True, "int8", 0.0),
    "lora-fp8": (True, "fp8", 0.0),
    "lora-nf4": (True, "nf4", 0.0),
    "lora-nf4-offload0.5": (True, "nf4", 0.5),
    # issue 40's experiment: the same layers offloaded by FSDP2's own CPUOffloadPolicy
    # (fully_shard per offloaded layer) instead of foundryx's offload runtime
    "lora-fp8-offload0.5": (True, "fp8", 0.5),
    "lora-fp8-fsdp2offload0.5": (True, "fp8", -0.5),
    "lora-nf4-fsdp2offload0.5": (True, "nf4", -0.5),
}
MODEL = {"d_model": 1024, "n_heads": 16, "n_layers": 8, "max_seq_len": 256, "vocab_size": 8192,
         "attn_config": {"rope": True}, "norm_type": "rmsnorm", "no_bias": True,
         "ffn_config": {"ffn_type": "swiglu", "ffn_hidden_size": 3584}}
MODELS = {"130m": MODEL, "tiny": {**MODEL, "d_model": 128, "n_heads": 2, "n_layers": 2,
                                   "vocab_size": 512,
                                   "ffn_config": {"ffn_type": "swiglu", "ffn_hidden_size": 448}}}
WARMUP = {**MODEL, "d_model": 128, "n_heads": 2, "n_layers": 1, "vocab_size": 256,
          "ffn_config": {"ffn_type": "swiglu", "ffn_hidden_size": 256}}
SEQ, BATCH = 128, 1  # per rank


def rss_mb(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(field)


def build(name: str, sizes: dict, world: int) -> tuple:
    """The model of configuration ``name`` (LoRA, frozen base, FSDP2), its optimizer, a
    batch of random token ids and the base model's parameter count."""
    import torch
    import torch.distributed as dist

    from foundryx.builders import apply_frozen_storage
    from foundryx.config.schema import ActivationCheckpointingConfig, ParallelismConfig
    from foundryx.models.mpt.composer import ComposerMPTCausalLM
    from foundryx.models.peft.frozen_options import FrozenBaseOptions
    from foundryx.models.peft.lora import apply_lora
    from foundryx.models.peft.options import LoraOptions
    from foundryx.parallel import parallelize

    peft, dtype, offload = CONFIGS[name]
    torch.manual_seed(0)
    model = ComposerMPTCausalLM(**sizes)
    n_params = sum(p.numel() for p in model.parameters())
    if peft:
        apply_lora(model, LoraOptions(target_modules="all-linear", r=16, lora_alpha=32))
    if dtype:
        apply_frozen_storage(model, FrozenBaseOptions(dtype=dtype, offload_fraction=max(offload, 0)))
    if offload < 0:  # FSDP2's offload of the layers foundryx's would offload (offload_layers)
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

        from foundryx.models.peft.frozen_base import LowPrecisionLinear
        from foundryx.parallel.offload import offload_choice

        layers = [m for m in model.modules() if isinstance(m, LowPrecisionLinear)]
        for layer in offload_choice(layers, -offload):
            fully_shard(layer, offload_policy=CPUOffloadPolicy(pin_memory=False))
    # FULL: no casting, so each weight is all-gathered in its own dtype (a bf16 base in bf16)
    ac = ActivationCheckpointingConfig(enabled=os.environ.get("FINETUNE_MEMORY_AC") == "1")
    parallelize(model, ParallelismConfig(mixed_precision="FULL"), activation_checkpointing=ac,
                device=torch.device("cpu"))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    gen = torch.Generator().manual_seed(dist.get_rank() if world > 1 else 0)
    ids = torch.randint(0, sizes["vocab_size"], (BATCH, SEQ), generator=gen)
    batch = {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}
    return model, opt, batch, n_params


def train_step(model, opt, batch):  # noqa: ANN001, ANN201
    loss = model.loss(model(batch), batch)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def worker(name: str, steps: int, sizes: dict) -> None:
    import gc

    import torch
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // world))
    # One step of the same configuration on a tiny model first, so that the process's
    # one-off costs (lazy imports, kernel and thread-pool setup, ~60 MB) are in ``before``
    # and not counted as training memory.
    train_step(*build(name, WARMUP, world)[:3])
    gc.collect()
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc_trim(0)
    before = rss_mb("VmRSS")
    model, opt, batch, n_params = build(name, sizes, world)
    libc.malloc_trim(0)
    state = rss_mb("VmRSS") - before  # what the built, sharded model and optimizer hold
    Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    times, losses = [], []
    for _ in range(steps):
        start = time.perf_counter()
        loss = train_step(model, opt, batch)
        times.append(time.perf_counter() - start)
        losses.append(loss.item())
    peak = rss_mb("VmHWM") - before
    timed = times[1:] or times
    result = {"config": name, "procs": world, "params": n_params,
              "ac": os.environ.get("FINETUNE_MEMORY_AC") == "1",
              "peak_mb": round(peak, 1), "state_mb": round(state, 1), "loss": round(loss.item(), 4), "losses": losses,
              "tokens_per_s": round(world * BATCH * SEQ / (sum(timed) / len(timed)), 1)}
    if world > 1:
        everyone: list = [None] * world
        dist.all_gather_object(everyone, result)
        result["peak_mb_per_rank"] = [r["peak_mb"] for r in everyone]
        result["peak_mb"] = max(result["peak_mb_per_rank"])
        result["state_mb"] = max(r["state_mb"] for r in everyone)
        dist.destroy_process_group()
        if int(os.environ["RANK"]):
            return
    print("RESULT " + json.dumps(result), flush=True)


def run_one(name: str, procs: int, steps: int, model: str = "130m") -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": str(max(1, 2 // procs))}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={procs}", "-m", "benchmarks.finetune_memory", "--worker", name,
           "--steps", str(steps), "--model", model]
    out = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, check=False)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
    if out.returncode or not lines:
        raise SystemExit(f"{name} on {procs} process(es) failed:\n{out.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--worker")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--procs", type=int, nargs="+", default=[2, 1])
    ap.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    ap.add_argument("--out", default=None, help="append each result as a JSON line here")
    ap.add_argument("--ac", action="store_true", help="activation checkpointing in every configuration")
    ap.add_argument("--model", choices=list(MODELS), default="130m",
                    help="the model's size (tiny: the script's test; its figures mean nothing)")
    args = ap.parse_args()
    if args.ac:
        os.environ["FINETUNE_MEMORY_AC"] = "1"  # the workers (torchrun) inherit it
    if args.worker:
        return worker(args.worker, args.steps, MODELS[args.model])
    for r in range(args.rounds):
        order = args.configs if r % 2 == 0 else args.configs[::-1]  # alternate the sides
        for procs in args.procs:
            for name in order:
                result = run_one(name, procs, args.steps, args.model)
                result["round"] = r
                print(json.dumps(result), flush=True)
                if args.out:
                    with open(args.out, "a") as f:
                        f.write(json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
