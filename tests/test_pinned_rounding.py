"""benchmarks/pinned_rounding.py: the host memory FSDP2's per-tensor pinning would hold for the
offloading recipes, the figure benchmarks/RESULTS.md and docs/design.md give as the reason
foundryx keeps its own offload runtime (issue 40)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import pinned_rounding

ROOT = Path(__file__).parents[1]


def test_power_of_two_rounding_and_the_stored_tensors():
    assert [pinned_rounding.pow2(n) for n in (1, 2, 3, 1024, 1025, 109_051_904)] == \
        [1, 2, 4, 1024, 2048, 134_217_728]
    assert pinned_rounding.tensors(2048, 16384, "fp8") == [2048 * 16384, 2048 * 4]
    assert pinned_rounding.tensors(64, 256, "nf4") == [64 * 128, 256, 4]


@pytest.mark.slow  # over 5 s: one leg (CI time, 2026-11-29)
@pytest.mark.modern_leg
def test_the_405b_recipe_figure_is_the_one_recorded():
    row = pinned_rounding.recipe_row(ROOT / "yamls" / "finetune" / "llama-3.1-405b-lora-fp8.yaml")
    assert (row["layers"], row["ranks"], row["dtype"]) == ("485 of 882", 8, "fp8")
    gib = 2**30
    assert (round(row["exact"] / gib, 2), round(row["pinned"] / gib, 2)) == (25.67, 30.53)
    out = subprocess.run([sys.executable, "-m", "benchmarks.pinned_rounding"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120, check=True).stdout
    line = "| llama-3.1-405b-lora-fp8.yaml | fp8 | 0.55 | 8 | 485 of 882 | 25.67 | 30.53 | +18.9% | +38.8 |"
    assert line in out and line in (ROOT / "benchmarks" / "RESULTS.md").read_text()
    assert pinned_rounding.recipe_row(ROOT / "yamls" / "finetune" / "llama-3.1-70b-lora.yaml") is None
