"""The planner's speed is the measured speed (issue 46): foundryx/plan/speed.py's rule (rows in,
the row chosen and its MFU out), and `foundryx plan` of each measured run within 15% of what the
GPU run book measured (the 8B flagship on an H100 at ~5,800 tokens/s, not the 7,686 an assumed
40% MFU gave)."""

from __future__ import annotations

from pathlib import Path

import pytest

from foundryx.cli import main
from foundryx.plan.gpus import DEFAULT_MFU
from foundryx.plan.planner import make_plan
from foundryx.plan.speed import ROWS, Run, SpeedRow, choose

ROOT = Path(__file__).parents[1]
H100 = "NVIDIA H100 80GB HBM3"
A100 = "NVIDIA A100-SXM4-80GB"


def _row(base="bf16", offload=False, compile=False, ckpt=True, mfu=0.3, device="h100-sxm",
         model="hf", training="lora"):
    return SpeedRow(device, "amp_bf16", model, training, base, offload, compile, ckpt, mfu,
                    f"row {base} {offload} {compile} {ckpt}")


def _run(frozen="bf16", offload=False, compile=False, ckpt=True, device=H100, training="lora",
         model="hf", precision="amp_bf16", selective=False):
    return Run(device, precision, model, training, frozen, offload, compile, ckpt, selective)


def test_the_row_of_the_run_is_chosen():
    rows = [_row("bf16", mfu=0.30), _row("fp8-cast", mfu=0.28), _row("nf4", mfu=0.24),
            _row("fp8-cast", offload=True, mfu=0.27)]
    c = choose(_run("fp8"), rows)
    assert (c.mfu, c.row, c.source, c.differs) == (0.28, rows[1], "table", ())
    assert choose(_run("fp8", offload=True), rows).row is rows[3]
    assert choose(_run("nf4"), rows).mfu == 0.24
    line = choose(_run("bf16"), rows).line
    assert line == ("measured: h100-sxm, amp_bf16, hf LoRA over a bf16 base, no offload, "
                    "compile off, checkpointing on: row bf16 False False True")


def test_the_nearest_row_when_none_matches_every_setting_and_it_says_where():
    """Offload weighs most, then checkpointing, then compile; the plan names what differs."""
    rows = [_row("bf16", compile=True, mfu=0.35), _row("bf16", offload=True, mfu=0.29),
            _row("bf16", ckpt=False, mfu=0.40)]
    c = choose(_run("bf16"), rows)  # no offload, compile off, checkpointing on
    assert c.row is rows[0] and c.differs == ("compile off",)
    assert c.line.endswith("; this run differs in compile off (no row measured with it)")
    c = choose(_run("bf16", offload=True, compile=True, ckpt=False), rows)
    assert c.row is rows[1] and c.differs == ("checkpointing off", "compile on")


def test_selective_checkpointing_takes_its_own_row_or_says_it_differs():
    """A selective run takes the selective row (more memory, less recompute: a higher MFU), a
    full one the full row; with only the other measured, the plan names the difference."""
    full, sel = _row("bf16", mfu=0.50), SpeedRow("h100-sxm", "amp_bf16", "hf", "lora", "bf16",
                                                  False, False, True, 0.60, "sel", selective=True)
    assert choose(_run("bf16", selective=True), [full, sel]).row is sel
    assert choose(_run("bf16"), [sel, full]).row is full
    c = choose(_run("bf16", selective=True), [full])
    assert c.row is full and c.differs == ("checkpointing selective",)
    c = choose(_run("bf16"), [sel])
    assert c.differs == ("checkpointing on",) and "checkpointing selective: sel" in c.line


def test_no_row_falls_back_to_the_default_in_one_line():
    rows = [_row("bf16")]
    for run in (_run("bf16", device="NVIDIA H200"), _run("bf16", precision="amp_fp16"),
                _run("bf16", model="mpt"), _run("bf16", training="full"), _run(None)):
        c = choose(run, rows)
        assert (c.mfu, c.row, c.source) == (DEFAULT_MFU, None, "default"), run
        assert c.line.startswith("assumed: no measured row for ") and "\n" not in c.line
    assert choose(_run("bf16", device="NVIDIA H200"), rows).line == (
        "assumed: no measured row for h200, amp_bf16, hf LoRA over a bf16 base "
        "(foundryx/plan/speed.py)")


