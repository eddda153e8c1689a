"""Peak device memory of one flagship LoRA step, predicted on a CPU (issue 46).

    python -m benchmarks.flagship_estimate --shape yamls/shapes/llama-3.1-8b [--json FILE]
    python -m benchmarks.flagship_estimate --shape benchmarks/gpu_runbook/shapes/llama-tiny \\
        --seq 128 --sides peer,bf16

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
from benchmarks.instruments.step_memory import CATEGORIES, CategoryTracker

# Peak allocated GiB measured on one NVIDIA H100 80GB HBM3 (issue 46's table, 2026-11-27,
# foundryx at ea9e5db; the peer on transformers 5.17.0 + peft 0.21.0): the calibration target.
MEASURED_H100 = {"peer": 29.4, "bf16": 36.3, "fp8": 29.8, "nf4": 26.6, "fp8-offload0.5": 26.5}


def estimate(side: str, shape: Path, batch: int = 2, seq: int = 4096,
             overrides: list[str] | tuple[str, ...] = ()) -> dict:
    """``{"peak_gib", "categories", "seconds"}`` for ``side``."""
    start = time.perf_counter()
    with fake_step.fake_mode(), fake_step.gpu_kernels():
        step = fake_step.build(side, shape, batch, seq, overrides)
        trainable = [p for p in step.model.parameters() if p.requires_grad]
        tracker = CategoryTracker(step.vocab, trainable)
        tracker.register_model(step.model, step.frozen_linear)
        tracker.add(step.batch["input_ids"], "other")
        copy_tagged = _tag_offload_copies(step, tracker)

        def phase(name: str) -> contextlib.AbstractContextManager:
            return tracker.in_phase(name)

        try:
            with tracker, tracker.watching_modules(), copy_tagged:
                fake_step.run_step(step, phase)  # the first step makes the optimizer state
                tracker.peak, tracker.at_peak = tracker.total, dict(tracker.totals)
                fake_step.run_step(step, phase)
        except Exception as e:  # noqa: BLE001 - said with where it stopped
            raise fake_step.NotTraceable(
                f"{side}: the step on fake tensors stopped at {fake_step.where(e)}: "
                f"{type(e).__name__}: {fake_step.said(e)}") from e
        row = tracker.report()
    row["seconds"] = time.perf_counter() - start
    return row


def _tag_offload_copies(step: fake_step.FakeStep, tracker: CategoryTracker):
    """Count foundryx's host-to-device copies of offloaded weights as ``offload prefetch``."""
    stack = contextlib.ExitStack()
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
    p.add_argument("--json", type=Path, help="write {side: {peak_gib, categories}} here")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    def one(side: str) -> dict:
        row = estimate(side, a.shape, a.batch, a.seq, a.overrides)
        print(f"{side}: peak {row['peak_gib']:.2f} GiB ({row['seconds']:.0f} s)", flush=True)
        return row

    rows = fake_step.each_side("flagship_estimate", a.shape, a.sides, one)
    if rows is None:
        return 2
    print(table(rows))
    if a.json:
        a.json.write_text(json.dumps({s: {"peak_gib": r["peak_gib"], "categories": r["categories"]}
                                      for s, r in rows.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
