"""The CPU instruments that predict a GPU step (issue 46): benchmarks/flagship_estimate.py's
device memory by category on fake tensors, and benchmarks/op_census.py's FLOPs, bytes and
kernels, at a tiny Llama shape; their refusals (exit 2, naming what stopped them)."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import flagship_estimate, op_census
from benchmarks.instruments import fake_step
from benchmarks.instruments.step_memory import CATEGORIES, CategoryTracker

ROOT = Path(__file__).parents[1]

TINY = ROOT / "benchmarks" / "gpu_runbook" / "shapes" / "llama-tiny"


def test_the_tracker_counts_each_storage_once_and_its_categories_add_up_to_the_peak():
    t = CategoryTracker(vocab_size=7)
    w = torch.empty(256, 256)  # 256 KiB
    t.add(w, "frozen base")
    with t, t.in_phase("forward"):
        a = torch.empty(64, 256)  # 64 KiB, kept
        v = a.view(-1)  # a view: the same storage, not counted again
        logits = torch.empty(10, 7)  # the vocabulary's last dimension
        tmp = torch.empty(128, 256)  # 128 KiB, freed below
        del tmp
        with t.in_phase("backward"):
            g = torch.empty(32, 256)  # noqa: F841
    assert t.peak == (256 + 64 + 128) * 1024 + 10 * 7 * 4
    assert sum(t.at_peak.values()) == t.peak
    assert t.at_peak["activations kept"] == (64 + 128) * 1024 and t.at_peak["logits + loss"] == 280
    assert t.total == (256 + 64 + 32) * 1024 + 280 and v.numel() == a.numel() and logits.dim() == 2


def frozen_base_bytes(side: str) -> int | None:
    """The tiny Llama's frozen linear weights as ``side`` stores them, counted by hand from
    config.json: the peer's bf16 weights; foundryx's rows (bf16: 2 bytes, fp8: 1) and a
    float32 scale per row (bf16's are ones); half the layers for a half offload. None for
    NF4 (torchao's blocks)."""
    cfg = json.loads((TINY / "config.json").read_text())
    d, f, n = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    kv = d // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    shapes = [(d, d), (d, kv), (d, kv), (d, d), (d, f), (d, f), (f, d)]  # q k v o gate up down
    weights, rows = n * sum(i * o for i, o in shapes), n * sum(o for _, o in shapes)
    return {"peer": 2 * weights, "bf16": 2 * weights + 4 * rows, "fp8": weights + 4 * rows,
            "fp8-tc": weights + 4 * rows, "fp8-offload0.5": (weights + 4 * rows) // 2}.get(side)


@pytest.mark.parametrize("side", fake_step.SIDES)
def test_every_side_traces_at_a_tiny_shape_and_holds_its_frozen_base(side):
    row = flagship_estimate.estimate(side, TINY, batch=2, seq=64)
    cats = row["categories"]
    assert set(CATEGORIES) <= set(cats)
    want = frozen_base_bytes(side)
    if want is not None:
        assert cats["frozen base"] * 2**30 == want, (cats["frozen base"] * 2**30, want)
    assert cats["frozen base"] > 0 and cats["adapters + optimizer"] > 0
    assert cats["activations kept"] > 0


def test_foundryx_fuses_the_loss_where_the_peer_holds_vocabulary_sized_tensors(tmp_path):
    """At a large vocabulary (Llama 3's 128k is the 8B step's peak) the peer's loss holds the
    logits, their log-softmax and gradients: the peak; foundryx's fused loss holds one chunk
    of them at a time (issue 46's largest category)."""
    cfg = json.loads((TINY / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "vocab_size": 32768,
                                                     "max_position_embeddings": 4096}))
    peer = flagship_estimate.estimate("peer", tmp_path, batch=2, seq=4096)
    ours = flagship_estimate.estimate("bf16", tmp_path, batch=2, seq=4096)
    vocab_bytes = 2 * 4096 * 32768 * 4  # one float32 tokens x vocab tensor
    assert peer["categories"]["logits + loss"] * 2**30 >= 2.5 * vocab_bytes
    assert ours["categories"]["logits + loss"] * 2**30 <= 0.5 * vocab_bytes  # the chunk: fp32, bf16
    assert ours["peak_gib"] < peer["peak_gib"]


def test_the_estimate_and_census_commands_write_json_and_refuse_what_they_cannot_trace(
        tmp_path, capsys):
    out = tmp_path / "est.json"
    assert flagship_estimate.main(["--shape", str(TINY), "--seq", "32", "--sides", "peer,fp8",
                                   "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert set(rows) == {"peer", "fp8"} and rows["fp8"]["peak_gib"] > 0
    gpt = tmp_path / "gpt"
    gpt.mkdir()
    (gpt / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    capsys.readouterr()
    assert flagship_estimate.main(["--shape", str(gpt), "--sides", "bf16"]) == 2
    assert "model_type 'gpt2'" in capsys.readouterr().err
    assert op_census.main(["--shape", str(tmp_path / "none")]) == 2
    assert "no config.json" in capsys.readouterr().err


def test_a_step_that_stops_says_which_module_stopped_it(monkeypatch):
    from foundryx.models.peft import frozen_base

    def broken(*a, **k):
        raise RuntimeError("cannot trace this")

    monkeypatch.setattr(frozen_base, "dequantize", broken)
    with pytest.raises(fake_step.NotTraceable, match=r"fp8: the step .* frozen_base.py:\d+ .*"
                                                     r"cannot trace this"):
        flagship_estimate.estimate("fp8", TINY, batch=1, seq=32)


def test_the_census_counts_the_same_gemm_work_on_both_sides_and_names_the_extra_bytes():
    """Same model, same LoRA, same checkpointing: the GEMM FLOPs of both sides agree (the
    fused loss does the head's two matmuls chunk by chunk, nothing more); each side's FLOPs
    match the matmuls a checkpointed LoRA step must do."""
    peer = op_census.census("peer", TINY, batch=2, seq=64)
    ours = op_census.census("bf16", TINY, batch=2, seq=64)
    cfg = json.loads((TINY / "config.json").read_text())
    d, f, n, v = (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"],
                  cfg["vocab_size"])
    kv = d // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
    tokens, r = 2 * 64, fake_step.LORA["r"]
    shapes = [(d, d), (d, kv), (d, kv), (d, d), (d, f), (d, f), (f, d)]  # q k v o gate up down
    base = n * sum(i * o for i, o in shapes)
    lora = n * sum(r * (i + o) for i, o in shapes)
    # every frozen layer's forward, recompute and input gradient; the head's forward and input
    # gradient; each adapter's forward, recompute, input and weight gradients
    expected = 2 * tokens * (3 * base + 2 * v * d + 4 * lora)
    for side in (peer, ours):  # less: the first block's input needs no gradient (foundryx)
        assert 0.85 * expected <= side["gemm_flops"] <= 1.01 * expected, \
            side["gemm_flops"] / expected
    assert peer["gemm_flops"] == pytest.approx(expected, rel=0.01)
    assert ours["kernels"] > 0 and ours["paper_s"] > 0
    assert op_census.differences(ours, peer)  # where foundryx does more: listed


def test_the_tracker_peak_equals_torch_memtracker_where_memtracker_can_run():
    """torch's MemTracker refuses a model with frozen parameters (a LoRA model); on a step it
    can run (a small Llama, every parameter trainable, bf16 autocast, checkpointed blocks,
    AdamW) both trackers see the same storages: the same peak."""
    from torch.distributed._tools.mem_tracker import MemTracker
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = json.loads((TINY / "config.json").read_text())
    config = AutoConfig.for_model(**{k: v for k, v in cfg.items()
                                     if k not in ("architectures", "torch_dtype")})
    config._attn_implementation = "sdpa"
    with fake_step.fake_mode(), fake_step.gpu_kernels():
        with fake_step.unfaked(), torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        model.to_empty(device="cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=False)
        step = fake_step.FakeStep("full", model, opt, fake_step.random_batch(512, 2, 64),
                                  lambda b: (None, model(**b).loss), vocab=512)
        none = lambda name: contextlib.nullcontext()  # noqa: E731
        fake_step.run_step(step, none)  # the optimizer's state exists from here on
        ours = CategoryTracker(512, list(model.parameters()))
        ours.register_model(model, set())
        ours.add(step.batch["input_ids"], "other")
        for s in opt.state.values():
            for t in s.values():
                ours.add(t, "adapters + optimizer")
        with ours:
            fake_step.run_step(step, ours.in_phase)
        mt = MemTracker()
        mt.track_external(model, opt)
        with mt:
            fake_step.run_step(step, none)
        peak = sum(mt.get_tracker_snapshot("peak")[torch.device("cpu")].get(k, 0)
                   for k in ("Parameter", "Buffer", "Gradient", "Activation", "Temp",
                             "Optstate", "Other"))
    assert ours.peak == pytest.approx(peak, rel=0.01), (ours.peak, peak)


def test_the_fp8_tensor_core_side_runs_scaled_mm_where_this_torch_can_trace_it():
    """``fp8-tc``: the FP8 base's GEMMs as an H100 runs them (torch._scaled_mm, forward and
    input gradient). Traced where torch has a CPU _scaled_mm (2.15); refused, saying so, on
    torch 2.7, whose emulation would census float32 matmuls instead."""
    from foundryx.models.peft import fp8_gemm

    with fake_step.unfaked():
        fp8_gemm._scaled_mm_runs_on.cache_clear()
        runs = fp8_gemm._scaled_mm_runs_on("cpu")
    if not runs:
        with pytest.raises(fake_step.NotTraceable, match="no CPU _scaled_mm"):
            op_census.census("fp8-tc", TINY, batch=2, seq=64)
        return
    cfg = json.loads((TINY / "config.json").read_text())
    tc = op_census.census("fp8-tc", TINY, batch=2, seq=64)
    cast = op_census.census("fp8", TINY, batch=2, seq=64)
    scaled = sum(n for k, (n, _, _) in tc["places"].items() if k.endswith("| _scaled_mm"))
    frozen = 7 * cfg["num_hidden_layers"]
    # forward, recompute and input gradient of every frozen layer but the first block's
    # q, k and v, whose input (the frozen embedding's, normed) needs no gradient
    assert scaled == 3 * frozen - 3, scaled
    assert not any(k.endswith("| _scaled_mm") for k in cast["places"])
    # each _scaled_mm's rows quantized by the one kernel a GPU runs, no torch op's norm left
    quantized = sum(n for k, (n, _, _) in tc["places"].items()
                    if k.endswith("| fp8_quantize_rows"))
    assert quantized == scaled, quantized
    assert not any(k.endswith("| linalg_vector_norm") for k in tc["places"]), tc["places"]
    row = flagship_estimate.estimate("fp8-tc", TINY, batch=2, seq=64)
    assert row["categories"]["frozen base"] * 2**30 == frozen_base_bytes("fp8-tc")


@pytest.mark.slow
def test_the_commands_docs_planning_shows_run_as_written_at_a_tiny_size(tmp_path):
    """docs/planning.md's instrument commands, each run as a user runs it in its own process,
    only the model's size swapped (the tiny Llama shape; MPT-1B at 1 x 64 tokens)."""
    import re
    import shlex
    import subprocess

    text = (ROOT / "docs" / "planning.md").read_text()
    section = text.split("### A step's device memory and time, predicted on a CPU", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    commands = [shlex.split(line) for line in block.splitlines() if line.strip()]
    assert [c[1:3] for c in commands] == [["-m", "benchmarks.flagship_estimate"],
                                          ["-m", "benchmarks.op_census"], ["-m", "benchmarks.op_census"]]
    for argv in commands:
        argv = [sys.executable if a == "python" else a for a in argv]
        argv = [str(TINY) if a == "yamls/shapes/llama-3.1-8b" else a for a in argv]
        argv = [str(tmp_path / "est.json") if a == "est.json" else a for a in argv]
        if "--mpt" in argv:
            argv[argv.index("--batch") + 1], argv[argv.index("--seq") + 1] = "1", "64"
        else:
            argv += ["--seq", "64"]
        run = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-2000:]
        assert "| side |" in run.stdout
    assert set(json.loads((tmp_path / "est.json").read_text())) == set(fake_step.SIDES)
