"""Tiny random Hugging Face causal LMs and MPTs for the hf_causal_lm and export tests."""

from __future__ import annotations

from pathlib import Path

import torch

VOCAB = 448  # >= the tiny_tokenizer's 400 tokens
SIZES = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "max_position_embeddings": 64, "vocab_size": VOCAB}
HF_CONFIGS = {
    "llama": {**SIZES, "num_key_value_heads": 2},
    "mistral": {**SIZES, "num_key_value_heads": 2},
    "qwen2": {**SIZES, "num_key_value_heads": 2},
    "gpt_neox": SIZES,
    "gpt2": {"n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64, "vocab_size": VOCAB},
}
MPT_TINY = {"d_model": 32, "n_heads": 4, "n_layers": 2, "max_seq_len": 32, "vocab_size": VOCAB}
LLAMA_STYLE = {"attn_config": {"rope": True}, "norm_type": "rmsnorm",
               "ffn_config": {"ffn_type": "swiglu"}, "no_bias": True}


def hf_folder(model_type: str, out: Path, tokenizer=None, seed: int = 0) -> Path:
    """Save a tiny random ``model_type`` model (and ``tokenizer``) to ``out``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **HF_CONFIGS[model_type]))
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    return out


def random_mpt(seed: int = 0, **overrides):
    """A tiny MPTForCausalLM in eval mode with every parameter (norms, biases) randomised."""
    from foundryx.models.mpt.configuration import MPTConfig
    from foundryx.models.mpt.modeling import MPTForCausalLM

    torch.manual_seed(seed)
    model = MPTForCausalLM(MPTConfig(**{**MPT_TINY, **overrides}))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def token_batch(batch: int = 4, seq: int = 16, seed: int = 1) -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def composer_state(model) -> dict[str, torch.Tensor]:
    """``model``'s weights keyed as in a ComposerModel checkpoint (``model.`` prefix)."""
    return {f"model.{k}": v for k, v in model.state_dict().items()}


def train_steps(model, steps: int = 12, lr: float = 1e-2, opt=None) -> list[float]:
    """``steps`` optimizer steps (``opt``, default AdamW over every parameter) on one batch of
    :func:`token_batch`; the losses."""
    batch = token_batch()
    opt = opt or torch.optim.AdamW(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = model.loss(model(batch), batch)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses
