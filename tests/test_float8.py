"""``float8``: torchao's float8 training from outside the model, and the refusals where the
device has no FP8 tensor cores (checked before the model is built, exit 2)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from foundryx.config.hardware import combination_problems, machine_problems
from foundryx.config.load import precheck
from foundryx.config.schema import Float8Config, ParallelismConfig, TrainConfig
from foundryx.errors import ConfigError
from foundryx.models.mpt.configuration import MPTConfig
from foundryx.models.mpt.modeling import MPTForCausalLM, causal_lm_loss
from foundryx.parallel.float8 import apply_float8, float8_targets
from foundryx.runtime.devices import Machine

ROOT = Path(__file__).parents[1]
ON = {"float8": True, "device": "gpu", "precision": "amp_bf16"}


def run_problems(data, machine):
    """What ``machine`` cannot run of these settings (the rules: foundryx.config.hardware)."""
    return machine_problems(machine, data.get("device"), data.get("precision", "fp32"),
                            data.get("float8", False))


def config(precision="amp_bf16", model=None, parallelism=None, enabled=True):
    return TrainConfig(model=model or {"name": "mpt_causal_lm"}, tokenizer={}, train_loader={},
                       max_duration="1ba", global_train_batch_size=1, optimizer={},
                       precision=precision, parallelism=parallelism,
                       float8=Float8Config(enabled=enabled))
A100 = Machine(1, name="NVIDIA A100-SXM4-80GB", capability=(8, 0))
H100 = Machine(1, name="NVIDIA H100 80GB HBM3", capability=(9, 0))


@pytest.mark.parametrize("machine, problem", [
    (H100, None),
    (Machine(1, name="NVIDIA L40S", capability=(8, 9)), None),
    (Machine(1, name="AMD Instinct MI300X", arch="gfx942:sramecc+:xnack-", hip="6.4.1"), None),
    (A100, "this machine's GPU, NVIDIA A100-SXM4-80GB (compute capability 8.0), has no FP8 "
           "tensor cores"),
    (Machine(1, name="AMD Instinct MI250X", arch="gfx90a:sramecc+:xnack-", hip="6.4.1"),
     "this machine's GPU, AMD Instinct MI250X (gfx90a, ROCm 6.4.1), has no FP8 tensor cores"),
    (Machine(None), None),  # no torch yet: the run checks again with torch
], ids=["h100", "l40s", "mi300x", "a100", "mi250x", "unknown"])
def test_the_gpu_must_have_fp8_tensor_cores(machine, problem):
    got = run_problems(ON, machine)
    if problem is None:
        assert got == []
    else:
        assert len(got) == 1 and problem in got[0] and "Fix: set float8.enabled=false" in got[0]


def test_off_is_no_problem_anywhere():
    assert run_problems({**ON, "float8": False}, A100) == []
    assert run_problems({"device": "gpu", "precision": "amp_bf16"}, A100) == []
    assert combination_problems(config(enabled=False, precision="amp_fp8")) == []
    assert combination_problems(config()) == []


def test_cpu_and_conflicting_settings_are_refused():
    cpu = Machine(0, "no NVIDIA or AMD GPU device")
    got = run_problems({**ON, "device": None}, cpu)
    assert got and got[0].startswith("float8.enabled: true cannot run on the CPU")
    assert "this machine has no GPU (no NVIDIA or AMD GPU device)" in got[0]
    assert "the config sets device: cpu" in run_problems({**ON, "device": "cpu"}, H100)[0]
    # rules of the config alone, whatever the machine: every one at once
    (got,) = combination_problems(config(precision="amp_fp8"))
    assert "two float8 trainings" in got
    lora = config(model={"name": "mpt_causal_lm", "peft_config": {"r": 8}})
    assert "float8 training is for pretraining" in combination_problems(lora)[0]
    both = combination_problems(config(model={"name": "hf_causal_lm", "frozen_base": {"dtype": "nf4"}},
                                       parallelism=ParallelismConfig(tp=2)))
    assert len(both) == 2 and "parallelism.tp: 2" in both[1]


def test_a_combination_is_a_config_problem_before_torch():
    """The combination rules are config validation: ``precheck`` (no torch, no machine)
    reports them under their YAML path with the config's other problems."""
    with pytest.raises(ConfigError) as err:
        precheck(ROOT / "yamls/quickstart.yaml", ["float8.enabled=true", "precision=amp_fp8",
                                                  "parallelism.tp=2"])
    text = str(err.value)
    assert "float8.enabled: true with precision: 'amp_fp8'" in text
    assert "float8.enabled: true with parallelism.tp: 2" in text


