"""`foundryx eval` with PEFT LoRA adapters: models {label, hf: BASE, adapter: DIR} that share a
base load it once and swap their adapters in, and score exactly what each adapter scores alone."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from hf_tiny import hf_folder
from icl_fakes import write_jsonl

from foundryx.cli import main
from foundryx.eval import models as eval_models

WORDS = ["red", "green", "blue", "cat", "dog", "bird", "sun", "moon"]


def save_adapter(base_dir, out, seed: int, targets: list[str]) -> None:
    """A PEFT LoRA adapter of the tiny Llama with random (non-zero) weights."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from foundryx.models.peft.lora import plain_linear_dispatch

    torch.manual_seed(seed)
    config = plain_linear_dispatch(LoraConfig(r=4, lora_alpha=16, target_modules=targets))
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(base_dir), config)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 20.0)
    model.save_pretrained(out)


@pytest.fixture
def setup(tmp_path, tiny_tokenizer):
    base = hf_folder("llama", tmp_path / "base", tokenizer=tiny_tokenizer)
    save_adapter(base, tmp_path / "a1", 1, ["q_proj", "v_proj"])
    save_adapter(base, tmp_path / "a2", 2, ["o_proj", "up_proj", "down_proj"])
    rows = [{"query": f"the {WORDS[i % 8]} and the", "choices": WORDS[:4],
             "gold": ([0] * 6 + [1, 1, 1, 2, 2, 3])[i]} for i in range(12)]
    write_jsonl(tmp_path / "mc.jsonl", rows)

    def config(name: str, models: list[dict]) -> str:
        cfg = {"models": models, "output_dir": str(tmp_path / f"out-{name}"), "device": "cpu",
               "icl_tasks": [{"label": "mc", "dataset_uri": "mc.jsonl",
                              "icl_task_type": "multiple_choice"}],
               "icl_data_root": str(tmp_path), "progress_bar": False, "max_seq_len": 32}
        path = tmp_path / f"{name}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        return str(path)

    def model(label: str, adapter: str | None = None) -> dict:
        return {"label": label, "hf": str(base), **({"adapter": str(tmp_path / adapter)}
                                                   if adapter else {})}

    return config, model, tmp_path


@pytest.mark.slow
def test_adapters_of_one_base_load_it_once_and_score_as_alone(setup, monkeypatch):
    from transformers import AutoModelForCausalLM

    config, model, tmp = setup
    loads = []
    real = AutoModelForCausalLM.from_pretrained
    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained",
                        lambda *a, **k: loads.append(a[0]) or real(*a, **k))

    def scores(name: str, models: list[dict]) -> dict:
        loads.clear()
        assert main(["eval", config(name, models)]) == 0
        data = json.loads((tmp / f"out-{name}" / "results.json").read_text())
        return {m: s["mc/0-shot"] for m, s in data["scores"].items()}, len(loads), data

    alone = {}
    for label, adapter in (("a1", "a1"), ("a2", "a2"), ("base", None)):
        alone.update(scores(label, [model(label, adapter)])[0])
    together, n_loads, data = scores("together", [model("a1", "a1"), model("base"),
                                                  model("a2", "a2")])
    assert n_loads == 1  # one base load for the base and both adapters
    assert together == alone, (together, alone)
    assert list(data["scores"]) == ["a1", "base", "a2"]  # the config's order


def test_swapped_adapters_give_the_logits_of_each_adapter_alone(setup):
    """The tiny model's MC scores barely move, so the swap is checked on logits: one
    EvalModels session (base, a1, a2) against a fresh base + adapter for each."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from foundryx.eval.config import EvalModelSpec
    from foundryx.models.peft.lora import plain_linear_dispatch

    _, model, tmp = setup
    ids = torch.randint(0, 400, (2, 12), generator=torch.Generator().manual_seed(0))
    specs = [EvalModelSpec(**model(label, adapter))
             for label, adapter in (("base", None), ("a1", "a1"), ("a2", "a2"))]
    session, got = eval_models.EvalModels(specs), {}
    for spec in specs:
        label = spec.label
        composer_model, _ = session.load(spec)
        with torch.no_grad():
            got[label] = composer_model.model(input_ids=ids).logits
    assert session.base_loads == 1
    for label in ("a1", "a2"):
        config = plain_linear_dispatch(eval_models._adapter_config(str(tmp / label)))
        alone = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp / "base"),
                                          tmp / label, config=config).eval()
        with torch.no_grad():
            expected = alone(input_ids=ids).logits
        assert torch.equal(got[label], expected), label
        assert not torch.allclose(got[label], got["base"]), label  # the adapter is on
    assert not torch.allclose(got["a1"], got["a2"])


def test_bad_adapter_entries_are_one_message(setup, capsys):
    config, model, tmp = setup
    (tmp / "empty").mkdir()
    bad = [{"label": "x", "checkpoint": str(tmp), "adapter": str(tmp / "a1")},
           model("y", "empty")]
    assert main(["eval", config("bad", bad)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("foundryx: error:") == 1, err
    assert "models[0].adapter: an adapter goes on a Hugging Face base; give the base model as hf" in err
    assert f"models[1].adapter: {tmp / 'empty'} has no adapter_config.json" in err
