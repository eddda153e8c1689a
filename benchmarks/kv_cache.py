"""The KV cache of foundryx eval's greedy generation (:mod:`foundryx.eval.kv_cache`) against
transformers' own ``DynamicCache``, under the same greedy loop, on the same batches, in one
process, alternating.

    python -m benchmarks.kv_cache [--examples 32] [--batch-size 32] [--new-tokens 64]
            [--rounds 4] [--task gsm8k] [--old PATH/kv_cache.py] [--out benchmarks/RESULTS.md]

``--old`` adds a third side: another version of ``foundryx/eval/kv_cache.py`` (from a git
worktree of an older commit, say), loaded as its own module. The model and prompts are
benchmarks/eval_generate.py's. Each round times every side over every batch and checks that
their texts are identical. Prints a table of times and the ratios to foundryx's cache per
round, with median and spread.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.eval_generate import generation_setup
from benchmarks.instruments.report_out import emit


def main() -> None:
    import transformers

    from foundryx.eval import generate, kv_cache

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--task", default="gsm8k")
    ap.add_argument("--examples", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=64)
    ap.add_argument("--old", type=Path, help="another kv_cache.py to time beside this one")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    model, tok, prepared, batches, new, hf = generation_setup(
        args.task, args.examples, args.batch_size, args.new_tokens, args.hidden)

    sides = {"foundryx": (kv_cache.new_cache, kv_cache.GrowingLayer),
             "DynamicCache": (lambda hf, capacity=None: kv_cache.new_cache(hf), kv_cache.GrowingLayer)}
    if args.old:
        spec = importlib.util.spec_from_file_location("foundryx_old_kv_cache", args.old)
        old = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(old)
        sides["old"] = (old.new_cache, old.GrowingLayer)

    def run(side: str) -> list[str]:
        generate.new_cache, generate.GrowingLayer = sides[side]
        out = []
        for b in batches:
            toks = generate.greedy_generate(hf, tok, b["input_ids"], b["attention_mask"], new,
                                            tok.eos_token_id, b["icl_options"]["stop_sequences"])
            out += generate.decode_generations(tok, toks)
        return out

    names = list(sides)
    rows = []
    for i in range(args.rounds):
        order = names[i % len(names):] + names[:i % len(names)]
        times, texts = {}, {}
        for name in order:
            t0 = time.perf_counter()
            texts[name] = run(name)
            times[name] = time.perf_counter() - t0
        same = all(texts[n] == texts["foundryx"] for n in names)
        rows.append((i + 1, order[0], times, same))
        print(f"round {i + 1}: " + ", ".join(f"{n} {times[n]:.2f} s" for n in names)
              + f", texts identical: {same}", file=sys.stderr, flush=True)
    others = names[1:]
    head = " | ".join(f"{n} s" for n in names) + " | " + " | ".join(f"{n} / foundryx" for n in others)
    table = "\n".join(
        f"| {n} | {first} | " + " | ".join(f"{t[s]:.2f}" for s in names) + " | "
        + " | ".join(f"{t[o] / t['foundryx']:.2f}" for o in others) + f" | {'yes' if same else 'NO'} |"
        for n, first, t, same in rows)
    summary = "; ".join(
        f"{o} / foundryx median {statistics.median(r):.2f} (min {min(r):.2f}, max {max(r):.2f})"
        for o in others for r in [[t[o] / t["foundryx"] for _, _, t, _ in rows]])
    cmd = (f"python -m benchmarks.kv_cache --task {args.task} --examples {args.examples} "
           f"--batch-size {args.batch_size} --new-tokens {args.new_tokens} --rounds {args.rounds}"
           + (" --old OLD/kv_cache.py" if args.old else ""))
    text = (f"\n### KV cache of the greedy loop: foundryx's vs transformers' DynamicCache\n\n"
            f"{datetime.date.today()}. {platform.machine()}, {os.cpu_count()} cores (load average "
            f"{os.getloadavg()[0]:.1f} at the end), torch {torch.__version__}, transformers "
            f"{transformers.__version__}. Command: `{cmd}`. {args.task} {prepared.num_fewshot}-shot, "
            f"{len(prepared.examples)} examples in {len(batches)} batches of {args.batch_size} "
            f"(prompt widths {[int(b['input_ids'].shape[1]) for b in batches]}), {new} new tokens.\n\n"
            f"| round | first | {head} | same text |\n|---|---|" + "---:|" * (2 * len(names) - 1)
            + f"---|\n{table}\n\n{summary}.\n")
    emit(text, args.out)


if __name__ == "__main__":
    main()
