"""The fine-tuning recipes in yamls/finetune/ stay valid (--dry-run on each, with a tiny local
model folder in place of the real one), and the small LoRA ones train a few batches on the
quickstart data with ICL evaluation during training, the base weights untouched. Every recipe
in yamls/ also trains 2 batches on 2 ranks in its own configuration: tests/test_recipes_2rank.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import yaml

from foundryx.cli import main

ROOT = Path(__file__).resolve().parents[1]
RECIPES = {"llama-lora": "llama", "mpt-lora": "mpt", "llama-8b-lora-fp8": "llama",
           "llama-3.1-70b-lora": "llama", "llama-3.1-405b-lora-fp8": "llama-wide",
           "llama-3.1-405b-lora-mi300x": "llama-wide", "llama-3.1-8b-lora-long": "llama"}


def tiny_folder(kind: str, out: Path, tokenizer_dir: Path) -> Path:
    """A tiny random Llama or foundryx MPT saved with the quickstart tokenizer (vocab 1024).
    ``llama-wide``: hidden 128, wide enough for a recipe's LoRA r=64 (k_proj has 64 outputs)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from foundryx.models.mpt.configuration import MPTConfig
    from foundryx.models.mpt.modeling import MPTForCausalLM

    torch.manual_seed(0)
    if kind.startswith("llama"):
        wide = kind == "llama-wide"
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(
            "llama", hidden_size=128 if wide else 32, intermediate_size=256 if wide else 64,
            num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
            vocab_size=1024))
    else:
        model = MPTForCausalLM(MPTConfig(
            d_model=32, n_heads=4, n_layers=2, max_seq_len=128, vocab_size=1024, no_bias=True,
            attn_config={"rope": True, "kv_n_heads": 2}, norm_type="rmsnorm",
            ffn_config={"ffn_type": "swiglu"}))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def folders(quickstart_data, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("recipe_models")
    return {k: tiny_folder(k, tmp / k, quickstart_data / "tokenizer") for k in ("llama", "llama-wide", "mpt")}


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_recipe_passes_dry_run(recipe, folders, quickstart_data, capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    args = ["train", "--dry-run", f"yamls/finetune/{recipe}.yaml",
            f"variables.model_path={folders[RECIPES[recipe]]}",
            f"variables.data_root={quickstart_data}", "variables.max_seq_len=128"]
    text = (ROOT / "yamls" / "finetune" / f"{recipe}.yaml").read_text()
    code = main(args)
    out, err = capsys.readouterr()
    assert code == 0, err
    assert "peft_config" in out and "target_modules" in out
    if "\ndevice: gpu" in text and not torch.cuda.is_available():
        # a GPU recipe checked on a machine without one (a cluster's login node): the dry run
        # checks it for the machine it will run on and notes what this one could not run
        assert "note: this machine could not run it as it is (device: 'gpu' cannot run here" in out


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["llama-lora", "mpt-lora"])
def test_small_recipe_trains_with_icl_eval(recipe, folders, quickstart_data, tmp_path, monkeypatch):
    from foundryx.config import load_config
    from foundryx.eval.quickstart_tasks import write_quickstart_tasks
    from foundryx.loggers.jsonl import read_metrics
    from foundryx.train import train

    monkeypatch.chdir(ROOT)
    write_quickstart_tasks(tmp_path / "eval", seed=0)
    tasks = tmp_path / "tasks.yaml"
    tasks.write_text(yaml.safe_dump({"data_root": str(tmp_path / "eval"), "icl_tasks": [
        {"label": "facts_mc", "dataset_uri": "facts_mc.jsonl",
         "icl_task_type": "multiple_choice"}]}))
    folder = folders[RECIPES[recipe]]
    overrides = [f"variables.model_path={folder}", f"variables.data_root={quickstart_data}",
                 f"variables.run_name={recipe}", "max_duration=8ba", "eval_interval=8ba",
                 "eval_subset_num_batches=1", "console_log_interval=4ba", "save_folder=null",
                 "compile=false", "icl_max_examples=16", f"icl_tasks={tasks}",
                 f"loggers.jsonl.path={tmp_path}/m.jsonl", "progress_bar=false",
                 "optimizer.lr=1.0e-2", "scheduler.t_warmup=0ba"]
    if recipe == "llama-lora":  # the optimizer's multi-tensor path, as a GPU runs it
        overrides.append("optimizer.implementation=foreach")
    trainer = train(load_config(f"yamls/finetune/{recipe}.yaml", overrides, world_size=1))
    model = trainer.state.model
    base = {n: p for n, p in model.named_parameters() if not p.requires_grad}
    from transformers import AutoModelForCausalLM

    original = AutoModelForCausalLM.from_pretrained(folder).state_dict()
    for n, p in base.items():  # bit-identical frozen base: model.<name with base_layer>
        key = n.removeprefix("model.").replace(".base_layer.", ".")
        assert torch.equal(p.detach(), original[key]), n
    rows = read_metrics(tmp_path / "m.jsonl")
    losses = [r["loss/train/total"] for r in rows if "loss/train/total" in r]
    assert losses[-1] < losses[0], losses
    key = "metrics/facts_mc/0-shot/ICLMultipleChoiceAccuracy"  # the ICL task's accuracy, logged
    assert [0 <= r[key] <= 1 for r in rows if key in r] == [True], rows[-1]  # at batch 8
