"""The planner's memory for ``activation_checkpointing.mode: selective`` and ``mode: auto``
(issue 51, goal 3): what a selectively checkpointed block keeps, against the fake-tensor step's
peak; auto picks selective where the planned peak fits the device, else full, in one line."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from foundryx.config import load_config
from foundryx.errors import ConfigError
from foundryx.plan.checkpointing import choose_mode
from foundryx.plan.memory import GiB, terms
from foundryx.plan.settings import plan_setup

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "benchmarks" / "gpu_runbook" / "shapes" / "llama-tiny"
RECIPE = "yamls/finetune/llama-8b-lora-fp8.yaml"
EIGHT_B = ["variables.model_path=yamls/shapes/llama-3.1-8b"]

pytestmark = pytest.mark.usefixtures("one_thread")


def test_selective_kept_bytes_match_the_fake_step():
    """The flagship recipe on the tiny Llama (d 64, kv 32, ffn 128, LoRA r 16 all-linear, one
    pass), 2 x 512 tokens: what selective checkpointing adds to the planned activations over
    full checkpointing is what it adds to the fake-tensor step's peak (benchmarks/
    flagship_estimate.py), less the attention's output and log-sum-exp, which the step's
    flash-like attention (a custom function, not an aten op the policy sees) does not keep. By
    hand: each adapted layer counts its base product and its rank-r product, so the base
    products are the odd ones and all are kept: 64 + 32 + 32 + 64 + 128 + 128 + 64 = 512
    bf16 values a token a block."""
    from benchmarks import flagship_estimate
    from benchmarks.instruments import fake_step

    b, seq, layers = 2, 512, 2
    planned, peaks = {}, {}
    for mode in ("full", "selective"):
        over = [f"activation_checkpointing.mode={mode}"]
        peaks[mode] = flagship_estimate.estimate("bf16", TINY, b, seq, over)["peak_gib"] * GiB
        loaded = load_config(fake_step.RECIPE,
                             [*fake_step.foundryx_overrides(TINY, "bf16", b, seq), *over],
                             world_size=1, component_sections=("model", "optimizer"))
        p = plan_setup(loaded, 1, 1, "cuda")
        planned[mode] = terms(p.census, p.setup)["activations"]
        if mode == "selective":
            assert p.setup.ac_selective and p.setup.selective_kept == 512
    attention = layers * (b * seq * 64 * 2 + b * 4 * seq * 4)  # output (bf16), lse (fp32/head)
    by_hand = layers * b * seq * 512 * 2
    assert planned["selective"] - planned["full"] - attention == by_hand
    assert peaks["selective"] - peaks["full"] == pytest.approx(by_hand, rel=0.02)


def _loaded(overrides=()):
    return load_config(ROOT / RECIPE, [*EIGHT_B, *overrides], world_size=1,
                       component_sections=("model", "optimizer"))


def test_auto_picks_selective_where_it_fits_and_full_where_not(caplog):
    """The flagship recipe (mode: auto) on one GPU of 80 GB, 48 GB and 24 GB (the device's
    memory passed in, as `foundryx plan --gpu-memory` does) and on a CPU; the line says which
    and both planned peaks; `foundryx train` decides it so before building."""
    from foundryx.plan.gpus import find_gpu
    from foundryx.train import resolve_auto_mode

    loaded = _loaded()
    assert loaded.cfg.activation_checkpointing.mode == "auto"
    big = choose_mode(loaded, 1, "cuda", 80 * 10**9, "h100")
    sel, full = big.selective_bytes, big.full_bytes
    assert big.mode == "selective" and full < sel < 80 * 10**9
    between = (full + sel) // 2
    assert choose_mode(loaded, 1, "cuda", between, "gpu").mode == "full"
    caplog.set_level(logging.INFO, logger="foundryx")
    h100 = find_gpu("h100")
    got = resolve_auto_mode(loaded, "gpu", (h100.device_name, h100.memory, h100.kind))
    assert got.cfg.activation_checkpointing.mode == "selective"
    said = [r.getMessage() for r in caplog.records if "mode: auto" in r.getMessage()]
    assert said == [f"activation_checkpointing.mode: auto -> selective (planned peak "
                    f"{sel / GiB:.1f} GiB fits the {h100.device_name}'s {h100.memory / GiB:.1f} "
                    f"GiB; full would be {full / GiB:.1f} GiB with more recompute)"]
    assert f"```\n{said[0]}\n```" in (ROOT / "docs" / "planning.md").read_text()  # as shown
    caplog.clear()
    small = resolve_auto_mode(loaded, "gpu", ("a 24 GB GPU", 24 * 10**9, "cuda"))
    assert small.cfg.activation_checkpointing.mode == "full"
    (line,) = [r.getMessage() for r in caplog.records if "mode: auto" in r.getMessage()]
    assert line.startswith("activation_checkpointing.mode: auto -> full (selective's planned "
                           f"peak {sel / GiB:.1f} GiB does not fit")
    assert f"full: {full / GiB:.1f} GiB" in line
    caplog.clear()
    cpu = resolve_auto_mode(loaded, "cpu")
    assert cpu.cfg.activation_checkpointing.mode == "full"
    assert any("auto -> full (a CPU device" in r.getMessage() for r in caplog.records)
    assert loaded.cfg.activation_checkpointing.mode == "auto"  # a copy: the config is kept


@pytest.mark.slow  # four plans of the 8B shape through the command line: ~8 s on 2 cores
def test_foundryx_plan_shows_the_mode_auto_takes(capsys, monkeypatch):
    """`foundryx plan` on the flagship recipe: its note says the mode, and the plan's header and
    memory are that mode's; a run at mode: selective that does not fit is offered full."""
    from foundryx.cli import main

    monkeypatch.chdir(ROOT)
    assert main(["plan", RECIPE, *EIGHT_B, "--gpus", "1", "--gpu", "h100"]) == 0
    out = capsys.readouterr().out
    assert "activation_checkpointing.mode: auto -> selective" in out
    assert "selective activation checkpointing" in out
    main(["plan", RECIPE, *EIGHT_B, "--gpus", "1", "--gpu", "h100", "--gpu-memory", "24GB"])
    out = capsys.readouterr().out
    assert "activation_checkpointing.mode: auto -> full (selective's planned peak" in out
    assert "selective activation checkpointing" not in out
    main(["plan", RECIPE, *EIGHT_B, "--gpus", "1", "--gpu", "h100", "--gpu-memory", "24GB",
          "activation_checkpointing.mode=selective", "--json"])
    plan = json.loads(capsys.readouterr().out)
    assert not plan["fits"]
    full = [s for s in plan["suggestions"] if s["overrides"] == "activation_checkpointing.mode=full"]
    assert len(full) == 1 and full[0]["per_device_bytes"] < 24 * 10**9


