"""Tensor-parallel plans (data; applied by foundryx.parallel.tp) for the Hugging Face causal LMs
whose layers foundryx knows by name: Llama, Mistral/Ministral, Qwen2 and Qwen3 share one layout;
Gemma 3 adds two norms around its MLP. OLMo 2 and Phi-3/Phi-4 are refused with the reason.

Their attention modules reshape with -1 for the head count (transformers >= 4.48), so a rank's
q/k/v columns are its heads without any attribute to adjust; per-head q/k norms (Qwen3,
Gemma 3: an RMSNorm over head_dim) run on a rank's heads with their gradient summed over the
ranks (the ``head_norm`` style).
"""

from __future__ import annotations

from typing import Any

from torch import nn

LLAMA_LIKE = ("llama", "mistral", "ministral", "qwen2", "qwen3", "gemma3_text")
# families whose layers a column split cannot serve, with the reason
REFUSED = {
    "olmo2": "OLMo 2's q_norm and k_norm normalise over all heads' projections together, which "
             "a column split of q_proj and k_proj divides between ranks",
    "phi3": "Phi-3/Phi-4's fused qkv_proj is cut into q, k and v at the model's global head "
            "counts in its attention's forward, which a rank's share of the rows does not have",
}


def hf_tp_plan(model: nn.Module) -> dict[str, Any] | None:
    """The plan of a Hugging Face ``*ForCausalLM`` (patterns relative to it), or None."""
    config = model.config
    if config.model_type in REFUSED:
        return {"unsupported": f"{REFUSED[config.model_type]}; no tensor-parallel plan",
                "layers": {}}
    if config.model_type not in LLAMA_LIKE:
        return None
    layers = "model.layers.*"
    plan = {
        "model.layers.0": "sequence_parallel_start",
        f"{layers}.input_layernorm": "sequence_parallel",
        f"{layers}.self_attn": "gather_sequence(hidden_states)",
        f"{layers}.self_attn.q_proj": "colwise",
        f"{layers}.self_attn.k_proj": "colwise",
        f"{layers}.self_attn.v_proj": "colwise",
        f"{layers}.self_attn.o_proj": "rowwise",
        f"{layers}.post_attention_layernorm": "sequence_parallel",
        f"{layers}.mlp": "gather_sequence",
        f"{layers}.mlp.gate_proj": "colwise",
        f"{layers}.mlp.up_proj": "colwise",
        f"{layers}.mlp.down_proj": "rowwise",
        "model.norm": "sequence_parallel_end",
    }
    if config.model_type in ("qwen3", "gemma3_text"):  # per-head q/k norms on a rank's heads
        plan[f"{layers}.self_attn.q_norm"] = "head_norm"
        plan[f"{layers}.self_attn.k_norm"] = "head_norm"
    if config.model_type == "gemma3_text":
        # its post-attention norm and the norm after the MLP apply to a block's output before
        # the residual add (a plain tensor there); the norm before the MLP feeds the MLP
        plan[f"{layers}.post_attention_layernorm"] = "sequence_parallel_local"
        plan[f"{layers}.pre_feedforward_layernorm"] = "sequence_parallel"
        plan[f"{layers}.post_feedforward_layernorm"] = "sequence_parallel_local"
    out: dict[str, Any] = {}
    # a tied head shares the (replicated) embedding; Gemma 3 scales its embedding's output,
    # which a vocabulary-parallel embedding leaves as a masked partial sum DTensor cannot scale
    if not config.tie_word_embeddings and config.model_type != "gemma3_text":
        # vocabulary-parallel, as torchtitan: the embedding split by rows, the head by rows
        # too, its logits left split for the loss (the model's loss_function), whole in eval
        out["vocab"] = {"size": config.vocab_size, "loss_parallel": "loss_function",
                        "layers": {"model.embed_tokens": "vocab_parallel_embedding",
                                   "lm_head": "colwise_loss_parallel"}}
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    return {
        **out,
        "layers": plan,
        "divisible": {"num_attention_heads": heads, "intermediate_size": config.intermediate_size},
        # fewer kv heads than TP ranks: k and v replicated, each rank its q heads' kv head
        "kv_heads": {"count": kv, "name": "num_key_value_heads",
                     "layers": [f"{layers}.self_attn.k_proj", f"{layers}.self_attn.v_proj"],
                     "rank_attrs": {f"{layers}.self_attn": {"num_key_value_groups": "heads_per_rank"}},
                     "heads": heads},
    }


# families whose attention modules take q/k/v through transformers' attention interface with
# nothing but causality and the padding mask around it (what foundryx.parallel.cp splits)
CP_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


def hf_cp_plan(model: nn.Module) -> dict[str, Any] | None:
    """The context-parallel plan of a Hugging Face ``*ForCausalLM`` (data, applied by
    foundryx.parallel.cp): its attention modules run through transformers' attention
    interface on the whole sequence of a rank's heads; None for other families."""
    config = model.config
    if config.model_type not in CP_FAMILIES:
        return None
    heads = config.num_attention_heads
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True):
        return {"unsupported": f"{config.model_type} with sliding_window {window}: the window "
                               "is in the mask transformers builds per shard", "heads": heads,
                "kv_heads": heads}
    return {"heads": heads,
            "kv_heads": getattr(config, "num_key_value_heads", None) or heads,
            "hf_attention": "model.layers.*.self_attn"}
