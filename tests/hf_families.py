"""Tiny configs of the Hugging Face model families people fine-tune in 2026, each keeping what
sets its family apart (per-head q/k norms, sliding-window layers, fused projections, tied
embeddings), at a size a CPU test trains in a second."""

from __future__ import annotations

from hf_tiny import VOCAB

BASE = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 64,
        "vocab_size": VOCAB}

FAMILIES = {
    # Llama 3.x: grouped kv heads, llama3 rope scaling, untied head
    "llama3": ("llama", {**BASE, "rope_theta": 500000.0,
                         "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 32}}),
    # Qwen3 (dense): an explicit head_dim, RMSNorm of q and k per head, tied embeddings
    "qwen3": ("qwen3", {**BASE, "head_dim": 8, "tie_word_embeddings": True}),
    # Gemma 3 (text): sliding-window and global layers, q/k norms, scaled embeddings, tied
    "gemma3": ("gemma3_text", {**BASE, "head_dim": 8, "sliding_window": 4,
                               "query_pre_attn_scalar": 8, "layer_types": ["sliding_attention",
                                                                           "full_attention"]}),
    # Mistral / Ministral
    "mistral": ("mistral", {**BASE, "sliding_window": None}),
    # OLMo 2: q/k norms over the whole projection (all heads), post-norms
    "olmo2": ("olmo2", BASE),
    # Phi-4 (Phi3ForCausalLM): fused qkv_proj and gate_up_proj
    "phi4": ("phi3", {**BASE, "pad_token_id": 0}),
}


def save_family(name: str, folder, dtype="bfloat16", shard: str = "40KB", **sizes) -> str:
    """A tiny random model of family ``name`` saved as ``dtype`` in several safetensors files
    (``sizes``: config fields changed)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, config = FAMILIES[name]
    torch.manual_seed(0)
    cfg = AutoConfig.for_model(model_type, **{**config, **sizes})
    model = AutoModelForCausalLM.from_config(cfg).to(getattr(torch, dtype))
    model.config.dtype = dtype  # 4.x writes it as torch_dtype, 5.x as dtype
    model.save_pretrained(folder, max_shard_size=shard)
    return str(folder)
