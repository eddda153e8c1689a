"""The planner's tables for Llama 3.1 8B, 70B and 405B fine-tuning on one node of 8 GPUs
(docs/finetuning.md prints them): per-device memory by method, whether it fits, the largest
microbatch that fits and the estimated throughput.

    python benchmarks/plan_tables.py [--gpu h100] [--gpus 8] [--seq 4096]

Shapes from yamls/shapes/ (config.json only; no weights). Every row: FSDP2 over all GPUs,
bf16 mixed precision, AdamW, activation checkpointing, microbatch 1.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

import yaml

from foundryx.plan.gpus import GiB
from foundryx.plan.planner import make_plan

ROOT = Path(__file__).parents[1]
MODELS = ("llama-3.1-8b", "llama-3.1-70b", "llama-3.1-405b")
LORA = {"target_modules": "all-linear", "r": 16, "lora_alpha": 32}
METHODS = (
    ("full fine-tuning", {}),
    ("LoRA r=16, fp32 base", {"peft_config": LORA}),
    ("LoRA, bf16 base", {"peft_config": LORA, "frozen_base": {"dtype": "bf16"}}),
    ("LoRA, fp8 base", {"peft_config": LORA, "frozen_base": {"dtype": "fp8"}}),
    ("LoRA, nf4 base", {"peft_config": LORA, "frozen_base": {"dtype": "nf4"}}),
    ("LoRA, fp8 base, offload 0.5", {"peft_config": LORA,
                                     "frozen_base": {"dtype": "fp8", "offload_fraction": 0.5}}),
)


def run_config(folder: Path, shape: str, model_extra: dict, seq: int, gpus: int) -> Path:
    cfg = {
        "max_seq_len": seq,
        "model": {"name": "hf_causal_lm", "pretrained": False,
                  "pretrained_model_name_or_path": str(ROOT / "yamls" / "shapes" / shape),
                  **model_extra},
        "tokenizer": {"name": "hf", "path": "on/the/cluster"},
        "train_loader": {"name": "text", "dataset": {"local": "on/the/cluster", "split": "train",
                                                     "max_seq_len": seq}},
        "max_duration": "1000ba", "global_train_batch_size": gpus,
        "device_train_microbatch_size": 1,
        "optimizer": {"name": "decoupled_adamw", "lr": 1e-4}, "precision": "amp_bf16",
        "device": "gpu", "parallelism": {"sharding_strategy": "FULL_SHARD"},
        "activation_checkpointing": True,
    }
    path = folder / f"{shape}-{abs(hash(str(model_extra)))}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gpu", default="h100")
    ap.add_argument("--gpus", type=int, default=8)
    ap.add_argument("--seq", type=int, default=4096)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for shape in MODELS:
            print(f"\n{shape}, {args.gpus} x {args.gpu}, sequence {args.seq}, FSDP2, bf16, "
                  "AdamW, activation checkpointing, microbatch 1\n")
            print("| method | per GPU | fits | largest microbatch | weights | optimizer + grads "
                  "| activations + logits | tokens/s (40% MFU) |")
            print("|---|---|---|---|---|---|---|---|")
            for label, extra in METHODS:
                p = make_plan(run_config(Path(tmp), shape, extra, args.seq, args.gpus),
                              gpus=args.gpus, gpu=args.gpu)
                t = p.terms
                weights = t["frozen_weights"] + t["trainable_weights"]
                opt = t["optimizer_state"] + t["gradients"]
                act = t["activations"] + t["logits_and_loss"] + t["backward_working_set"]
                tps = p.tokens_per_s
                print(f"| {label} | {p.per_device_bytes / GiB:,.1f} GiB | "
                      f"{'yes' if p.fits else 'no'} | {p.largest_microbatch or '-'} | "
                      f"{weights / GiB:,.1f} | {opt / GiB:,.1f} | {act / GiB:,.1f} | "
                      f"{f'{tps:,.0f}' if tps else '-'} |")


if __name__ == "__main__":
    main()
