"""Every recipe in yamls/ runs, in its own configuration, on 2 CPU ranks: ``composer -n 2
train.py RECIPE`` (started as that launcher starts it: tests/launcher.py) with only the model
(a tiny model of the same family, saved in bf16 safetensors as the real one is), the data paths, the sizes, the device and the precision
overridden, for 2 batches. Its init mode, LoRA, frozen base, offload, sharding, activation
checkpointing, compile setting, dataloader workers, callbacks and loggers are the recipe's.

Each run works in a fresh folder (the recipe's relative ``runs/...`` paths land there) and must
exit 0 having trained 2 batches, with a committed checkpoint where the recipe saves one.
``test_every_recipe_is_covered`` fails when a recipe is added to yamls/ without a way to run it
here (or a test elsewhere that runs it on 2 ranks).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import launcher
import pytest
import torch
import yaml

ROOT = Path(__file__).resolve().parents[1]
SHAPES = ROOT / "yamls" / "shapes"

# Tiny sizes: the model is the only thing scaled down (with the batch and sequence sizes). A
# hidden size of 128 leaves k_proj 64 outputs: wide enough for the 405B recipe's LoRA r=64.
TINY_LLAMA = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
              "vocab_size": 1024}  # the quickstart tokenizer's 1024 tokens
TINY_MPT = ["model.d_model=32", "model.n_heads=4", "model.n_layers=2", "model.vocab_size=1024"]
SIZES = ["max_duration=2ba", "eval_interval=2ba", "eval_subset_num_batches=1",
         "global_train_batch_size=4", "device_train_microbatch_size=1",
         "device_eval_batch_size=2", "save_interval=2ba", "device=cpu", "precision=fp32"]

# recipe -> (model family, extra size overrides). "llama-3.1-8b" etc: a tiny Llama built from
# that release's config.json (yamls/shapes/) with its sizes swapped; "mpt": a foundryx MPT
# export; "scratch": an MPT built from the recipe's own model section (sizes swapped).
RECIPES: dict[str, tuple[str, list[str]]] = {
    "finetune/llama-3.1-70b-lora.yaml": ("llama-3.1-70b", []),
    "finetune/llama-3.1-405b-lora-fp8.yaml": ("llama-3.1-405b", []),
    "finetune/llama-3.1-405b-lora-mi300x.yaml": ("llama-3.1-405b", []),
    "finetune/llama-8b-lora-fp8.yaml": ("llama-3.1-8b", []),
    "finetune/llama-lora.yaml": ("llama-3.1-8b", []),
    "finetune/hf-causal-lm.yaml": ("llama-3.1-8b", []),
    "finetune/mpt-lora.yaml": ("mpt", []),
    "pretrain/llama-style-1b.yaml": ("scratch", ["model.attn_config.kv_n_heads=2",
                                                 "model.ffn_config.ffn_hidden_size=64"]),
    "mpt-125m.yaml": ("scratch", []),
    "mpt-350m.yaml": ("scratch", []),
    "mpt-760m.yaml": ("scratch", []),
    "mpt-1b.yaml": ("scratch", []),
    "mpt-3b.yaml": ("scratch", []),
    "mpt-7b.yaml": ("scratch", []),
}
# Recipes run on 2 ranks, in their own configuration, by another test.
ELSEWHERE = {"quickstart.yaml": "tests/test_concurrent_datasets.py (composer -n 2, 6 batches)"}


def recipe_files() -> list[str]:
    return sorted(str(p.relative_to(ROOT / "yamls")) for p in (ROOT / "yamls").rglob("*.yaml")
                  if "shapes" not in p.parts)


def test_every_recipe_is_covered():
    missing = [r for r in recipe_files() if r not in RECIPES and r not in ELSEWHERE]
    assert not missing, f"recipes no test runs on 2 ranks: {missing}; add them to RECIPES"
    gone = [r for r in RECIPES if r not in recipe_files()]
    assert not gone, gone


def tiny_llama(shape: str, out: Path, tokenizer_dir: Path) -> Path:
    """A tiny random Llama of ``shape``'s release (its config.json with the sizes swapped),
    saved in bf16 safetensors with the quickstart tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    config = json.loads((SHAPES / shape / "config.json").read_text())
    config = {k: v for k, v in config.items() if k not in ("architectures", "model_type")}
    torch.manual_seed(0)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = LlamaConfig(**{**config, **TINY_LLAMA, "bos_token_id": tok.bos_token_id,
                         "eos_token_id": tok.eos_token_id})
    model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    saved = json.loads((out / "config.json").read_text())
    assert saved.get("torch_dtype", saved.get("dtype")) == "bfloat16"
    return out


