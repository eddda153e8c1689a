"""Multiple-choice ICL eval throughput (examples/s) of a small MPT, on CPU (or GPU).

    .venv/bin/python benchmarks/eval_mc.py [--examples 64] [--device cpu|gpu]

Task: the first N (64) questions of arc_easy (../shared/eval_data, 4 choices each), 0- and 3-shot.
Tokenizer: a byte-level BPE (vocab 8192) trained here on ../shared/corpus/tinyshakespeare.txt.
Model: a randomly initialised MPT (d_model 256, 4 layers, RoPE, seq 1024); speed does not depend
on the weights. The loop is ``foundryx.eval.runner.evaluate_task``, the one ``foundryx eval``
runs; each rate is the best of 3 runs. Baselines: batch size 1; and, at the largest batch size,
batches padded to max_seq_len (what a harness without per-batch padding does; on the first 16
questions) against padding to the batch's longest row.
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).parents[1]
SHARED = ROOT.parent / "shared"


class PadToMax:
    """Wraps a collator so every batch is padded to ``max_len`` (the baseline harness)."""

    def __init__(self, collate: Any, max_len: int):
        self.collate, self.max_len = collate, max_len

    def __call__(self, items):
        batch = self.collate(items)
        extra = self.max_len - batch["input_ids"].shape[1]
        for key in ("input_ids", "labels", "attention_mask"):
            fill = 0 if key == "attention_mask" else self.collate.pad_id
            batch[key] = torch.nn.functional.pad(batch[key], (0, extra), value=fill)
        return batch


def measure(model, task, tokenizer, device, batch_size: int, pad_to: int | None = None,
            repeats: int = 3) -> float:
    """Best examples/s of ``repeats`` runs: the first warms up the kernels for new shapes, and
    the machine may be shared."""
    from foundryx.eval import data, runner

    original = data.ICLCollator
    if pad_to:
        data.ICLCollator = lambda t, tok: PadToMax(original(t, tok), pad_to)
    try:
        best = 0.0
        for _ in range(repeats):
            start = time.perf_counter()
            runner.evaluate_task(model, task, tokenizer, batch_size=batch_size, device=device,
                                 progress=False)
            best = max(best, len(task.examples) / (time.perf_counter() - start))
        return best
    finally:
        data.ICLCollator = original


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--examples", type=int, default=64)
    ap.add_argument("--baseline-examples", type=int, default=16,
                    help="questions for the slow pad-to-max_seq_len baseline")
    ap.add_argument("--device", default="cpu", choices=["cpu", "gpu"])
    ap.add_argument("--batch-sizes", default="1,4,16")
    args = ap.parse_args()

    from composer.utils import get_device

    from foundryx.data.tokenizers import train_bpe_tokenizer
    from foundryx.eval.data import prepare_task
    from foundryx.eval.task_config import ICLTaskConfig
    from foundryx.models.mpt.composer import ComposerMPTCausalLM

    text = (SHARED / "corpus" / "tinyshakespeare.txt").read_text()
    with tempfile.TemporaryDirectory() as tmp:
        tok = train_bpe_tokenizer(text.split("\n\n"), 8192, tmp)
    torch.manual_seed(0)
    model = ComposerMPTCausalLM(tok, d_model=256, n_heads=4, n_layers=4, max_seq_len=1024,
                                vocab_size=8192, attn_config={"attn_impl": "torch", "rope": True})
    device = get_device(args.device)
    device.module_to_device(model)
    cfg = ICLTaskConfig(label="arc_easy", icl_task_type="multiple_choice", num_fewshot=[0, 3],
                        dataset_uri=str(SHARED / "eval_data/world_knowledge/arc_easy.jsonl"),
                        continuation_delimiter="\nAnswer: ")
    sizes = [int(b) for b in args.batch_sizes.split(",")]
    print(f"# eval_mc: {args.examples} arc_easy questions x 4 choices, MPT 256x4 "
          f"({sum(p.numel() for p in model.parameters()) / 1e6:.1f}M params), {args.device}, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    print("| task | batch size | padding | examples/s | vs batch 1 |")
    print("|---|---:|---|---:|---:|")
    for task in prepare_task(cfg, tok, 1024, max_examples=args.examples):
        base = None
        for bs in sizes:
            rate = measure(model, task, tok, device, bs)
            base = base or rate
            print(f"| {task.key} | {bs} | own longest | {rate:.1f} | {rate / base:.2f}x |")
        sub = dataclasses.replace(task, examples=task.examples[:args.baseline_examples])
        rate = measure(model, sub, tok, device, sizes[-1], pad_to=1024, repeats=1)
        print(f"| {task.key} | {sizes[-1]} | max_seq_len 1024 | {rate:.1f} | {rate / base:.2f}x |")


if __name__ == "__main__":
    main()