def test_a_gpu_without_fp8_stops_the_run_before_the_model_is_built(monkeypatch, quickstart_data):
    from foundryx import builders
    from foundryx import train as training

    monkeypatch.setattr(training, "machine_from_torch", lambda: A100)  # the device's capability
    monkeypatch.setattr(builders, "build_model", lambda *a, **k: pytest.fail("model was built"))
    loaded = training.load_run_config(
        "yamls/quickstart.yaml", [f"variables.data_root={quickstart_data}", "float8.enabled=true",
                                  "device=gpu", "precision=amp_bf16"])
    with pytest.raises(ConfigError) as err:
        training.train(loaded)
    assert "NVIDIA A100-SXM4-80GB (compute capability 8.0), has no FP8 tensor cores" in str(err.value)
    assert err.value.exit_code == 2


def test_float8_on_the_cpu_is_a_config_error_exit_2(quickstart_data):
    r = subprocess.run(
        [sys.executable, "-m", "foundryx.cli", "train", "yamls/quickstart.yaml",
         f"variables.data_root={quickstart_data}", "float8.enabled=true", "device=cpu",
         "max_duration=1ba"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith("foundryx: error:") and "Traceback" not in r.stderr
    assert "float8.enabled: true cannot run on the CPU" in r.stderr
    assert "the config sets device: cpu" in r.stderr


def tiny(**kw):
    cfg = {"d_model": 64, "n_heads": 4, "n_layers": 2, "max_seq_len": 32, "vocab_size": 96,
           "expansion_ratio": 4, "no_bias": True, **kw}
    return MPTForCausalLM(MPTConfig(**cfg))


def test_targets_leave_out_the_head_and_unaligned_layers():
    model = tiny(tie_word_embeddings=False)
    chosen, left = float8_targets(model, ["lm_head"])
    assert len(chosen) == 2 * 4  # Wqkv, out_proj, up, down per block
    assert left == ["lm_head (float8.skip)"]
    odd = tiny(d_model=72, n_heads=4)  # 72 is not a multiple of 16
    chosen, left = float8_targets(odd, [])
    assert chosen == [] and all("not multiples of 16" in w for w in left)
    with pytest.raises(ConfigError, match="no nn.Linear layer float8 can convert"):
        apply_float8(odd, Float8Config(enabled=True))


@pytest.mark.parametrize("recipe", ["rowwise", "tensorwise"])
def test_float8_trains_close_to_the_unconverted_model(recipe):
    """torchao's emulation (the float8 casts and scales, the matmuls in higher precision) on
    the CPU: the converted layers are Float8Linear and the loss and gradients stay close."""
    pytest.importorskip("torchao.float8")
    from torchao.float8.float8_linear import Float8Linear

    torch.manual_seed(0)
    ref = tiny()
    f8 = tiny()
    f8.load_state_dict(ref.state_dict())
    assert apply_float8(f8, Float8Config(enabled=True, recipe=recipe), emulate=True) == 8
    assert sum(isinstance(m, Float8Linear) for m in f8.modules()) == 8
    x = torch.randint(0, 96, (4, 32))
    losses = []
    for model in (ref, f8):
        loss = causal_lm_loss(model(x).logits, x)
        loss.backward()
        losses.append(loss.item())
    assert abs(losses[0] - losses[1]) < 0.02 * losses[0]
    for (name, a), b in zip(ref.named_parameters(), f8.parameters()):
        cos = torch.nn.functional.cosine_similarity(a.grad.flatten(), b.grad.flatten(), dim=0)
        assert cos > 0.95, (name, cos)  # e4m3: 3 mantissa bits, ~6% per element


def test_parallelize_converts_before_checkpointing_and_compile(monkeypatch):
    import importlib

    par = importlib.import_module("foundryx.parallel.parallelize")

    order = []
    monkeypatch.setattr(par, "apply_float8", lambda m, o: order.append(("float8", o.recipe)) or 8)
    real = par.apply_block_policies
    monkeypatch.setattr(par, "apply_block_policies",
                        lambda *a, **k: order.append(("blocks",)) or real(*a, **k))
    par.parallelize(tiny(), None, float8=Float8Config(enabled=True, recipe="tensorwise"),
                    device=torch.device("cpu"))
    assert order == [("float8", "tensorwise"), ("blocks",)]
    order.clear()
    par.parallelize(tiny(), None, float8=Float8Config(), device=torch.device("cpu"))
    assert order == [("blocks",)]
