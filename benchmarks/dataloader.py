"""Dataloader speed against a CPU quickstart training step.

    python -m benchmarks.dataloader                 # uses (or builds) data/quickstart
    python -m benchmarks.dataloader --data DIR --batches 2 --steps 1   # a quick look

Rows: sequences/s of the ``text`` loader on the quickstart MDS (batch 16 x 128 tokens,
shuffled), with ``emit_sequence_id``, with two streams mixed 0.7/0.3, and of the packed
``finetuning`` loader; then the time of one quickstart training step (the model of
yamls/quickstart.yaml: forward, backward and AdamW on 16 x 128 tokens) and the share of a step
the loader would take. The loader is "never the bottleneck" when that share is small.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import tempfile
import time
from pathlib import Path

import torch
import yaml

from foundryx.data.finetuning.loader import build_finetuning_dataloader
from foundryx.data.quickstart import prepare_quickstart
from foundryx.data.synthetic import generate_corpus
from foundryx.data.text import build_text_dataloader
from foundryx.data.tokenizers import build_hf_tokenizer
from foundryx.models.mpt.composer import ComposerMPTCausalLM

ROOT = Path(__file__).resolve().parents[1]

BATCH, SEQ = 16, 128


def rate(spec, batches: int) -> float:
    """Sequences per second over ``batches`` batches (after one warm-up batch)."""
    it = iter(spec.dataloader)
    next(it)
    start, n = time.perf_counter(), 0
    for _ in range(batches):
        n += len(next(it)["input_ids"])
    return n / (time.perf_counter() - start)


def step_time(tokenizer, steps: int) -> float:
    model_cfg = yaml.safe_load((ROOT / "yamls/quickstart.yaml").read_text())["model"]
    model_cfg = {k: v for k, v in model_cfg.items() if k != "name"}
    model_cfg["max_seq_len"] = SEQ
    model = ComposerMPTCausalLM(tokenizer, **model_cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.randint(0, len(tokenizer), (BATCH, SEQ))
    batch = {"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)}
    times = []
    for _ in range(steps + 1):
        start = time.perf_counter()
        loss = model.loss(model(batch), batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        times.append(time.perf_counter() - start)
    return min(times[1:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", default=str(ROOT / "data/quickstart"))
    ap.add_argument("--batches", type=int, default=200)
    ap.add_argument("--steps", type=int, default=5, help="timed training steps (the fastest counts)")
    args = ap.parse_args()
    data = prepare_quickstart(args.data)
    tok = build_hf_tokenizer(str(data / "tokenizer"))
    mds = str(data / "mds")
    base = {"local": mds, "split": "train", "max_seq_len": SEQ, "shuffle": True}
    mix = {"streams": {"train": {"local": mds, "split": "train", "proportion": 0.7},
                       "val": {"local": mds, "split": "val", "proportion": 0.3}},
           "max_seq_len": SEQ, "shuffle": True}
    rows = {}
    print(f"load average before: {os.getloadavg()}", flush=True)
    for name, ds in (("text", base), ("text + sequence_id", {**base, "emit_sequence_id": True}),
                     ("text, 2 streams 0.7/0.3", mix)):
        rows[name] = rate(build_text_dataloader({"dataset": ds}, tok, BATCH),
                          args.batches)
        print(f"  {name}: {rows[name]:,.0f} sequences/s", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        docs = generate_corpus(4000, seed=1)
        chats = [{"messages": [{"role": "user", "content": a},
                               {"role": "assistant", "content": b}]}
                 for a, b in zip(docs[::2], docs[1::2])]
        src = Path(tmp) / "chat.jsonl"
        src.write_text("".join(json.dumps(c) + "\n" for c in chats))
        ft = {"dataset": {"path": str(src), "max_seq_len": 512,
                                                "packing_ratio": "auto"}}
        start = time.perf_counter()
        spec = build_finetuning_dataloader(ft, tok, BATCH)
        build_s = time.perf_counter() - start
        name = "finetuning, packed (512 tokens)"
        rows[name] = rate(spec, min(args.batches, len(spec.dataloader) - 2))
        print(f"  {name}: {rows[name]:,.0f} sequences/s (built in {build_s:.1f} s)", flush=True)
    step = step_time(tok, args.steps)
    print(f"\nload average after: {os.getloadavg()}\n")
    print(f"{datetime.date.today()}: batch {BATCH} x {SEQ}; quickstart training step "
          f"{step * 1000:.0f} ms ({BATCH / step:,.0f} sequences/s)\n")
    print("| loader | sequences/s | ms per batch of 16 | share of a quickstart step |")
    print("|---|---|---|---|")
    for name, r in rows.items():
        ms = 1000 * BATCH / r
        print(f"| {name} | {r:,.0f} | {ms:.2f} | {ms / (1000 * step):.1%} |")


if __name__ == "__main__":
    main()
