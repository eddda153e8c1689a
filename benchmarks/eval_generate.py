"""Generation in ICL eval: Hugging Face ``generate`` through Composer's ``eval_forward`` (what
LLM Foundry 0.22 and foundryx's training-time evaluators run) vs foundryx eval's greedy loop
(:mod:`foundryx.eval.generate`), on the same batches in one process, alternating.

    python -m benchmarks.eval_generate [--examples 8] [--batch-size 4] [--new-tokens 64]
            [--rounds 3] [--task gsm8k] [--out benchmarks/RESULTS.md]

The model is benchmarks/eval_vs_llmfoundry.py's (seeded random Llama-style, BPE 8192 on
tinyshakespeare, built once under /tmp); the task is one generation task of
eval/yamls/tasks.yaml at its first few-shot count, its first ``--examples`` examples, prompts
as the eval builds them. Each round times both paths over every batch (``--new-tokens``
caps the task's generation length so a round fits a loaded machine) and checks that their
texts are identical. Prints the times, the ratio per round and its median and spread.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.eval_vs_llmfoundry import ROOT, SHARED, build_model, task_entries
from benchmarks.instruments.report_out import emit


def generation_setup(task: str, examples: int, batch_size: int, new_tokens: int,
                     hidden: int) -> tuple:
    """``(model, tokenizer, prepared task, batches, new tokens, HF model)`` of the generation
    benchmarks (this one and benchmarks/kv_cache.py): eval_vs_llmfoundry.py's model, seeded;
    ``task`` of eval/yamls/tasks.yaml at its first few-shot count, its first ``examples``;
    the generation length capped at ``new_tokens``."""
    from composer.utils import reproducibility

    from foundryx.eval.data import build_dataloader, prepare_task
    from foundryx.eval.generate import generation_model
    from foundryx.eval.models import EvalModelSpec, load_eval_model
    from foundryx.eval.task_config import ICLTaskConfig

    reproducibility.seed_all(17)
    folder = build_model(Path("/tmp/foundryx-eval-vs-llmfoundry"), hidden=hidden)
    entry = next(t for t in task_entries(str(ROOT / "eval/yamls/tasks.yaml"), SHARED / "eval_data")
                 if t["label"] == task)
    model, tok = load_eval_model(EvalModelSpec(label="bench", hf=str(folder)))
    prepared = prepare_task(ICLTaskConfig(**entry), tok, 2048, examples)[0]
    new = min(prepared.max_new_tokens, new_tokens)
    prepared.max_new_tokens = new
    batches = list(build_dataloader(prepared, tok, batch_size))
    return model, tok, prepared, batches, new, generation_model(model)


def main() -> None:
    from foundryx.eval.generate import decode_generations, greedy_generate

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="gsm8k")
    ap.add_argument("--examples", type=int, default=8)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    model, tok, prepared, batches, new, hf = generation_setup(
        args.task, args.examples, args.batch_size, args.new_tokens, args.hidden)

    def composer_generate() -> list[str]:
        out = []
        with torch.no_grad():
            for b in batches:
                out += model.eval_forward(dict(b))
        return out

    def foundryx_generate() -> list[str]:
        out = []
        for b in batches:
            toks = greedy_generate(hf, tok, b["input_ids"], b["attention_mask"], new,
                                   tok.eos_token_id, b["icl_options"]["stop_sequences"])
            out += decode_generations(tok, toks)
        return out

    rows = []
    for i in range(args.rounds):
        order = [("generate", composer_generate), ("foundryx", foundryx_generate)]
        times, texts = {}, {}
        for name, fn in order if i % 2 == 0 else order[::-1]:
            t0 = time.perf_counter()
            texts[name] = fn()
            times[name] = time.perf_counter() - t0
        same = texts["generate"] == texts["foundryx"]
        rows.append((i + 1, order[0][0] if i % 2 == 0 else order[1][0], times, same))
        print(f"round {i + 1}: generate {times['generate']:.2f} s, foundryx {times['foundryx']:.2f} s, "
              f"texts identical: {same}", file=sys.stderr, flush=True)
    ratios = [r[2]["generate"] / r[2]["foundryx"] for r in rows]
    lengths = [int(b["input_ids"].shape[1]) for b in batches]
    table = "\n".join(f"| {n} | {first} | {t['generate']:.2f} | {t['foundryx']:.2f} | "
                      f"{t['generate'] / t['foundryx']:.2f} | {'yes' if same else 'NO'} |"
                      for n, first, t, same in rows)
    cmd = (f"python -m benchmarks.eval_generate --task {args.task} --examples {args.examples} "
           f"--batch-size {args.batch_size} --new-tokens {args.new_tokens} --rounds {args.rounds}")
    text = (f"\n## ICL generation: Hugging Face generate vs foundryx eval's greedy loop, CPU (issue 25)\n\n"
            f"{datetime.date.today()}. {platform.machine()}, {os.cpu_count()} cores (shared; load "
            f"average {os.getloadavg()[0]:.1f} at the end), torch {torch.__version__}, "
            f"{torch.get_num_threads()} threads. Command: `{cmd}`. {args.task} "
            f"{prepared.num_fewshot}-shot, {len(prepared.examples)} examples in {len(batches)} "
            f"batches of {args.batch_size} (prompt widths {lengths}), {new} new tokens, "
            f"eval_vs_llmfoundry.py's model.\n\n| round | first | generate s | foundryx s | "
            f"generate / foundryx | same text |\n|---|---|---:|---:|---:|---|\n{table}\n\n"
            f"Ratio: median {statistics.median(ratios):.2f} (min {min(ratios):.2f}, max "
            f"{max(ratios):.2f}).\n")
    emit(text, args.out)


if __name__ == "__main__":
    main()
