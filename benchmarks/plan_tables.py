"""The planner's step-by-step tables (docs/finetuning.md prints them): Llama-3.1-405B on one node
of 8 H100-80GB, Llama-3-70B on 8 A100-80GB and Llama-3.1-8B on one 24 GB GPU, from full
fine-tuning without sharding, through ZeRO stages 1-3, LoRA, an FP8 base and the base sharded
over the GPUs, to the whole plan with activations and buffers and the offload fraction that
leaves headroom.

    python -m benchmarks.plan_tables [--seq 4096] [--headroom 0.10] [--models 405b 70b 8b]

No hub access and no weights: each model's shape is a Hugging Face config.json this script
writes (Llama 3.1 8B and 405B as in yamls/shapes/; Llama 3 70B is Llama 3.1 70B's shape with its
8k context and no rope scaling: the same parameters). Every row: bf16 mixed precision (amp_bf16,
fp32 stored weights), AdamW, microbatch 1 x --seq tokens, activation checkpointing.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import replace
from pathlib import Path

import yaml

from foundryx.plan.gpus import GiB, parse_memory
from foundryx.plan.memory import terms
from foundryx.plan.planner import Plan, make_plan

ROOT = Path(__file__).parents[1]
LORA = {"target_modules": "all-linear", "r": 16, "lora_alpha": 32}
FP8 = {"dtype": "fp8"}
BF16 = {"dtype": "bf16"}
# (title, shape folder, changes to its config.json, --gpu, --gpu-memory, GPUs)
NODES = {  # --models name: the table
    "405b": ("Llama-3.1-405B on one node of 8 x H100-80GB", "llama-3.1-405b", {}, "h100", None, 8),
    "70b": ("Llama-3-70B on 8 x A100-80GB", "llama-3.1-70b",
            {"max_position_embeddings": 8192, "rope_scaling": None}, "a100-80gb", None, 8),
    "8b": ("Llama-3.1-8B on one 24 GB GPU", "llama-3.1-8b", {}, "h100", "24GB", 1),
}


def write_shape(folder: Path, shape: str, changes: dict) -> Path:
    """The shape's config.json (plus ``changes``) in a folder of its own."""
    config = json.loads((ROOT / "yamls" / "shapes" / shape / "config.json").read_text())
    config.update(changes)
    out = folder / f"{shape}{'-changed' if changes else ''}"
    out.mkdir(exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out


def run_config(folder: Path, shape: Path, model_extra: dict, seq: int, gpus: int,
               sharded: bool) -> Path:
    cfg = {
        "max_seq_len": seq,
        "model": {"name": "hf_causal_lm", "pretrained": False,
                  "pretrained_model_name_or_path": str(shape), **model_extra},
        "tokenizer": {"name": "hf", "path": "on/the/cluster"},
        "train_loader": {"name": "text", "dataset": {"local": "on/the/cluster", "split": "train",
                                                     "max_seq_len": seq}},
        "max_duration": "1000ba", "global_train_batch_size": gpus,
        "device_train_microbatch_size": 1,
        "optimizer": {"name": "decoupled_adamw", "lr": 1e-4}, "precision": "amp_bf16",
        "device": "gpu", "activation_checkpointing": True,
        **({"parallelism": {"sharding_strategy": "FULL_SHARD"}} if sharded else {}),
    }
    path = folder / f"run-{abs(hash((str(shape), str(model_extra), sharded)))}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def static(t: dict[str, int]) -> tuple[int, int, int]:
    """(weights, gradients, optimizer state) per GPU."""
    return t["frozen_weights"] + t["trainable_weights"], t["gradients"], t["optimizer_state"]


def gib(n: float) -> str:
    return f"{n / GiB:,.1f}"


def table(title: str, shape: Path, gpu: str, memory: str | None, gpus: int, seq: int,
          headroom: float, folder: Path) -> None:
    def plan(extra: dict, sharded: bool, overrides: list[str] | None = None) -> Plan:
        return make_plan(run_config(folder, shape, extra, seq, gpus, sharded), overrides,
                         gpus=gpus, gpu=gpu, gpu_memory=memory)

    full = plan({}, sharded=False)
    cap = full.capacity
    print(f"\n{title}: {full.census.total / 1e9:,.1f}B parameters, {gpus} x "
          f"{memory or gpu} ({gib(cap)} GiB each as torch reports it), sequence {seq}, "
          "microbatch 1, bf16 mixed precision, AdamW, activation checkpointing\n")
    print("| step | weights | gradients | optimizer state | weights + gradients + optimizer "
          "| activations, loss, buffers | total per GPU | fits |")
    print("|---|---|---|---|---|---|---|---|")

    def static_row(step: str, t: dict[str, int]) -> None:
        w, g, o = static(t)
        fits = "no" if w + g + o > cap else "this part fits"
        print(f"| {step} | {gib(w)} | {gib(g)} | {gib(o)} | {gib(w + g + o)} | | | {fits} |")

    static_row("1. full fine-tuning, no sharding (each GPU a replica)", full.terms)
    if gpus > 1:
        for z, what in ((1, "optimizer state and fp32 master weights sharded (ZeRO-1)"),
                        (2, "+ gradients sharded (ZeRO-2)")):
            static_row(f"{z + 1}. {what}", terms(full.census, replace(
                full.setup, zero_stage=z, shard_degree=gpus)))
        static_row("4. + weights sharded (ZeRO-3: FSDP2 over all GPUs)", plan({}, True).terms)
    else:
        print("| 2-4. ZeRO stages 1-3 | one GPU: nothing to shard over | | | | | | |")
    static_row("5. LoRA r=16 on all linear layers, bf16 base, not sharded",
               plan({"peft_config": LORA, "frozen_base": BF16}, False).terms)
    fp8 = {"peft_config": LORA, "frozen_base": FP8}
    static_row("6. FP8 base (per-row scales), not sharded", plan(fp8, False).terms)
    last = plan(fp8, gpus > 1)
    if gpus > 1:
        static_row(f"7. FP8 base sharded over {gpus} GPUs (FSDP2)", last.terms)
    w, g, o = static(last.terms)
    rest = last.per_device_bytes - (w + g + o)
    print(f"| 8. + activations (checkpointed), loss, FSDP2 and cast buffers, 10% allocator "
          f"margin, 1 GiB context: the whole plan | {gib(w)} | {gib(g)} | {gib(o)} | "
          f"{gib(w + g + o)} | {gib(rest)} | {gib(last.per_device_bytes)} | "
          f"{'yes' if last.device_fits else 'no'} ({gib(cap - last.per_device_bytes)} GiB headroom) |")
    want = headroom * cap
    for pct in range(0, 100, 5):
        frac = pct / 100
        p = plan({**fp8, "frozen_base": {**FP8, "offload_fraction": frac}}, gpus > 1) if pct else last
        if cap - p.per_device_bytes >= want:
            w, g, o = static(p.terms)
            rest = p.per_device_bytes - (w + g + o)
            step = (f"9. offload fraction {frac:g} of the FP8 base to host memory: the smallest "
                    f"(in steps of 0.05) that leaves {headroom:.0%} headroom")
            if not pct:
                step = f"9. no offload needed: already {headroom:.0%} headroom"
            print(f"| {step} | {gib(w)} | {gib(g)} | {gib(o)} | {gib(w + g + o)} | {gib(rest)} | "
                  f"{gib(p.per_device_bytes)} | yes ({gib(cap - p.per_device_bytes)} GiB "
                  f"headroom; largest microbatch {p.largest_microbatch}) |")
            break
    else:
        print(f"| 9. no offload fraction up to 0.95 leaves {headroom:.0%} headroom | | | | | | | no |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--headroom", type=float, default=0.10)
    ap.add_argument("--models", nargs="+", choices=list(NODES), default=list(NODES),
                    help="only these models' tables")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        for name in args.models:
            title, shape, changes, gpu, memory, gpus = NODES[name]
            if memory:
                parse_memory(memory)
            table(title, write_shape(folder, shape, changes), gpu, memory, gpus, args.seq,
                  args.headroom, folder)


if __name__ == "__main__":
    main()