def test_a_misspelt_mode_is_named_with_the_fix():
    with pytest.raises(ConfigError) as e:
        load_config(ROOT / "yamls/quickstart.yaml", ["activation_checkpointing.mode=selctive"],
                    component_sections=[])
    assert e.value.problems == ["activation_checkpointing.mode: expected one of 'full', "
                                "'selective', 'auto', got 'selctive' (did you mean 'selective'?)"]


@pytest.mark.slow  # three plans of the 8B shape and their searches: ~5 s on 2 cores
def test_searches_under_auto_size_full_checkpointing(monkeypatch):
    """Under mode: auto the plan is selective's where that fits, but a larger microbatch or a
    longer sequence would take full checkpointing: the searches size full's."""
    from foundryx.plan.planner import make_plan

    monkeypatch.chdir(ROOT)
    plans = {m: make_plan(RECIPE, [*EIGHT_B, f"activation_checkpointing.mode={m}"], gpus=1,
                          gpu="h100") for m in ("auto", "full", "selective")}
    assert plans["auto"].setup.ac_selective and not plans["full"].setup.ac_selective
    assert plans["auto"].per_device_bytes == plans["selective"].per_device_bytes
    assert plans["auto"].largest_microbatch == plans["full"].largest_microbatch
    assert plans["full"].largest_microbatch > plans["selective"].largest_microbatch
    auto, full = plans["auto"].longest_sequence(), plans["full"].longest_sequence()
    assert auto.seq_len == full.seq_len > plans["selective"].longest_sequence().seq_len
