"""MPT configured Llama-style → ``LlamaForCausalLM`` (config and weights).

An MPT is Llama-style when it has RoPE, RMSNorm, SwiGLU, no biases, no learned position
table, no ALiBi, no q/k norm, no sliding window, default softmax scale and no logit scale.
The fused ``Wqkv`` is split row-wise into q, k, v (heads are contiguous in both models, and
both rotate the pairs (i, i + head_dim/2), so no permutation is needed); grouped-query
attention becomes ``num_key_value_heads``; tied embeddings stay tied.
"""

from __future__ import annotations

import math
import re

import torch

from foundryx.models.mpt.configuration import MPTConfig

# MPT weight name (regex) → Llama weight name; Wqkv is split separately.
_RENAMES: list[tuple[str, str]] = [
    (r"^transformer\.wte\.weight$", "model.embed_tokens.weight"),
    (r"^transformer\.norm_f\.weight$", "model.norm.weight"),
    (r"^transformer\.blocks\.(\d+)\.norm_1\.weight$", r"model.layers.\1.input_layernorm.weight"),
    (r"^transformer\.blocks\.(\d+)\.norm_2\.weight$", r"model.layers.\1.post_attention_layernorm.weight"),
    (r"^transformer\.blocks\.(\d+)\.attn\.out_proj\.weight$", r"model.layers.\1.self_attn.o_proj.weight"),
    (r"^transformer\.blocks\.(\d+)\.ffn\.(gate|up|down)_proj\.weight$", r"model.layers.\1.mlp.\2_proj.weight"),
    (r"^lm_head\.weight$", "lm_head.weight"),
]
_WQKV = re.compile(r"^transformer\.blocks\.(\d+)\.attn\.Wqkv\.weight$")


def llama_problems(cfg: MPTConfig) -> list[str]:
    """Why this MPT cannot be a LlamaForCausalLM (empty when it can)."""
    a = cfg.attn_config
    scale = a["softmax_scale"]
    checks = [
        (cfg.norm_type == "rmsnorm", f"norm_type is {cfg.norm_type!r} (Llama uses rmsnorm)"),
        (cfg.ffn_config["ffn_type"] == "swiglu",
         f"ffn_config.ffn_type is {cfg.ffn_config['ffn_type']!r} (Llama uses swiglu)"),
        (a["rope"], "attn_config.rope is false (Llama uses rotary position embeddings)"),
        (not a["alibi"], "attn_config.alibi is true (Llama has no ALiBi)"),
        (not cfg.learned_pos_emb, "learned_pos_emb is true (Llama has no learned position table)"),
        (cfg.no_bias, "no_bias is false (Llama's norms and projections have no biases)"),
        (not a["qk_ln"], "attn_config.qk_ln is true (Llama does not normalise q and k)"),
        (scale is None or math.isclose(scale, cfg.head_dim**-0.5),
         f"attn_config.softmax_scale is {scale} (Llama uses 1/sqrt(head_dim))"),
        (a["sliding_window_size"] == -1,
         f"attn_config.sliding_window_size is {a['sliding_window_size']} (Llama attends to "
         "the whole prefix)"),
        (cfg.logit_scale is None, f"logit_scale is {cfg.logit_scale!r} (Llama does not scale logits)"),
    ]
    return [why for ok, why in checks if not ok]


def llama_config(cfg: MPTConfig):
    """The ``LlamaConfig`` of a Llama-style MPT."""
    from transformers import LlamaConfig

    a = cfg.attn_config
    return LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.d_model,
        intermediate_size=cfg.ffn_hidden_size,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.kv_n_heads,
        head_dim=cfg.head_dim,
        hidden_act="silu",
        max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps,
        rope_theta=a["rope_theta"],
        attention_bias=False,
        mlp_bias=False,
        attention_dropout=a["attn_pdrop"],
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=cfg.bos_token_id,
        eos_token_id=cfg.eos_token_id,
        pad_token_id=cfg.pad_token_id,
    )


def llama_state_dict(cfg: MPTConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """MPTForCausalLM weights (no ``model.`` prefix) → LlamaForCausalLM weights."""
    d, kv = cfg.d_model, cfg.kv_n_heads * cfg.head_dim
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        m = _WQKV.match(key)
        if m:
            q, k, v = tensor.split((d, kv, kv), dim=0)
            prefix = f"model.layers.{m.group(1)}.self_attn"
            out.update({f"{prefix}.q_proj.weight": q.clone(), f"{prefix}.k_proj.weight": k.clone(),
                        f"{prefix}.v_proj.weight": v.clone()})
            continue
        for pattern, repl in _RENAMES:
            new, n = re.subn(pattern, repl, key)
            if n:
                out[new] = tensor
                break
        else:
            raise KeyError(f"no Llama name for MPT weight {key!r}")
    if cfg.tie_word_embeddings:
        out["lm_head.weight"] = out["model.embed_tokens.weight"]
    return out
