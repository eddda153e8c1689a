"""Host memory of offloaded frozen weights pinned tensor by tensor, as FSDP2's
``CPUOffloadPolicy(pin_memory=True)`` pins them, against foundryx's one exact-size buffer
(issue 40). Computed, not measured: torch's caching host allocator rounds each pinned block up
to the next power of two (pytorch#150517), and a GPU is needed to pin anything.

    python -m benchmarks.pinned_rounding [--out FILE]

For every recipe in ``yamls/finetune/`` whose ``frozen_base.offload_fraction`` is above 0: the
layers the offload runtime picks (foundryx.parallel.offload.offload_layers' rule, forward order:
q, k, v, o, gate, up, down per block), each row-sharded over the recipe's node's ranks
(``node.gpus``), each shard's stored tensors (FP8 / int8: the rows and a float32 scale per row;
bf16: the rows; NF4: half a byte a weight, a scaler byte per 64, a float32 factor per scaler
group of 256) exactly, and each rounded up to a power of two.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import yaml

from benchmarks.instruments.report_out import emit
from foundryx.parallel.offload import offload_choice

ROOT = Path(__file__).resolve().parents[1]


def pow2(n: int) -> int:
    return 1 << (n - 1).bit_length() if n > 1 else n


def tensors(rows: int, cols: int, dtype: str) -> list[int]:
    """Bytes of each tensor a shard of ``rows`` x ``cols`` stores in ``dtype``."""
    n = rows * cols
    if dtype in ("fp8", "int8"):
        return [n, rows * 4]
    if dtype == "bf16":
        return [2 * n, rows * 4]  # foundryx's RowScaledTensor: scales of 1
    return [n // 2, n // 64, n // (64 * 256) * 4]  # nf4


def layers(cfg: dict) -> list[tuple[int, int]]:
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    kv = cfg["num_key_value_heads"] * (cfg.get("head_dim") or h // cfg["num_attention_heads"])
    return [(h, h), (kv, h), (kv, h), (h, h), (i, h), (i, h), (h, i)] * cfg["num_hidden_layers"]


def recipe_row(path: Path) -> dict | None:
    recipe = yaml.safe_load(path.read_text())
    frozen = (recipe.get("model") or {}).get("frozen_base") or {}
    fraction = frozen.get("offload_fraction", 0)
    if not fraction:
        return None
    shape = str(recipe["variables"]["model_path"]).split("/")[-1].lower()  # yamls/shapes/ names
    cfg = json.loads((ROOT / "yamls" / "shapes" / shape / "config.json").read_text())
    world = (recipe.get("node") or {}).get("gpus", 1)  # no node: one process
    every = layers(cfg)
    chosen = offload_choice(every, fraction)  # the runtime's own choice of layers
    sizes = [t for r, c in chosen for t in tensors(-(-r // world), c, frozen["dtype"])]
    exact, pinned = sum(sizes), sum(pow2(t) for t in sizes)
    return {"recipe": path.name, "shape": shape, "dtype": frozen["dtype"], "fraction": fraction,
            "ranks": world, "layers": f"{len(chosen)} of {len(every)}", "exact": exact, "pinned": pinned}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    rows = [r for p in sorted((ROOT / "yamls" / "finetune").glob("*.yaml")) if (r := recipe_row(p))]
    gib = 2**30
    lines = ["| recipe | base | offload | ranks | layers offloaded | one exact buffer GiB per rank | "
             "pinned per tensor GiB per rank | more | more per node GiB |",
             "|---|---|---:|---:|---|---:|---:|---:|---:|"]
    lines += [f"| {r['recipe']} | {r['dtype']} | {r['fraction']} | {r['ranks']} | {r['layers']} | "
              f"{r['exact'] / gib:.2f} | {r['pinned'] / gib:.2f} | "
              f"+{100 * (r['pinned'] / r['exact'] - 1):.1f}% | "
              f"+{(r['pinned'] - r['exact']) * r['ranks'] / gib:.1f} |" for r in rows]
    emit("\n".join(["", "### Offloaded shards pinned tensor by tensor (FSDP2) against one exact "
                    "buffer (issue 40)", "", "Command: `python -m benchmarks.pinned_rounding` "
                    "(computed from torch's power-of-two rounding of pinned blocks, "
                    "pytorch#150517; not measured).", "", *lines, ""]), a.out)


if __name__ == "__main__":
    main()
