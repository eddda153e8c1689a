"""Composer's algorithms in the registry: the surgery ones refuse models they do not apply to
(with the reason, before the run writes anything), low_precision_layernorm says in one line
why it does nothing on CPU. EMA and sequence-length warmup run in the plugin's end-to-end run
(tests/test_plugin_e2e.py), with the other algorithms, from YAML."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from composer.core import Event, Precision

from foundryx import registry
from foundryx.algorithms import check_algorithms
from foundryx.errors import ConfigError
from tests.hf_tiny import HF_CONFIGS, random_mpt


def hf_model(model_type: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type,
                                                                 **HF_CONFIGS[model_type]))


def build(name: str, **kwargs):
    return registry.algorithms.get(name)(**kwargs)


@pytest.mark.parametrize("model_type, reason", [
    ("mpt", "MPT has ALiBi built in; set model.attn_config.alibi: true"),
    ("llama", "policies for GPT-2 and BERT modules only, and this model has none"),
    ("qwen2", "policies for GPT-2 and BERT modules only, and this model has none"),
    ("gpt2", "replaces GPT2Attention._attn, which transformers"),
])
def test_alibi_refuses_models_it_does_not_apply_to(model_type, reason):
    model = random_mpt() if model_type == "mpt" else hf_model(model_type)
    wrapped = SimpleNamespace(model=model)  # as a Composer model holds it
    with pytest.raises(ConfigError) as e:
        check_algorithms([build("alibi", max_sequence_length=64)], wrapped)
    assert "algorithms.alibi: " in str(e.value) and reason in str(e.value)


@pytest.mark.parametrize("model_type, reason", [
    ("mpt", "an MPT gets gated units from model.ffn_config.ffn_type: swiglu"),
    ("llama", "(its MLP is gated already)"),
    ("gpt2", "replaces BERT's BertIntermediate and BertOutput modules only"),
])
def test_gated_linear_units_refuses_causal_lms(model_type, reason):
    model = random_mpt() if model_type == "mpt" else hf_model(model_type)
    with pytest.raises(ConfigError) as e:
        check_algorithms([build("gated_linear_units")], model)
    assert "algorithms.gated_linear_units: " in str(e.value) and reason in str(e.value)


def test_surgery_refusal_is_one_message_and_writes_nothing(quickstart_data, tmp_path, capsys):
    from foundryx.cli import main

    out = tmp_path / "run"
    rc = main(["train", "yamls/quickstart.yaml", f"variables.data_root={quickstart_data}",
               "save_folder=null", f"loggers.jsonl.path={out}/metrics.jsonl",
               "algorithms.alibi.max_sequence_length=128"])
    assert rc == 2
    err = capsys.readouterr().err
    assert "algorithms.alibi: MPTForCausalLM (model_type foundryx_mpt): MPT has ALiBi built in" in err
    assert "Traceback" not in err and not out.exists()


def test_low_precision_layernorm_says_why_it_does_nothing_on_cpu(caplog):
    model = random_mpt(norm_type="layernorm")
    algo = build("low_precision_layernorm")
    for precision, why in [
            (Precision.FP32, "it acts only under autocast (precision: amp_bf16 or amp_fp16); "
                             "this run's precision is fp32"),
            (Precision.AMP_BF16, "it is for GPUs (CUDA/ROCm); this run's model is on cpu")]:
        state = SimpleNamespace(model=model, precision=precision, optimizers=[])
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="foundryx"):
            algo.apply(Event.INIT, state, logger=None)
        lines = [r.getMessage() for r in caplog.records if "low_precision_layernorm" in r.getMessage()]
        assert lines == [f"low_precision_layernorm: not applied: {why}"]
    assert any(type(m) is torch.nn.LayerNorm or isinstance(m, torch.nn.LayerNorm)
               for m in model.modules())
    assert not any(type(m).__name__ == "LPLayerNorm" for m in model.modules())  # untouched
