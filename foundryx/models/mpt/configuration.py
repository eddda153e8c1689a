"""``MPTConfig``: the MPT hyperparameters as a Hugging Face config, LLM Foundry compatible.

Its fields, defaults and checks are those of :class:`~foundryx.models.mpt.options.MPTOptions`
(one source); it stores the sub-configs as plain dicts, as ``config.json`` holds them, and
gives typed views of them (``config.attn``, ``config.ffn``, ``config.init``).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from transformers import PretrainedConfig

from foundryx.config.types import coerce, to_data
from foundryx.models.mpt.options import RUN_FIELDS, AttnConfig, FFNConfig, InitConfig, MPTOptions

FIELDS = tuple(f.name for f in dataclasses.fields(MPTOptions) if f.name not in RUN_FIELDS)


class MPTConfig(PretrainedConfig):
    """Hyperparameters of an MPT decoder: ``MPTConfig(d_model=..., attn_config={...}, ...)``.

    Sub-configs merge over their defaults; an invalid value is a ConfigError listing every
    problem (the same checks as a YAML model section)."""

    model_type = "foundryx_mpt"
    attribute_map = {
        "hidden_size": "d_model",
        "num_attention_heads": "n_heads",
        "num_hidden_layers": "n_layers",
        "max_position_embeddings": "max_seq_len",
    }

    def __init__(self, **kwargs: Any):
        given = {k: kwargs.pop(k) for k in FIELDS if k in kwargs}
        options = coerce(MPTOptions, given, owner="MPTConfig")
        for name in FIELDS:
            setattr(self, name, to_data(getattr(options, name)))
        # As in LLM Foundry: a learned position table only when neither ALiBi nor RoPE is on.
        if self.learned_pos_emb is None:
            self.learned_pos_emb = not (options.attn_config.alibi or options.attn_config.rope)
        # transformers 5 no longer gives every config the special token ids (4.x did: None)
        for key in ("bos_token_id", "eos_token_id", "pad_token_id"):
            kwargs.setdefault(key, None)
        super().__init__(tie_word_embeddings=options.tie_word_embeddings, **kwargs)

    # -- typed views of the sub-configs -------------------------------------------------
    @property
    def attn(self) -> AttnConfig:
        return AttnConfig(**self.attn_config)

    @property
    def ffn(self) -> FFNConfig:
        return FFNConfig(**self.ffn_config)

    @property
    def init(self) -> InitConfig:
        return InitConfig(**self.init_config)

    # -- derived sizes ---------------------------------------------------------------------
    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_n_heads(self) -> int:
        return self.attn.kv_n_heads or self.n_heads

    @property
    def ffn_hidden_size(self) -> int:
        return self.ffn.ffn_hidden_size or int(self.expansion_ratio * self.d_model)
