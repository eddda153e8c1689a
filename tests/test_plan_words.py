"""What `foundryx plan` says in words: counts in the unit that shows them (a LoRA run's 41.9M
trainable, not 0.042B) and the loss term described as the model computes it (MPT's fused loss
only for MPT)."""

from __future__ import annotations

from pathlib import Path

import pytest

from foundryx.cli import main
from foundryx.plan.render import count

ROOT = Path(__file__).parents[1]


def test_counts_in_the_unit_that_shows_them():
    assert [count(n) for n in (8.03e9, 41_943_040, 1_572_864, 12_345, 512)] == \
        ["8.03B", "41.9M", "1.57M", "12.3k", "512"]


@pytest.mark.parametrize("config, overrides, loss", [
    ("yamls/finetune/llama-lora.yaml", ["variables.model_path=yamls/shapes/llama-3.1-8b"],
     "(the fused loss: one chunk, in place)"),
    ("yamls/mpt-1b.yaml", [], "(the fused loss: one chunk, in place)"),
    ("yamls/finetune/llama-lora.yaml", ["variables.model_path=yamls/shapes/llama-3.1-8b",
                                        "model.fused_loss=false"],
     "(whole: the model's own loss)"),
])
def test_plan_header_and_loss_term(config, overrides, loss, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["plan", config, *overrides, "--gpus", "8", "--gpu", "h100"]) in (0, 1)
    out = capsys.readouterr().out
    header = next(ln for ln in out.splitlines() if ln.startswith("foundryx plan: "))
    assert ".000B" not in header, header
    if "lora" in config:
        assert "B parameters (41.9M trainable)" in header, header
    row = next(ln for ln in out.splitlines() if ln.strip().startswith("logits_and_loss"))
    assert row.endswith(loss), row
