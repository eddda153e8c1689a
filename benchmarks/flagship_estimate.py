"""Peak device memory of one flagship LoRA step, predicted on a CPU (issue 46).

    python -m benchmarks.flagship_estimate --shape yamls/shapes/llama-3.1-8b [--json FILE]
    python -m benchmarks.flagship_estimate --shape benchmarks/gpu_runbook/shapes/llama-tiny \\
        --seq 128 --sides peer,bf16
    python -m benchmarks.flagship_estimate --recipe yamls/finetune/llama-3.1-8b-lora-long.yaml \\
        --sides bf16 --batch 1 --seq 524288 [--layers 2] --json F      # issue 52

``--recipe`` traces that recipe's step for foundryx's sides (default: the flagship's); a recipe
that offloads its checkpoints has their host copies counted apart (``host_peak_gib``), not in
the device's peak. ``--layers N`` traces N decoder layers and scales the per-layer categories
to the shape's depth (:func:`scaled_to_depth`).

For each side (``peer``: plain transformers + peft; ``bf16``, ``fp8``, ``nf4``: foundryx's
large-model recipe over that frozen base; ``fp8-offload0.5``: half its frozen layers
offloaded) the real step runs on fake tensors (benchmarks/fake_step.py) under
benchmarks/step_memory.py's tracker, and one row gives the peak of the measured (second) step
and its categories, which add up to it. ``--json`` writes ``{side: {"peak_gib": x,
"categories": {name: gib}}}``.

torch's own tracker (``torch.distributed._tools.mem_tracker.MemTracker``) cannot run these
steps: it registers a gradient hook on every parameter of every module it enters, and a
frozen parameter refuses one ("cannot register a hook on a tensor that doesn't require
gradient", torch 2.7 and 2.15), so a LoRA model stops it. The tracker here counts the same
storages; tests/test_step_instruments.py holds its peak equal to MemTracker's on a step
MemTracker can run (every parameter trainable).

Calibrated against the H100 figures of issue 46 (benchmarks/RESULTS.md, "Predicted device
memory"): each side's predicted peak against the measured peak allocated memory. A shape or
side that cannot be traced says which module stopped it and exits 2.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import sys
import time
from pathlib import Path

from benchmarks.instruments import fake_step
from benchmarks.instruments.step_memory import CATEGORIES, HOST, CategoryTracker

# Peak allocated GiB measured on one NVIDIA H100 80GB HBM3 (issue 46's table, 2026-11-27,
# foundryx at ea9e5db; the peer on transformers 5.17.0 + peft 0.21.0): the calibration target.
WARMUP_TOKENS = 4096  # the first (unmeasured) step's sequence length, at most
MEASURED_H100 = {"peer": 29.4, "bf16": 36.3, "fp8": 29.8, "nf4": 26.6, "fp8-offload0.5": 26.5}


def estimate(side: str, shape: Path, batch: int = 2, seq: int = 4096,
             overrides: list[str] | tuple[str, ...] = (), recipe: Path | None = None,
             layers: int | None = None) -> dict:
    """``{"peak_gib", "categories", "seconds"}`` for ``side`` (and ``host_peak_gib``, the
    offloaded checkpoints' host memory, where the recipe offloads them). ``layers``: trace
    that many decoder layers of foundryx's side and scale to the shape's (see
    :func:`scaled_to_depth`)."""
    if layers is not None:
        if side == "peer":
            raise fake_step.NotTraceable("--layers: foundryx's sides only (the peer keeps every "
                                         "layer's input: its peak grows with depth)")
        overrides = [*overrides, f"model.config_overrides.num_hidden_layers={layers}"]
        row = estimate(side, shape, batch, seq, overrides, recipe)
        return scaled_to_depth(row, layers, fake_step.shape_config(shape)["num_hidden_layers"])
    start = time.perf_counter()
    with fake_step.fake_mode(), fake_step.gpu_kernels():
        step = fake_step.build(side, shape, batch, seq, overrides, recipe)
        trainable = [p for p in step.model.parameters() if p.requires_grad]
        tracker = CategoryTracker(step.vocab, trainable)
        tracker.register_model(step.model, step.frozen_linear)
        tracker.add(step.batch["input_ids"], "other")
        copy_tagged = _tag_offload_copies(step, tracker)

        def phase(name: str) -> contextlib.AbstractContextManager:
            return tracker.in_phase(name)

        # the first step only makes the optimizer state: at a long length it runs on a short
        # batch (WARMUP_TOKENS a sequence), which makes the same state in a fraction of the time
        batch = step.batch
        short = {k: v[:, :min(seq, WARMUP_TOKENS)] for k, v in batch.items()}
        try:
            with tracker, tracker.watching_modules(), copy_tagged:
                step.batch = short
                fake_step.run_step(step, phase)  # the first step makes the optimizer state
                step.batch = batch
                tracker.peak, tracker.at_peak = tracker.total, dict(tracker.totals)
                fake_step.run_step(step, phase)
        except Exception as e:  # noqa: BLE001 - said with where it stopped
            raise fake_step.NotTraceable(
                f"{side}: the step on fake tensors stopped at {fake_step.where(e)}: "
                f"{type(e).__name__}: {fake_step.said(e)}") from e
        row = tracker.report()
    row["seconds"] = time.perf_counter() - start
    return row


PER_LAYER = ("frozen base", "adapters + optimizer")  # categories that grow with the depth


def scaled_to_depth(row: dict, traced: int, depth: int) -> dict:
    """A step traced with ``traced`` decoder layers, scaled to ``depth``: the frozen base and
    the adapters with their gradients and optimizer state are per layer (x depth / traced),
    and so is the offloaded checkpoints' host memory; the rest is not, for a recipe whose
    checkpoints are offloaded (what the device holds of activations is the layer being
    recomputed and the next one's input, at any depth). Checked against the whole depth at
    16K tokens (benchmarks/RESULTS.md, "Long context")."""
    k = depth / traced
    cats = dict(row["categories"])
    grown = sum(cats.get(c, 0) for c in PER_LAYER) * (k - 1)
    for c in PER_LAYER:
        cats[c] = cats.get(c, 0) * k
    out = {**row, "categories": cats, "peak_gib": row["peak_gib"] + grown,
           "traced_layers": traced}
    if "host_peak_gib" in row:
        out["host_peak_gib"] = row["host_peak_gib"] * k
    return out


def _tag_offload_copies(step: fake_step.FakeStep, tracker: CategoryTracker):
    """Count foundryx's host-to-device copies of offloaded weights as ``offload prefetch``."""
    stack = contextlib.ExitStack()
    saves = step.activation_offload
    if saves is not None:  # offloaded checkpoints: host copies are host memory
        to_host, to_device = saves._to_host, saves._to_device

        def host(t, _real=to_host):  # noqa: ANN001, ANN202
            with tracker.tagged(HOST):
                return _real(t)

        def back(entry, _real=to_device):  # noqa: ANN001, ANN202
            with tracker.tagged("checkpoint prefetch"):
                return _real(entry)

        saves._to_host, saves._to_device = host, back
        stack.callback(setattr, saves, "_to_host", to_host)
        stack.callback(setattr, saves, "_to_device", to_device)
    for source in step.offloaded:
        real = source._copy

        def tagged(device, _real=real):  # noqa: ANN001, ANN202
            with tracker.tagged("offload prefetch"):
                return _real(device)

        source._copy = tagged
        stack.callback(setattr, source, "_copy", real)
    return stack


def table(rows: dict[str, dict]) -> str:
    short = [c.split()[0] for c in CATEGORIES]
    head = f"| side | peak GiB | H100 measured | {' | '.join(short)} |"
    lines = [head, "|" + "---|" * (3 + len(CATEGORIES))]
    for side, r in rows.items():
        meas = MEASURED_H100.get(side)
        cells = " | ".join(f"{r['categories'].get(c, 0):.2f}" for c in CATEGORIES)
        lines.append(f"| {side} | {r['peak_gib']:.2f} | {meas if meas else '-'} | {cells} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", type=Path, default=Path("yamls/shapes/llama-3.1-8b"),
                   help="a folder with a Llama config.json")
    p.add_argument("--sides", default=",".join(fake_step.SIDES))
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    fake_step.add_recipe_overrides(p)
    p.add_argument("--layers", type=int, default=None,
                   help="trace this many decoder layers and scale the per-layer categories to "
                   "the shape's depth (foundryx's sides of a recipe that offloads its "
                   "checkpoints: a long sequence traces in minutes)")
    p.add_argument("--json", type=Path, help="write {side: {peak_gib, categories}} here")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    def one(side: str) -> dict:
        row = estimate(side, a.shape, a.batch, a.seq, a.overrides, a.recipe, a.layers)
        host = f", host {row['host_peak_gib']:.2f} GiB" if "host_peak_gib" in row else ""
        print(f"{side}: peak {row['peak_gib']:.2f} GiB{host} ({row['seconds']:.0f} s)", flush=True)
        return row

    rows = fake_step.each_side("flagship_estimate", a.shape, a.sides, one)
    if rows is None:
        return 2
    print(table(rows))
    if a.json:
        a.json.write_text(json.dumps({s: {"seq": a.seq, "batch": a.batch,
                                          **{k: r[k] for k in ("peak_gib", "categories",
                                                               "host_peak_gib", "traced_layers")
                                             if k in r}}
                                      for s, r in rows.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
