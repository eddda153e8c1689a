"""The sizes at which every recipe in yamls/ runs on 2 CPU ranks in its own configuration
(tests/test_recipes_2rank.py), and the tiny models it runs them on: shared with
benchmarks/plan_vs_run.py, which measures those runs' host memory against the planner's."""

from __future__ import annotations

import json
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
SHAPES = ROOT / "yamls" / "shapes"

# Tiny sizes: the model is the only thing scaled down (with the batch and sequence sizes). A
# hidden size of 128 leaves k_proj 64 outputs: wide enough for the 405B recipe's LoRA r=64.
TINY_LLAMA = {"hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
              "vocab_size": 1024}  # the quickstart tokenizer's 1024 tokens
TINY_MPT = ["model.d_model=32", "model.n_heads=4", "model.n_layers=2", "model.vocab_size=1024"]
SIZES = ["max_duration=4ba", "eval_interval=4ba", "eval_subset_num_batches=1",
         "global_train_batch_size=4", "device_train_microbatch_size=1",
         "device_eval_batch_size=2", "save_interval=4ba", "device=cpu",
         # the learning rate and warmup of a 4-batch run of a tiny model: the recipes' (2e-4 after
         # 50 warmup batches) move 4 batches by nothing bf16 logits can show
         "optimizer.lr=5.0e-3", "scheduler.t_warmup=0ba"]

# recipe -> (model family, extra size overrides). "llama-3.1-8b" etc: a tiny Llama built from
# that release's config.json (yamls/shapes/) with its sizes swapped; "mpt": a foundryx MPT
# export; "scratch": an MPT built from the recipe's own model section (sizes swapped).
RECIPES: dict[str, tuple[str, list[str]]] = {
    "finetune/llama-3.1-70b-lora.yaml": ("llama-3.1-70b", []),
    "finetune/llama-3.1-405b-lora-fp8.yaml": ("llama-3.1-405b", []),
    "finetune/llama-3.1-405b-lora-mi300x.yaml": ("llama-3.1-405b", []),
    "finetune/llama-8b-lora-fp8.yaml": ("llama-3.1-8b", []),
    "finetune/llama-lora.yaml": ("llama-3.1-8b", []),
    "finetune/llama-3.1-8b-lora-long-cp.yaml": ("llama-3.1-8b", ["parallelism.cp=2"]),
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


def overrides(recipe: str, models: dict[str, Path], data: Path) -> list[str]:
    family, extra = RECIPES[recipe]
    if family == "scratch":
        model = [f"variables.data_local={data}/mds", f"variables.tokenizer_name={data}/tokenizer",
                 "variables.max_seq_len=128", "eval_loader.dataset.split=val", *TINY_MPT]
    else:
        model = [f"variables.model_path={models[family]}", f"variables.data_root={data}",
                 "variables.max_seq_len=128"]
    return [*model, *extra, *SIZES]
