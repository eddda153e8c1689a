"""``amp_bf16`` on a CPU: Composer 0.32 refuses it there, so foundryx hands Composer fp32 and runs
the forward and the loss under torch's CPU autocast to bf16 itself (the recipes ship amp_bf16,
and their tests run it as shipped)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from composer.core import Event

from foundryx.callbacks.cpu_autocast import CpuAutocast
from foundryx.config import load_config
from foundryx.loggers.jsonl import read_metrics
from foundryx.train import composer_precision, train

ROOT = Path(__file__).parents[1]


def test_autocast_covers_forward_and_loss_not_backward():
    cb = CpuAutocast()
    for enter, leave in ((Event.BEFORE_FORWARD, Event.AFTER_FORWARD), (Event.BEFORE_LOSS, Event.AFTER_LOSS),
                         (Event.EVAL_BEFORE_FORWARD, Event.EVAL_AFTER_FORWARD)):
        cb.run_event(enter, None, None)
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype == torch.bfloat16
        cb.run_event(leave, None, None)
        assert not torch.is_autocast_enabled("cpu")  # the backward runs outside it
    assert cb.entered == 3
    cb.run_event(Event.BEFORE_FORWARD, None, None)
    cb.run_event(Event.FIT_END, None, None)  # a fit that ends mid-step leaves nothing behind
    assert not torch.is_autocast_enabled("cpu")


def test_composer_gets_fp32_and_the_callback_only_for_bf16_on_cpu(caplog):
    with caplog.at_level(logging.INFO, logger="foundryx"):
        precision, extra = composer_precision("amp_bf16", "cpu")
    assert precision == "fp32" and [type(c) for c in extra] == [CpuAutocast]
    assert "runs the forward and loss under torch's CPU autocast to bf16" in caplog.text
    assert composer_precision("amp_bf16", "gpu") == ("amp_bf16", [])
    assert composer_precision("fp32", "cpu") == ("fp32", [])


@pytest.mark.slow
def test_quickstart_in_amp_bf16_on_cpu_computes_in_bf16_and_learns(quickstart_data, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    overrides = [f"variables.data_root={quickstart_data}", "max_duration=12ba", "device=cpu",
                 "precision=amp_bf16", "eval_interval=12ba", "save_folder=null",
                 f"loggers.jsonl.path={tmp_path}/m.jsonl", "progress_bar=false", "compile.enabled=false"]
    trainer = train(load_config(str(ROOT / "yamls/quickstart.yaml"), overrides, world_size=1))
    (cb,) = [c for c in trainer.state.callbacks if isinstance(c, CpuAutocast)]
    assert cb.entered >= 2 * 12  # every training forward and loss
    assert trainer.state.outputs.dtype == torch.bfloat16  # the last forward's logits
    assert all(p.dtype == torch.float32 for p in trainer.state.model.parameters())  # master weights
    curve = [r["loss/train/total"] for r in read_metrics(tmp_path / "m.jsonl") if "loss/train/total" in r]
    assert len(curve) == 12 and all(map(torch.isfinite, torch.tensor(curve)))
    assert sum(curve[-3:]) / 3 < sum(curve[:3]) / 3 - 0.5, curve
