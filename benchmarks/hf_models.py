"""The same Llama-style model trained as ``mpt_causal_lm`` and, exported, as ``hf_causal_lm``;
and how fast ``foundryx export`` turns a checkpoint into a Llama folder.

    python -m benchmarks.hf_models                              # print the table
    python -m benchmarks.hf_models --out benchmarks/RESULTS.md  # and append it there

Training: fp32 on CPU, AdamW, the same random batches for both; tokens/s over the timed steps
after warm-up, the two models taking turns. The first-step losses must agree (same weights, same math). Export: a
checkpoint-shaped ``.pt`` of the model → Llama folder (read, check, convert, write safetensors).
"""

from __future__ import annotations

import argparse
import datetime
import tempfile
import time
from pathlib import Path

import torch

from foundryx.export import export_checkpoint, write_model_metadata
from foundryx.models.hf import ComposerHFCausalLM
from foundryx.models.mpt.composer import ComposerMPTCausalLM

LLAMA_STYLE = {"attn_config": {"rope": True}, "norm_type": "rmsnorm",
               "ffn_config": {"ffn_type": "swiglu"}, "no_bias": True}
SIZES = {  # name: (model config, batch, seq, timed steps)
    "quickstart": ({"d_model": 128, "n_heads": 4, "n_layers": 4, "vocab_size": 1024}, 16, 128, 10),
    "125m": ({"d_model": 768, "n_heads": 12, "n_layers": 12, "vocab_size": 50368}, 1, 256, 3),
}


def train_speeds(models: list, batches: list[dict], steps: int) -> list[tuple[float, float]]:
    """(tokens/s, first-step loss) per model. The models take turns step by step, so a busy
    machine slows them alike; the first step of each is a warm-up and not timed."""
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-4) for m in models]
    seconds, first = [0.0] * len(models), [0.0] * len(models)
    for i, batch in enumerate(batches[: steps + 1]):
        for j, (model, opt) in enumerate(zip(models, opts)):
            start = time.perf_counter()
            loss = model.loss(model(batch), batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
            if i == 0:
                first[j] = loss.item()
            else:
                seconds[j] += time.perf_counter() - start
    tokens = steps * batches[0]["input_ids"].numel()
    return [(tokens / s, f) for s, f in zip(seconds, first)]


def bench(name: str, tmp: Path) -> list[str]:
    cfg, batch, seq, steps = SIZES[name]
    torch.manual_seed(0)
    mpt = ComposerMPTCausalLM(None, **cfg, **LLAMA_STYLE, max_seq_len=seq)
    ckpt = tmp / name
    ckpt.mkdir()
    torch.save(mpt.state_dict(), ckpt / "weights.pt")
    write_model_metadata(ckpt, mpt)
    start = time.perf_counter()
    export_checkpoint(ckpt / "weights.pt", tmp / f"{name}-llama", progress=False)
    export_s = time.perf_counter() - start
    size_mb = sum(p.stat().st_size for p in (tmp / f"{name}-llama").glob("*.safetensors")) / 2**20
    hf = ComposerHFCausalLM(pretrained_model_name_or_path=str(tmp / f"{name}-llama"))
    gen = torch.Generator().manual_seed(1)
    batches = []
    for _ in range(steps + 1):
        ids = torch.randint(0, cfg["vocab_size"], (batch, seq), generator=gen)
        batches.append({"input_ids": ids, "labels": ids, "attention_mask": torch.ones_like(ids)})
    (mpt_tps, mpt_loss), (hf_tps, hf_loss) = train_speeds([mpt, hf], batches, steps)
    params = sum(p.numel() for p in mpt.parameters()) / 1e6
    return [
        f"| {name} ({params:.0f}M params, {batch}x{seq}) | {mpt_tps:,.0f} | {hf_tps:,.0f} | "
        f"{hf_tps / mpt_tps:.2f} | {abs(mpt_loss - hf_loss):.1e} | {export_s:.1f} s "
        f"({size_mb:.0f} MB, {size_mb / export_s:.0f} MB/s) |"
    ]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--sizes", nargs="+", default=list(SIZES), choices=list(SIZES))
    p.add_argument("--out", help="append the section to this markdown file")
    args = p.parse_args()
    import composer
    import transformers

    rows = [
        "| model | mpt_causal_lm tok/s | hf_causal_lm (Llama) tok/s | HF / MPT | first-loss diff "
        "| export (.pt → Llama folder) |",
        "|---|---|---|---|---|---|",
    ]
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.sizes:
            rows += bench(name, Path(tmp))
    section = "\n".join([
        "", "## hf_causal_lm vs mpt_causal_lm, and export speed (issue 4)", "",
        f"{datetime.date.today()}. 2-core CPU VM, no GPU; torch {torch.__version__}, composer "
        f"{composer.__version__}, transformers {transformers.__version__}; fp32, "
        f"{torch.get_num_threads()} threads. Command: `python -m benchmarks.hf_models "
        f"--sizes {' '.join(args.sizes)}`.", "", *rows, "",
    ])
    print(section)
    if args.out:
        with open(args.out, "a") as f:
            f.write(section)


if __name__ == "__main__":
    main()