def tiny_mpt_export(out: Path, tokenizer_dir: Path) -> Path:
    """A tiny foundryx MPT (Llama-style) saved in bf16 safetensors, as `foundryx export` does."""
    from transformers import AutoTokenizer

    from foundryx.models.mpt.configuration import MPTConfig
    from foundryx.models.mpt.modeling import MPTForCausalLM

    torch.manual_seed(0)
    model = MPTForCausalLM(MPTConfig(
        d_model=32, n_heads=4, n_layers=2, max_seq_len=128, vocab_size=1024, no_bias=True,
        attn_config={"rope": True, "kv_n_heads": 2}, norm_type="rmsnorm",
        ffn_config={"ffn_type": "swiglu"})).to(torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def models(quickstart_data, tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("recipe_models")
    tok = quickstart_data / "tokenizer"
    out = {s: tiny_llama(s, tmp / s, tok) for s in ("llama-3.1-8b", "llama-3.1-70b",
                                                   "llama-3.1-405b")}
    out["mpt"] = tiny_mpt_export(tmp / "mpt", tok)
    return out


def overrides(recipe: str, models: dict[str, Path], data: Path) -> list[str]:
    family, extra = RECIPES[recipe]
    if family == "scratch":
        model = [f"variables.data_local={data}/mds", f"variables.tokenizer_name={data}/tokenizer",
                 "variables.max_seq_len=128", "eval_loader.dataset.split=val", *TINY_MPT]
    else:
        model = [f"variables.model_path={models[family]}", f"variables.data_root={data}",
                 "variables.max_seq_len=128"]
    return [*model, *extra, *SIZES]


def launch(recipe: str, args: list[str], out: Path) -> tuple[int, str]:
    """``composer -n 2 train.py yamls/RECIPE ARGS`` in the folder ``out`` (started as the
    composer launcher starts it: tests/launcher.py); (exit code, logs)."""
    env = {**os.environ,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = launcher.launch([str(ROOT / "train.py"), str(ROOT / "yamls" / recipe), *args], 2,
                           out, out, env, timeout=900)
    return proc.returncode, "".join(f"\n--- {p.name}\n{p.read_text()[-6000:]}"
                                    for p in sorted(out.glob("rank*.*")))


def _leg(recipe: str):
    """The from-scratch MPT recipes run on the modern leg, the fine-tuning ones on the pinned
    leg (make test splits the slow set between the two torch legs: tests/conftest.py)."""
    marks = [pytest.mark.modern_leg] if RECIPES[recipe][0] == "scratch" else []
    return pytest.param(recipe, marks=marks)


@pytest.mark.slow
@pytest.mark.parametrize("recipe", [_leg(r) for r in sorted(RECIPES)])
def test_recipe_trains_on_two_ranks(recipe, models, quickstart_data, tmp_path):
    from foundryx.checkpoint.layout import complete_checkpoints

    code, logs = launch(recipe, overrides(recipe, models, quickstart_data), tmp_path)
    assert code == 0, f"{recipe} failed on 2 ranks:\n{logs[-12000:]}"
    section = yaml.safe_load((ROOT / "yamls" / recipe).read_text())
    folder = str(section.get("save_folder", "")).replace("${variables.run_name}",
                                                         str(section.get("variables", {})
                                                             .get("run_name", "")))
    if folder:
        saved = complete_checkpoints(tmp_path / folder)
        assert saved and saved[0][1] is not None, f"{recipe}: no checkpoint in {folder}\n{logs[-4000:]}"
        assert saved[0][1].batch == 2, saved[0][1]