def test_an_fp8_base_without_fp8_tensor_cores_uses_the_cast_path():
    rows = [_row("fp8-cast", device="a100", mfu=0.25), _row("fp8-cast", mfu=0.28)]
    c = choose(_run("fp8", device=A100), rows)
    assert c.row is rows[0] and c.notes == (
        "a100 has no FP8 tensor cores: the FP8 base is cast to bf16 per layer (the cast path's "
        "speed)",)
    # an H100 runs FP8 GEMMs, unmeasured: the cast path's row, said to be a lower bound
    assert choose(_run("fp8"), rows).row is rows[1] and choose(_run("fp8"), rows).notes == (
        "h100-sxm runs the FP8 base's GEMMs on FP8 tensor cores, which no GPU has measured "
        "yet: the speed is the cast path's (measured), a lower bound",)
    # once a GPU has measured them (an H100 row of the tensor-core path), an H100 takes that
    # row, said nothing; an A100 keeps the cast path
    rows.append(_row("fp8-tensor-core", mfu=0.45))
    assert choose(_run("fp8"), rows).row is rows[2] and not choose(_run("fp8"), rows).notes
    assert choose(_run("fp8", device=A100), rows).row is rows[0]


def test_the_table_has_one_row_per_measured_configuration():
    keys = [(r.device, r.precision, r.model, r.training, r.base, r.offload, r.compile,
             r.checkpointing, r.selective) for r in ROWS]
    assert len(set(keys)) == len(keys)
    assert all(0 < r.mfu < 1 for r in ROWS)


# the H100 runs of 2026-11-27 checkpointed every block (the recipe's mode: auto came later)
FLAGSHIP = ["yamls/finetune/llama-8b-lora-fp8.yaml", "variables.model_path=yamls/shapes/llama-3.1-8b",
            "device_train_microbatch_size=2", "global_train_batch_size=2", "compile=false",
            "activation_checkpointing.mode=full"]


def _doc_row(label: str) -> str:
    """docs/planning.md's row of the measured table for ``label``."""
    text = (ROOT / "docs" / "planning.md").read_text()
    (row,) = [line for line in text.splitlines() if line.startswith(f"| {label} |")]
    return row


@pytest.mark.parametrize(("base", "offload", "measured", "label"), [
    ("bf16", 0, 5_800, "8B LoRA, bf16 base, compile off, checkpointing"),  # 5,734-5,853
    ("fp8", 0, 5_334, "8B LoRA, FP8 base (cast path)"), ("nf4", 0, 4_568, "8B LoRA, NF4 base"),
    ("fp8", 0.5, 5_191, "8B LoRA, FP8 base, offload 0.5")])
def test_the_8b_plan_on_an_h100_is_within_15_percent_of_the_run_book(base, offload, measured,
                                                                        label, monkeypatch):
    """benchmarks/flagship.py's runs, planned as it plans them: one H100, its overrides; the
    figure docs/planning.md quotes is the plan's."""
    monkeypatch.chdir(ROOT)
    config, *overrides = FLAGSHIP
    plan = make_plan(config, [*overrides, f"model.frozen_base.dtype={base}",
                              f"model.frozen_base.offload_fraction={offload}"], gpus=1, gpu="h100")
    assert plan.speed.source == "table" and plan.speed.differs == ()
    assert plan.tokens_per_s == pytest.approx(measured, rel=0.15)
    assert plan.to_json()["throughput"]["mfu_source"]["row"]["base"] == (
        "fp8-cast" if base == "fp8" else base)
    assert _doc_row(label).endswith(f" | {plan.tokens_per_s:,.0f} |")


@pytest.mark.parametrize(("mode", "measured", "label"), [
    ("full", 10_126, "8B LoRA on an H200, bf16 base, every block checkpointed"),
    ("auto", 11_857, "8B LoRA on an H200, the recipe's checkpointing (auto: selective)")])
