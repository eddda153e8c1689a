"""The longest sequence per GPU size, foundryx's long recipe against the peer, on paper (issue 52).

    python -m benchmarks.long_context --peer /tmp/peer_8192.json /tmp/peer_16384.json \\
        [--foundryx /tmp/long_16k.json /tmp/long_512k.json] [--sizes "24 GB" ...] [--json F]

foundryx: ``foundryx plan yamls/finetune/llama-3.1-8b-lora-long.yaml --search max_seq_len`` at
each GPU size (its bf16 base, and over an FP8 and an NF4 base): the planner's terms, which
count the traced step (docs/long_context.md), with its 10% allocator margin and 1 GiB
context. The peer (plain transformers + peft, gradient checkpointing, SDPA, as
benchmarks/peer_lora.py): two traced steps of benchmarks/flagship_estimate.py (``--sides peer
--batch 1 --seq N --json``) at two lengths; its peak is linear in the length (flash-like
attention, whole logits, every layer's input kept), so the line through them, with the same
margin and context as the planner's, gives its longest length. ``--foundryx``: two traces of
the long recipe, the same line for foundryx (a check of the planner's answer). ``--sizes``: only
these GPU sizes (each is three planner searches; the test of this script runs one).

Then the step at 524,288 tokens on paper: FLOPs of the linear layers (forward, the
checkpointed recompute, the input gradients; LoRA's weight gradients are rank 16 and left
out; the tiled MLP's extra forward) and of causal attention as the flash kernel computes it
(forward 2·b·h·s²·d_head, the recompute the same, backward 2.5x), at an H100's dense bf16
peak; and the offloaded checkpoints' copies, one layer's input each way over PCIe gen5 x16
(64 GB/s a direction by the specification, 80% of it assumed achieved), against the layer's
compute they hide behind.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RECIPE = "yamls/finetune/llama-3.1-8b-lora-long.yaml"
SHAPE = ["variables.model_path=yamls/shapes/llama-3.1-8b"]
GIB = 2**30
# GPU sizes: a 24 GB and a 48 GB card (22.35 / 44.70 GiB as torch reports decimal GB), the
# H100 80GB (79.1 GiB) and the H200 (139.8 GiB), as foundryx/plan/gpus.py has them
SIZES = {"24 GB": ("h100", "24GB"), "48 GB": ("h100", "48GB"), "80 GB (H100)": ("h100", None),
         "141 GB (H200)": ("h200", None)}
BASES = ("bf16", "fp8", "nf4")
MARGIN, CONTEXT = 0.10, 1 * GIB  # the planner's allocator margin and CUDA context
H100_BF16 = 989e12
PCIE5 = 64e9 * 0.8  # bytes/s a direction: PCIe gen5 x16 by the specification, 80% achieved


def foundryx_longest(gpu: str, memory: str | None, base: str) -> dict:
    from foundryx.plan.planner import make_plan

    plan = make_plan(RECIPE, [*SHAPE, f"model.frozen_base.dtype={base}"], gpu=gpu,
                     gpu_memory=memory)
    answer = plan.longest_sequence()
    return {"capacity_gib": plan.capacity / GIB, **answer.to_json()}


def line(files: list[Path], side: str) -> tuple[float, float, list[tuple[int, float]]]:
    """(GiB at zero length, GiB a token) through two traces ``files`` of ``side``."""
    points = []
    for f in files:
        data = json.loads(f.read_text())[side]
        points.append((int(data["seq"]), float(data["peak_gib"])))
    (s1, p1), (s2, p2) = sorted(points)
    slope = (p2 - p1) / (s2 - s1)
    return p1 - slope * s1, slope, points


def longest_on_line(intercept: float, slope: float, capacity_gib: float) -> int:
    """The longest multiple of 1,024 tokens whose peak, with the planner's margin and context,
    fits ``capacity_gib``."""
    usable = (capacity_gib - CONTEXT / GIB) / (1 + MARGIN)
    return max(0, int((usable - intercept) / slope) // 1024 * 1024)


def on_paper(seq: int = 524288) -> dict:
    """The step at ``seq`` tokens on paper (module doc), Llama-3.1-8B's shape."""
    cfg = json.loads((ROOT / "yamls/shapes/llama-3.1-8b/config.json").read_text())
    d, f, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    h, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dh = d // h
    per_layer_linear = d * (d + 2 * kv * dh) + d * d + 3 * d * f  # q, k, v, o, gate, up, down
    mlp = 3 * d * f
    # forward + recompute + input gradients (2 each per weight a token), + the tiled MLP's rerun
    linear = seq * (L * (3 * 2 * per_layer_linear + 2 * mlp) + 2 * 2 * d * cfg["vocab_size"])
    attn_fwd = 2 * h * seq * seq * dh  # 4·h·s²·d halved: causal
    attention = L * attn_fwd * (1 + 1 + 2.5)  # forward, recompute, backward
    total = linear + attention
    copy_bytes = seq * d * 2  # one layer's input, bf16
    layer_fwd_s = (L and (2 * per_layer_linear * seq + attn_fwd) / H100_BF16)
    return {"seq": seq, "linear_tflop": linear / 1e12, "attention_tflop": attention / 1e12,
            "attention_share": attention / total, "step_s_at_peak": total / H100_BF16,
            "copy_gib_each_way": L * copy_bytes / GIB, "copy_s_a_layer": copy_bytes / PCIE5,
            "layer_forward_s_at_peak": layer_fwd_s,
            "copy_s_a_step_each_way": L * copy_bytes / PCIE5}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peer", type=Path, nargs=2, required=True,
                   help="two flagship_estimate.py --sides peer JSON files at two lengths")
    p.add_argument("--foundryx", type=Path, nargs=2, default=None,
                   help="two flagship_estimate.py --recipe (long) --sides bf16 JSON files")
    p.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES),
                   help="only these GPU sizes")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)
    b0, b1, points = line(a.peer, "peer")
    out = {"peer_line": {"gib_at_zero": b0, "gib_per_1k_tokens": b1 * 1024, "traced": points}}
    if a.foundryx:
        f0, f1, fpoints = line(a.foundryx, "bf16")
        out["foundryx_line"] = {"gib_at_zero": f0, "gib_per_1k_tokens": f1 * 1024,
                                "traced": fpoints}
    rows = []
    for size in a.sizes:
        gpu, memory = SIZES[size]
        row = {"gpu": size}
        for base in BASES:
            ans = foundryx_longest(gpu, memory, base)
            row[f"foundryx {base}"] = ans["max_seq_len"]
            row["capacity_gib"] = ans["capacity_gib"]
        row["peer"] = longest_on_line(b0, b1, row["capacity_gib"])
        if a.foundryx:
            row["foundryx bf16 (traced line)"] = longest_on_line(f0, f1, row["capacity_gib"])
        rows.append(row)
        print(json.dumps(row), flush=True)
    out["rows"] = rows
    out["on_paper"] = on_paper()
    print(json.dumps(out["on_paper"], indent=1))
    if a.json:
        a.json.write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
