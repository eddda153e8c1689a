"""The options of an MPT model section, as typed dataclasses (LLM Foundry's key names).

The one validator (:mod:`foundryx.config.types`) checks a YAML ``model:`` section against
:class:`MPTOptions`; :class:`~foundryx.models.mpt.configuration.MPTConfig` takes its
defaults from here, and the model code reads the typed sub-configs (``config.attn``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from foundryx.config.types import is_int, option
from foundryx.models.peft.lora_fields import LORA_FIELDS, LoraFields

INIT_SCHEMES = ("kaiming_normal_", "kaiming_uniform_", "baseline_", "small_init_", "neox_init_")
InitScheme = Literal["kaiming_normal_", "kaiming_uniform_", "baseline_", "small_init_", "neox_init_"]
Nonlinearity = Literal["relu", "leaky_relu", "linear", "tanh", "sigmoid", "selu"]


def _is_device(x: object) -> bool:
    try:
        torch.device(x)
    except (RuntimeError, TypeError):
        return False
    return True


@dataclass
class AttnConfig:
    """``attn_config``: attention."""

    attn_impl: str = option("attention implementation (registry attention_implementations): "
                            "torch, triton, flash, flex or auto", default="torch",
                            registry="attention_implementations")
    attn_pdrop: float = option("dropout on attention weights", default=0.0, ge=0, lt=1)
    qk_ln: bool = option("normalise q and k (norm_type) before attention", default=False)
    softmax_scale: float | None = option("null: 1 / sqrt(head_dim)", default=None, gt=0)
    alibi: bool = option("ALiBi position biases", default=False)
    alibi_bias_max: float = option("largest ALiBi slope exponent", default=8, gt=0)
    rope: bool = option("rotary position embeddings", default=False)
    rope_theta: float = option("RoPE base", default=10000.0, gt=0)
    kv_n_heads: int | None = option(
        "key/value heads: null = n_heads (multi-head), 1 = multi-query, else grouped-query "
        "(must divide n_heads)", default=None, gt=0)
    attn_uses_sequence_id: bool = option(
        "packed documents do not attend to each other (the batches need sequence_id)", default=False)
    sliding_window_size: int = option(
        "-1: off; w: a token sees the w tokens before it", default=-1,
        check=(lambda v: v == -1 or v > 0, "-1 (off) or a whole number > 0"))


@dataclass
class FFNConfig:
    """``ffn_config``: the feed-forward block."""

    ffn_type: str = option("feed-forward block (registry ffns): mlp or swiglu", default="mlp",
                           registry="ffns")
    ffn_hidden_size: int | None = option("null: int(expansion_ratio * d_model)", default=None, gt=0)


@dataclass
class InitConfig:
    """``init_config``: weight initialisation."""

    name: InitScheme = option("init scheme", default="kaiming_normal_")
    init_std: float | None = option("std of baseline_", default=None, gt=0)
    emb_init_std: float | None = option(
        "embeddings ~ N(0, emb_init_std); null: as the other weights", default=None, gt=0)
    emb_init_uniform_lim: float | None = option("embeddings ~ U(-lim, lim)", default=None, gt=0)
    fan_mode: Literal["fan_in", "fan_out"] = option("kaiming_*: fan mode", default="fan_in")
    init_nonlinearity: Nonlinearity = option("kaiming_*: nonlinearity", default="relu")
    init_gain: float = option("kaiming_*: negative slope a", default=0.0)
    init_div_is_residual: bool | float = option(
        "divide residual projections by sqrt(2 * n_layers) (true), not (false), or by a number",
        default=True, check=(lambda v: isinstance(v, bool) or v > 0, "true, false or a number > 0"))


@dataclass
class MPTOptions(LoraFields):
    """The ``mpt_causal_lm`` model section (and the fields of an MPT ``config.json``)."""

    d_model: int = option("hidden size", default=2048, gt=0)
    n_heads: int = option("attention heads (must divide d_model)", default=16, gt=0)
    n_layers: int = option("transformer blocks", default=24, gt=0)
    expansion_ratio: float = option("FFN hidden size / d_model", default=4.0, gt=0)
    max_seq_len: int = option("longest sequence", default=2048, gt=0)
    vocab_size: int = option("embedding rows (>= the tokenizer's size; a multiple of 64 is "
                             "fastest)", default=50368, gt=0)
    resid_pdrop: float = option("dropout on residual branches", default=0.0, ge=0, lt=1)
    emb_pdrop: float = option("dropout on embeddings", default=0.0, ge=0, lt=1)
    learned_pos_emb: bool | None = option(
        "learned position table; null: only when neither ALiBi nor RoPE is on", default=None)
    attn_config: AttnConfig = option("attention options", default_factory=AttnConfig)
    ffn_config: FFNConfig = option("feed-forward options", default_factory=FFNConfig)
    norm_type: str = option("normalisation (registry norms): layernorm or rmsnorm",
                            default="layernorm", registry="norms")
    norm_eps: float = option("epsilon of the norms", default=1e-5, gt=0)
    no_bias: bool = option("no biases in linear layers and norms", default=False)
    tie_word_embeddings: bool = option("output projection shares the input embedding", default=True)
    logit_scale: float | Literal["inv_sqrt_d_model"] | None = option(
        "multiply the logits by this; null: 1", default=None, gt=0)
    init_config: InitConfig = option("weight initialisation", default_factory=InitConfig)
    init_device: str = option("where to build the weights: cpu, meta (materialised after "
                              "sharding), ...", default="cpu",
                              check=(_is_device, "a torch device such as 'cpu' or 'meta'"))

    @property
    def uses_sequence_id(self) -> bool:
        """The batches must carry ``sequence_id`` (read by other sections' checks)."""
        return self.attn_config.attn_uses_sequence_id

    def problems(self) -> list[str]:
        """Rules between fields (each field is already valid on its own)."""
        p: list[str] = []
        a, heads = self.attn_config, self.n_heads
        if self.d_model % heads:
            p.append(f"d_model: {self.d_model} is not divisible by n_heads {heads}; make "
                     "d_model a multiple of n_heads")
        if a.alibi and a.rope:
            p.append("attn_config.alibi: attn_config.alibi and attn_config.rope are both true; "
                     "choose one")
        if a.rope and (self.d_model // heads) % 2:
            p.append(f"attn_config.rope: head_dim d_model/n_heads = {self.d_model // heads} is "
                     "odd; RoPE needs an even head_dim, change d_model or n_heads")
        if is_int(a.kv_n_heads) and heads % a.kv_n_heads:
            divisors = [str(d) for d in range(1, heads + 1) if heads % d == 0]
            p.append(f"attn_config.kv_n_heads: {a.kv_n_heads} does not divide n_heads {heads}; "
                     f"use one of {', '.join(divisors)}")
        if a.attn_pdrop and a.attn_impl in ("flex", "triton"):
            p.append(f"attn_config.attn_pdrop: attn_impl {a.attn_impl} has no attention dropout; "
                     "set attn_pdrop: 0, or attn_impl torch or flash")
        if self.init_config.name == "baseline_" and self.init_config.init_std is None:
            p.append("init_config.init_std: baseline_ needs init_std; set it, e.g. 0.02")
        return p + self.lora_problems()


# Run options in the model section that are not MPT hyperparameters (not in MPTConfig).
RUN_FIELDS = LORA_FIELDS

SUB_CONFIGS = {"attn_config": AttnConfig, "ffn_config": FFNConfig, "init_config": InitConfig}