def test_the_8b_plan_on_an_h200_is_within_15_percent_of_the_run_book(mode, measured, label,
                                                                      monkeypatch):
    """The run book's step 7 on one H200 (2026-11-29), planned as benchmarks/flagship.py runs
    it: `mode: auto` takes selective there (its planned peak fits 140 GiB), and its row."""
    monkeypatch.chdir(ROOT)
    config, *overrides = FLAGSHIP
    plan = make_plan(config, [*overrides, "model.frozen_base.dtype=bf16",
                              "model.frozen_base.offload_fraction=0",
                              f"activation_checkpointing.mode={mode}"], gpus=1, gpu="h200")
    assert plan.speed.source == "table" and plan.speed.differs == ()
    assert plan.speed.row.selective == (mode == "auto") and plan.speed.row.device == "h200"
    assert plan.tokens_per_s == pytest.approx(measured, rel=0.15)
    assert _doc_row(label).endswith(f" | {plan.tokens_per_s:,.0f} |")


@pytest.mark.parametrize("gpus", [1, 2])
def test_the_8b_plans_flops_and_tokens_per_second_by_hand(gpus, monkeypatch):
    """The speed's terms, counted here from Llama-3.1-8B's shape: FLOPs per token ``6 N + 12 L
    d s`` with N every parameter but the embedding table (a lookup), as the models count it
    (each block's q, k, v, o, gate, up and down and two norms, the final norm, the head);
    tokens/s = the measured row's MFU (30.3%) x the H100's dense bf16 peak (989 TFLOP/s) x
    GPUs / FLOPs."""
    d, layers, ffn, vocab, kv, seq = 4096, 32, 14336, 128256, 8 * 128, 4096
    n = layers * (2 * d * d + 2 * d * kv + 3 * d * ffn + 2 * d) + d + vocab * d
    assert n + vocab * d == 8_030_261_248  # Llama-3.1-8B's published count
    flops = 6 * n + 12 * layers * d * seq  # 51.47 GFLOP, as speed.py's rows are derived
    monkeypatch.chdir(ROOT)
    config, *overrides = FLAGSHIP
    plan = make_plan(config, [*overrides, f"global_train_batch_size={2 * gpus}",
                              "model.frozen_base.dtype=bf16",
                              "model.frozen_base.offload_fraction=0"], gpus=gpus, gpu="h100")
    assert plan.flops_per_token == flops == 51_471_998_976
    assert (plan.mfu, plan.peak_flops) == (0.303, 989e12)
    assert plan.tokens_per_s == pytest.approx(0.303 * 989e12 * gpus / flops, rel=1e-12)


@pytest.mark.parametrize(("compile", "measured", "label"), [
    ("false", 35_141, "MPT-1B pretraining, seq 2048, batch 8, eager"),
    ("true", 38_560, "MPT-1B, the same, compiled")])
def test_the_mpt_1b_plan_on_an_h100_is_within_15_percent_of_the_run_book(compile, measured, label,
                                                                        monkeypatch):
    monkeypatch.chdir(ROOT)
    plan = make_plan("yamls/mpt-1b.yaml", ["device=gpu", "precision=amp_bf16",
                                          f"compile.enabled={compile}"], gpus=1, gpu="h100")
    assert plan.speed.row.model == "mpt" and plan.speed.row.compile == (compile == "true")
    assert plan.tokens_per_s == pytest.approx(measured, rel=0.15)
    assert _doc_row(label).endswith(f" | {plan.tokens_per_s:,.0f} |")


def test_the_plan_says_which_row_and_mfu_overrides_it(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    config, *overrides = FLAGSHIP
    argv = ["plan", config, *overrides, "model.frozen_base.dtype=bf16",
            "model.frozen_base.offload_fraction=0", "--gpus", "1", "--gpu", "h100"]
    main(argv)
    out = capsys.readouterr().out
    assert ("at 30% MFU of 989 TFLOP/s x 1: 5,822 tokens/s" in out
            and "\n  MFU 30.3%, measured: h100-sxm, amp_bf16, hf LoRA over a bf16 base, no "
                "offload, compile off, checkpointing on: 8B LoRA at 5,813 tokens/s" in out), out
    main([*argv, "--mfu", "0.5"])
    out = capsys.readouterr().out
    assert "at 50% MFU of 989 TFLOP/s x 1: 9,607 tokens/s" in out and "MFU 50.0%, --mfu" in out
    main([*argv[:-2], "--gpu", "b200"])
    out = capsys.readouterr().out
    assert ("at 40% MFU" in out and "MFU 40.0%, assumed: no measured row for b200, amp_bf16, hf "
            "LoRA over a bf16 base (foundryx/plan/speed.py)" in out), out
