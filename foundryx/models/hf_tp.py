"""Tensor-parallel plans (data; applied by foundryx.parallel.tp) for the Hugging Face causal LMs
whose layers foundryx knows by name: Llama, Mistral and Qwen2 share one layout.

Their attention modules reshape with -1 for the head count (transformers >= 4.48), so a rank's
q/k/v columns are its heads without any attribute to adjust.
"""

from __future__ import annotations

from typing import Any

from torch import nn

LLAMA_LIKE = ("llama", "mistral", "qwen2")


def hf_tp_plan(model: nn.Module) -> dict[str, Any] | None:
    """The plan of a Hugging Face ``*ForCausalLM`` (patterns relative to it), or None."""
    config = model.config
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
    out: dict[str, Any] = {}
    if not config.tie_word_embeddings:  # a tied head shares the (replicated) embedding
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
