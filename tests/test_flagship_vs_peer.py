"""benchmarks/flagship_vs_peer.py (issue 46): foundryx against plain transformers + peft
(benchmarks/peer_lora.py), alternating, with one profiled step of each side
(benchmarks/step_profile.py): the profile summaries on made-up events and allocator traces,
and the whole side-by-side on CPU at a tiny Llama."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from benchmarks.instruments import step_profile

ROOT = Path(__file__).parents[1]


def test_the_snapshot_replays_to_its_peak_and_names_who_allocated():
    """Alive at the peak: what was allocated and not yet freed then, by the first frame
    outside torch; a later, smaller high point does not count."""
    model = [{"filename": "/x/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"},
             {"filename": "/x/transformers/models/llama/modeling_llama.py", "line": 7,
              "name": "forward"}]
    loss = [{"filename": "/x/transformers/loss/loss_utils.py", "line": 3, "name": "ce"}]
    trace = [{"action": "free_requested", "addr": 99, "size": 70},  # allocated before the trace
             {"action": "free_completed", "addr": 99, "size": 70},
             {"action": "alloc", "addr": 1, "size": 100, "frames": model},
             {"action": "alloc", "addr": 2, "size": 300, "frames": loss},
             {"action": "alloc", "addr": 3, "size": 50, "frames": model},
             {"action": "free_requested", "addr": 2, "size": 300},
             {"action": "free_completed", "addr": 2, "size": 300},
             {"action": "alloc", "addr": 4, "size": 200, "frames": []}]
    peak, sites = step_profile.peak_sites(trace, start_bytes=1000)
    assert peak == 1000 - 70 + 450
    assert sites == [("loss/loss_utils.py:3 ce", 300, 1),
                     ("llama/modeling_llama.py:7 forward", 150, 2)]


def test_the_full_checkpointing_side_recomputes_every_layer_as_the_peer_does(monkeypatch, tmp_path):
    """foundryx-full: the recipe's run with activation_checkpointing.mode=full, compile off,
    nothing else changed; not in the default sides (a 2-core CPU run of every side is long)."""
    from benchmarks import flagship
    from benchmarks import flagship_vs_peer as vs

    seen = []
    monkeypatch.setattr(flagship, "run_one", lambda folder, base, offload, ns, timeout, logs:
                        seen.append((base, offload, ns)) or {"tokens_per_s": 1.0})
    a = SimpleNamespace(profile_step=5, profiles=None, device="cuda", seq=4096, microbatch=2,
                        steps=5)
    row = vs.run_foundryx(tmp_path, "foundryx-full", a, 1, 60.0, tmp_path)
    ((base, offload, ns),) = seen
    assert (base, offload, ns.compile, ns.extra) == ("bf16", 0.0, "false",
                                                     ["activation_checkpointing.mode=full"])
    assert row["side"] == "foundryx-full" and "foundryx-full" not in vs.DEFAULT_SIDES


def test_the_kernel_table_sums_device_kernels_by_name():
    from torch.autograd import DeviceType

    def ev(name, us, device=DeviceType.CUDA, annotation=False):
        return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                               time_range=SimpleNamespace(elapsed_us=lambda: us))

    events = [ev("sm90_gemm", 600), ev("sm90_gemm", 200), ev("elementwise|copy", 200),
              ev("aten::mm", 5000, DeviceType.CPU),  # an operator: not a kernel
              # a record_function range on the device timeline (the H200 run of 2026-11-29
              # counted Composer's Optimizer.step, the whole step, as 51% of the device time)
              ev("Optimizer.step#DecoupledAdamW.step", 790, annotation=True)]
    table = step_profile.kernel_table(events)
    assert table.splitlines()[0].startswith("3 device kernels (and copies) in the step, 1.0 ms")
    assert "| sm90_gemm | 2 | 0.80 | 80.0% |" in table
    assert "| elementwise/copy | 1 | 0.20 | 20.0% |" in table and "aten::mm" not in table


def test_state_counts_shards_and_subclasses_on_their_device():
    import torch

    model = torch.nn.Linear(4, 3)
    model.weight.requires_grad_(False)
    model.bias.grad = torch.zeros(3)
    opt = torch.optim.AdamW([model.bias])
    model.bias.grad = torch.ones(3)
    opt.step()
    got = step_profile.state_breakdown(model, opt, "cpu")
    assert got == {"parameters, frozen (float32)": 48, "parameters, trainable (float32)": 12,
                   "gradients": 12, "optimizer state": 24 + 4}  # exp_avg, exp_avg_sq, step
    assert step_profile.state_breakdown(model, opt, "cuda") == {
        "parameters, frozen (float32)": 0, "parameters, trainable (float32)": 0, "gradients": 0,
        "optimizer state": 0}


@pytest.mark.slow
@pytest.mark.modern_leg  # the GPU run book's side-by-side runs on transformers 5.x
def test_side_by_side_on_cpu(tmp_path):
    """The side-by-side end to end at a tiny Llama on CPU: the peer and foundryx with compile
    off and auto (FOUNDRYX_COMPILE=0 keeps auto off here: the override's path, not inductor)
    and without issue 51's fused path, two rounds alternating, each side profiled once, the
    ratios."""
    out, raw, prof = tmp_path / "vs.md", tmp_path / "vs.json", tmp_path / "prof"
    r = subprocess.run(
        [sys.executable, "-m", "benchmarks.flagship_vs_peer", "--device", "cpu", "--shape",
         "benchmarks/gpu_runbook/shapes/llama-tiny", "--seq", "64", "--steps", "3",
         "--cache", str(tmp_path / "model"), "--logs", str(tmp_path / "logs"),
         "--profiles", str(prof), "--json", str(raw), "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=900,
        env={**os.environ, "OMP_NUM_THREADS": "1", "FOUNDRYX_COMPILE": "0"})
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads(raw.read_text())
    order = [(row["round"], row["side"]) for row in data["rows"]]
    assert order == [(1, "peer"), (1, "foundryx"), (1, "foundryx-compile"),
                     (1, "foundryx-unfused"), (2, "foundryx-unfused"), (2, "foundryx-compile"),
                     (2, "foundryx"), (2, "peer")]
    for row in data["rows"]:
        assert "error" not in row, row
        assert row["tokens_per_s"] > 0 and len(row["losses"]) == 3
        assert all(x == x for x in row["losses"])
    # the same model and tokens' distribution: the first losses agree (random weights: ~ln V)
    firsts = [row["losses"][0] for row in data["rows"]]
    assert max(firsts) - min(firsts) < 0.05, firsts
    peer = next(row for row in data["rows"] if row["side"] == "peer")
    assert peer["trainable_params"] > 0 and peer["versions"]["transformers"]
    logs = {p.name for p in (tmp_path / "logs").iterdir()}
    assert {"peer-r1.log", "flagship-bf16-offload0-foundryx-compile-r2.log"} <= logs
    compiled = (tmp_path / "logs" / "flagship-bf16-offload0-foundryx-compile-r1.log").read_text()
    assert "compile.enabled=auto" in compiled and "compile: off (FOUNDRYX_COMPILE=0" in compiled
    # issue 51's before: PEFT's own LoRA layer and no fused ops (the adapter path said per run)
    fused = (tmp_path / "logs" / "flagship-bf16-offload0-foundryx-r1.log").read_text()
    unfused = (tmp_path / "logs" / "flagship-bf16-offload0-foundryx-unfused-r1.log").read_text()
    assert "model.peft_config.one_pass=false" in unfused and "fused_ops.rope=false" in unfused
    assert "adapter path in one pass" in fused and "adapter path in one pass" not in unfused
    s = data["summary"]
    assert s["foundryx"]["tps_vs_peer"] == pytest.approx(
        s["foundryx"]["tokens_per_s"] / s["peer"]["tokens_per_s"])
    for side in ("peer", "foundryx", "foundryx-compile", "foundryx-unfused"):
        for part in ("kernels", "memory"):
            f = prof / f"{side}-{part}.md"
            assert f.is_file() and f.stat().st_size < 8000, f
        assert "| parameters, trainable (float32) |" in (prof / f"{side}-memory.md").read_text()
        assert "top 15 operators by self CPU time" in (prof / f"{side}-kernels.md").read_text()
    text = out.read_text()
    assert "| 2 | peer |" in text and "| foundryx-compile |" in text
    assert "foundryx / peer (bf16 base, compile off): tokens/s" in text
    assert "`peer-kernels.md`" in text
