"""``MPTConfig``: the MPT hyperparameters, LLM Foundry compatible, and their validation."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

import torch
from transformers import PretrainedConfig

from foundryx import registry
from foundryx.errors import did_you_mean

ATTN_CONFIG_DEFAULTS: dict[str, Any] = {
    "attn_impl": "torch",  # a key of foundryx.registry.attention_implementations
    "attn_pdrop": 0.0,
    "qk_ln": False,  # normalise q and k (norm_type) before attention
    "softmax_scale": None,  # None: 1 / sqrt(head_dim)
    "alibi": False,
    "alibi_bias_max": 8,
    "rope": False,
    "rope_theta": 10000.0,
    "kv_n_heads": None,  # None: n_heads (multi-head); 1: multi-query; else grouped-query
    "attn_uses_sequence_id": False,  # packed documents do not attend to each other
    "sliding_window_size": -1,  # -1: off; w: a token sees the w tokens before it
}
FFN_CONFIG_DEFAULTS: dict[str, Any] = {
    "ffn_type": "mlp",  # a key of foundryx.registry.ffns
    "ffn_hidden_size": None,  # None: int(expansion_ratio * d_model)
}
INIT_CONFIG_DEFAULTS: dict[str, Any] = {
    "name": "kaiming_normal_",  # one of INIT_SCHEMES
    "init_std": None,  # std of baseline_
    "emb_init_std": None,  # embeddings ~ N(0, emb_init_std); None: as the other weights
    "emb_init_uniform_lim": None,  # embeddings ~ U(-lim, lim)
    "fan_mode": "fan_in",  # kaiming_*
    "init_nonlinearity": "relu",  # kaiming_*
    "init_gain": 0.0,  # kaiming_*: negative slope ``a``
    "init_div_is_residual": True,  # residual projections / sqrt(2 * n_layers); or a number
}
INIT_SCHEMES = ("kaiming_normal_", "kaiming_uniform_", "baseline_", "small_init_", "neox_init_")
NONLINEARITIES = ("relu", "leaky_relu", "linear", "tanh", "sigmoid", "selu")


def _merge(defaults: dict[str, Any], value: Any) -> Any:
    """Defaults overlaid by a user mapping; a non-mapping is kept so problems() can name it."""
    if value is None:
        return dict(defaults)
    if isinstance(value, Mapping):
        return {**defaults, **value}
    return value


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_num(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _is_device(x: Any) -> bool:
    try:
        torch.device(x)
    except (RuntimeError, TypeError):
        return False
    return True


# Per-key value checks: key -> (test, what a valid value is).
Check = tuple[Callable[[Any], bool], str]
POSITIVE_INT: Check = (lambda v: _is_int(v) and v > 0, "a whole number > 0")
POSITIVE: Check = (lambda v: _is_num(v) and v > 0, "a number > 0")
OPTIONAL_POSITIVE: Check = (lambda v: v is None or (_is_num(v) and v > 0), "null or a number > 0")
PROBABILITY: Check = (lambda v: _is_num(v) and 0 <= v < 1, "a probability in [0, 1)")
BOOL: Check = (lambda v: isinstance(v, bool), "true or false")

TOP_CHECKS: dict[str, Check] = {
    **dict.fromkeys(("d_model", "n_heads", "n_layers", "max_seq_len", "vocab_size"), POSITIVE_INT),
    "expansion_ratio": POSITIVE,
    "resid_pdrop": PROBABILITY,
    "emb_pdrop": PROBABILITY,
    "learned_pos_emb": (lambda v: v is None or isinstance(v, bool), "null (auto), true or false"),
    **dict.fromkeys(("no_bias", "tie_word_embeddings"), BOOL),
    "norm_eps": POSITIVE,
    "logit_scale": (
        lambda v: v in (None, "inv_sqrt_d_model") or (_is_num(v) and v > 0),
        "null, a number > 0 or 'inv_sqrt_d_model'",
    ),
    "init_device": (_is_device, "a torch device such as 'cpu' or 'meta'"),
}
ATTN_CHECKS: dict[str, Check] = {
    "attn_pdrop": PROBABILITY,
    **dict.fromkeys(("qk_ln", "alibi", "rope", "attn_uses_sequence_id"), BOOL),
    "softmax_scale": OPTIONAL_POSITIVE,
    "alibi_bias_max": POSITIVE,
    "rope_theta": POSITIVE,
    "kv_n_heads": (
        lambda v: v is None or (_is_int(v) and v > 0),
        "null (= n_heads) or a whole number > 0 that divides n_heads",
    ),
    "sliding_window_size": (
        lambda v: _is_int(v) and (v == -1 or v > 0),
        "-1 (off) or a whole number > 0",
    ),
}
FFN_CHECKS: dict[str, Check] = {
    "ffn_hidden_size": (
        lambda v: v is None or (_is_int(v) and v > 0),
        "null (= expansion_ratio * d_model) or a whole number > 0",
    ),
}
INIT_CHECKS: dict[str, Check] = {
    "name": (lambda v: v in INIT_SCHEMES, f"one of {', '.join(INIT_SCHEMES)}"),
    **dict.fromkeys(("init_std", "emb_init_std", "emb_init_uniform_lim"), OPTIONAL_POSITIVE),
    "fan_mode": (lambda v: v in ("fan_in", "fan_out"), "'fan_in' or 'fan_out'"),
    "init_nonlinearity": (lambda v: v in NONLINEARITIES, f"one of {', '.join(NONLINEARITIES)}"),
    "init_gain": (_is_num, "a number"),
    "init_div_is_residual": (
        lambda v: isinstance(v, bool) or (_is_num(v) and v > 0),
        "true, false or a number > 0",
    ),
}
SECTIONS = {
    "attn_config": (ATTN_CONFIG_DEFAULTS, ATTN_CHECKS),
    "ffn_config": (FFN_CONFIG_DEFAULTS, FFN_CHECKS),
    "init_config": (INIT_CONFIG_DEFAULTS, INIT_CHECKS),
}


class MPTConfig(PretrainedConfig):
    """Hyperparameters of an MPT decoder. Sub-configs merge over their defaults."""

    model_type = "foundryx_mpt"
    attribute_map = {
        "hidden_size": "d_model",
        "num_attention_heads": "n_heads",
        "num_hidden_layers": "n_layers",
        "max_position_embeddings": "max_seq_len",
    }

    def __init__(
        self,
        d_model: int = 2048,
        n_heads: int = 16,
        n_layers: int = 24,
        expansion_ratio: float = 4.0,
        max_seq_len: int = 2048,
        vocab_size: int = 50368,
        resid_pdrop: float = 0.0,
        emb_pdrop: float = 0.0,
        learned_pos_emb: bool | None = None,
        attn_config: dict[str, Any] | None = None,
        ffn_config: dict[str, Any] | None = None,
        norm_type: str = "layernorm",
        norm_eps: float = 1e-5,
        no_bias: bool = False,
        tie_word_embeddings: bool = True,
        logit_scale: float | str | None = None,
        init_config: dict[str, Any] | None = None,
        init_device: str = "cpu",
        **kwargs: Any,
    ):
        self.d_model = d_model
        self.n_heads = n_heads
        self.n_layers = n_layers
        self.expansion_ratio = expansion_ratio
        self.max_seq_len = max_seq_len
        self.vocab_size = vocab_size
        self.resid_pdrop = resid_pdrop
        self.emb_pdrop = emb_pdrop
        self.attn_config = _merge(ATTN_CONFIG_DEFAULTS, attn_config)
        # As in LLM Foundry: a learned position table only when neither ALiBi nor RoPE is on.
        rel_pos = self.attn_config.get("alibi") is True or self.attn_config.get("rope") is True
        self.learned_pos_emb = (not rel_pos) if learned_pos_emb is None else learned_pos_emb
        self.ffn_config = _merge(FFN_CONFIG_DEFAULTS, ffn_config)
        self.norm_type = norm_type
        self.norm_eps = norm_eps
        self.no_bias = no_bias
        self.logit_scale = logit_scale
        self.init_config = _merge(INIT_CONFIG_DEFAULTS, init_config)
        self.init_device = init_device
        super().__init__(tie_word_embeddings=tie_word_embeddings, **kwargs)

    @classmethod
    def accepted_keys(cls) -> set[str]:
        """Top-level keys a model section may set (the constructor's named arguments)."""
        params = inspect.signature(cls.__init__).parameters.values()
        return {p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD and p.name != "self"}

    # -- derived sizes (valid once problems() is empty) -------------------------------------
    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def kv_n_heads(self) -> int:
        return self.attn_config["kv_n_heads"] or self.n_heads

    @property
    def ffn_hidden_size(self) -> int:
        return self.ffn_config["ffn_hidden_size"] or int(self.expansion_ratio * self.d_model)

    # -- validation ------------------------------------------------------------------------
    def problems(self) -> list[str]:
        """Every inconsistency, each as ``"key: what is wrong; fix"``; empty when valid."""
        p = _bad_values("", TOP_CHECKS, vars(self))
        for name, (defaults, checks) in SECTIONS.items():
            section = getattr(self, name)
            if not isinstance(section, Mapping):
                p.append(
                    f"{name}: expected a mapping, got {section!r}; give a dict of options "
                    f"or leave it out"
                )
                continue
            for key in section:
                if key not in defaults:
                    hint = did_you_mean(key, defaults) or f"; known: {', '.join(defaults)}"
                    p.append(f"{name}.{key}: unknown option{hint}; remove or rename it")
            p += _bad_values(f"{name}.", checks, section)
        names = [("norm_type", self.norm_type, registry.norms)]
        if isinstance(self.attn_config, Mapping):
            names.append(
                (
                    "attn_config.attn_impl",
                    self.attn_config.get("attn_impl"),
                    registry.attention_implementations,
                )
            )
        if isinstance(self.ffn_config, Mapping):
            names.append(("ffn_config.ffn_type", self.ffn_config.get("ffn_type"), registry.ffns))
        for key, value, reg in names:
            if not (isinstance(value, str) and value in reg):
                p.append(
                    f"{key}: unknown name {value!r} in registry {reg.name!r}"
                    f"{did_you_mean(str(value), reg.names())}; use one of "
                    f"{', '.join(reg.names())}"
                )
        return p + self._cross_problems()

    def _cross_problems(self) -> list[str]:
        """Problems between keys, checked only where the keys themselves are valid."""
        p: list[str] = []
        heads_ok = _is_int(self.n_heads) and self.n_heads > 0
        if heads_ok and _is_int(self.d_model) and self.d_model % self.n_heads:
            p.append(
                f"d_model: {self.d_model} is not divisible by n_heads {self.n_heads}; "
                f"make d_model a multiple of n_heads"
            )
        a = self.attn_config if isinstance(self.attn_config, Mapping) else {}
        if a.get("alibi") is True and a.get("rope") is True:
            p.append(
                "attn_config.alibi: attn_config.alibi and attn_config.rope are both true; "
                "choose one"
            )
        if a.get("rope") is True and heads_ok and _is_int(self.d_model) and self.head_dim % 2:
            p.append(
                f"attn_config.rope: head_dim d_model/n_heads = {self.head_dim} is odd; "
                f"RoPE needs an even head_dim, change d_model or n_heads"
            )
        kv = a.get("kv_n_heads")
        if heads_ok and _is_int(kv) and kv > 0 and self.n_heads % kv:
            divisors = [str(d) for d in range(1, self.n_heads + 1) if self.n_heads % d == 0]
            p.append(
                f"attn_config.kv_n_heads: {kv} does not divide n_heads {self.n_heads}; "
                f"use one of {', '.join(divisors)}"
            )
        i = self.init_config if isinstance(self.init_config, Mapping) else {}
        if i.get("name") == "baseline_" and i.get("init_std") is None:
            p.append("init_config.init_std: baseline_ needs init_std; set it, e.g. 0.02")
        return p


def _bad_values(prefix: str, checks: dict[str, Check], values: Mapping[str, Any]) -> list[str]:
    return [
        f"{prefix}{key}: {values[key]!r} is not valid; use {expected}"
        for key, (ok, expected) in checks.items()
        if key in values and not ok(values[key])
    ]
