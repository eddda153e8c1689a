"""What a model holds, counted on the meta device: no weights are read or allocated.

The planner builds the run's model exactly as training would (MPT from its options, a Hugging
Face causal LM from its ``config.json``) under ``torch.device("meta")``, so every parameter is
counted, whatever the architecture, and reads the few shape facts the activation estimate
needs from the model's config.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import AutoModelForCausalLM

from foundryx.config.types import options_or_fields, to_data
from foundryx.errors import ConfigError
from foundryx.models.hf import HFCausalLMOptions, build_config, fuses_loss
from foundryx.models.hf import matmul_params as hf_matmul_params
from foundryx.models.mpt.composer import matmul_params as mpt_matmul_params
from foundryx.models.mpt.configuration import MPTConfig
from foundryx.models.mpt.modeling import MPTForCausalLM
from foundryx.models.mpt.options import RUN_FIELDS, MPTOptions
from foundryx.models.peft.lora import linear_modules
from foundryx.parallel.tiling import RMS_NORMS


class NotPlannable(ConfigError):
    """A run the planner cannot size (a plugin model, a shape it does not read), which may
    still train: ``foundryx plan`` stops on it, ``--dry-run`` prints it in place of a plan."""


@dataclass(frozen=True)
class Shape:
    """The shape facts of a decoder-only transformer the activation estimate uses."""

    n_layers: int
    d_model: int
    n_heads: int
    kv_heads: int
    ffn_hidden: int
    gated_ffn: bool  # SwiGLU-style: gate and up projections
    vocab_size: int
    fused_loss: bool  # the loss is fused with the output projection (no whole logits)
    rotary: bool = True  # RoPE: the rotated q and k are new tensors, kept for attention
    # where the attention keeps its probabilities (heads x s x s per sequence) for backward:
    # "always" (Hugging Face's eager attention), "cpu" (Hugging Face's SDPA with grouped kv
    # heads calls it with enable_gqa, which PyTorch's CPU kernels serve by the math path;
    # measured, benchmarks/RESULTS.md) or "" (never: flash / memory-efficient kernels)
    scores_kept: str = ""
    qkv_fused: bool = False  # q, k, v one projection (MPT's Wqkv): replicated whole then
    # the loss stays fused under tensor parallelism (MPT: vocabulary-parallel chunks,
    # parallel/vocab_rows.py); a Hugging Face model's TP head takes its own loss (models/hf.py)
    fused_under_tp: bool = True
    rms_norm_tiles: bool = False  # its RMS norms are ones tiling.norm tiles (parallel/tiling.py)


@dataclass
class Census:
    """Parameter counts by role (elements, not bytes)."""

    shape: Shape
    total: int
    block_linear: int  # weights of the blocks' linear layers (what a frozen base quantizes)
    largest_linear: int  # the largest single linear weight (one dequantized at a time)
    per_block: int  # all parameters of one block (an FSDP2 unit)
    linears: dict[str, tuple[int, int]] = field(default_factory=dict)  # name: (out, in)
    matmul: int = 0  # parameters used in matmuls (the FLOPs count's N)
    largest_param: int = 0  # the largest single parameter tensor (a loader reads it in slices)
    vocab_params: int = 0  # input embedding and output projection (once when tied): vocab-parallel under TP

    @property
    def head_params(self) -> int:
        """The output projection's own parameters (0 when tied to the embedding)."""
        return max(self.vocab_params - self.shape.vocab_size * self.shape.d_model, 0)

    @property
    def other(self) -> int:
        """Embeddings, output projection, norms and biases: never quantized."""
        return self.total - self.block_linear


def _mpt_model(opts: MPTOptions) -> tuple[nn.Module, Shape]:
    cfg = MPTConfig(**{k: to_data(v) for k, v in vars(opts).items() if k not in RUN_FIELDS})
    with torch.device("meta"):
        model = MPTForCausalLM(cfg)
    shape = Shape(cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.kv_n_heads, cfg.ffn_hidden_size,
                  cfg.ffn.ffn_type == "swiglu", cfg.vocab_size, fused_loss=True,
                  rotary=bool(cfg.attn.rope), qkv_fused=True)
    return model, shape


def _hf_model(opts: HFCausalLMOptions) -> tuple[nn.Module, Shape]:
    c, _ = build_config(opts.pretrained_model_name_or_path, opts.config, opts.config_overrides,
                        opts.trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(c, trust_remote_code=opts.trust_remote_code)
    n_layers = _first(c, "num_hidden_layers", "n_layer", "n_layers")
    d_model = _first(c, "hidden_size", "n_embd", "d_model")
    n_heads = _first(c, "num_attention_heads", "n_head", "n_heads")
    kv_heads = getattr(c, "num_key_value_heads", None) or n_heads
    ffn = getattr(c, "intermediate_size", None) or getattr(c, "n_inner", None) or 4 * d_model
    gated = any("gate" in n for n in linear_modules(model))
    # RoPE: transformers 4 names rope_theta, transformers 5 holds it in rope_parameters
    rotary = any(getattr(c, name, None) is not None
                 for name in ("rope_theta", "rope_parameters", "rotary_dim"))
    impl = opts.attn_implementation or "sdpa"  # transformers' default where a model has it
    scores = "always" if impl == "eager" else "cpu" if impl == "sdpa" and kv_heads < n_heads else ""
    shape = Shape(n_layers, d_model, n_heads, kv_heads, ffn, gated, c.vocab_size,
                  fused_loss=fuses_loss(model, opts.fused_loss), rotary=rotary, scores_kept=scores,
                  fused_under_tp=False,
                  rms_norm_tiles=any(type(m).__name__ in RMS_NORMS for m in model.modules()))
    return model, shape


def _first(config: Any, *names: str) -> int:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int):
            return value
    raise NotPlannable([f"model: the Hugging Face config ({type(config).__name__}) has none of "
                       f"{', '.join(names)}; the planner needs it to size activations"])


MODELS = {"mpt_causal_lm": (MPTOptions, _mpt_model), "hf_causal_lm": (HFCausalLMOptions, _hf_model)}


def build_meta(model_section: dict[str, Any]) -> tuple[nn.Module, Shape, Any]:
    """The run's model on the meta device, its shape facts and its parsed options (with
    ``peft_config`` and ``frozen_base``)."""
    name = model_section.get("name")
    if name not in MODELS:
        raise NotPlannable([f"model.name: the planner sizes {' and '.join(sorted(MODELS))}, not "
                           f"{name!r}; plan a plugin model as the hf_causal_lm of the same "
                           "shape (model.config: {model_type: llama, ...})"])
    cls, build = MODELS[name]
    opts = options_or_fields(cls, None, {k: v for k, v in model_section.items() if k != "name"},
                             f"the {name!r} model")
    model, shape = build(opts)
    return model, shape, opts


def take_census(model: nn.Module, shape: Shape) -> Census:
    """Count ``model``'s parameters by role (before LoRA is applied)."""
    seen: set[int] = set()
    total = largest = 0
    for p in model.parameters():  # tied weights once
        if id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
            largest = max(largest, p.numel())
    linears = linear_modules(model)
    blocks = _blocks(model, shape.n_layers)
    in_blocks = {id(m) for b in blocks for m in b.modules()}
    block_lin = {n: m for n, m in linears.items() if id(m) in in_blocks}
    # the models' own count of parameters used in matmuls (their flops_per_batch's N)
    counter = mpt_matmul_params if isinstance(model, MPTForCausalLM) else hf_matmul_params
    return Census(
        shape=shape,
        total=total,
        block_linear=sum(m.weight.numel() for m in block_lin.values()),
        largest_linear=max((m.weight.numel() for m in block_lin.values()), default=0),
        per_block=max((sum(p.numel() for p in b.parameters()) for b in blocks), default=0),
        linears={n: (m.out_features, m.in_features) for n, m in block_lin.items()},
        matmul=counter(model),
        largest_param=largest,
        vocab_params=_vocab_params(model, shape.vocab_size, in_blocks),
    )


def _vocab_params(model: nn.Module, vocab: int, in_blocks: set[int]) -> int:
    """Elements of the matrices outside the blocks with a vocabulary-sized dimension (the
    embedding and the output projection, a tied pair once): what tensor parallelism splits
    by vocabulary."""
    seen: set[int] = set()
    n = 0
    for m in model.modules():
        if id(m) in in_blocks:
            continue
        for p in m.parameters(recurse=False):
            if id(p) not in seen and p.dim() == 2 and vocab in p.shape:
                seen.add(id(p))
                n += p.numel()
    return n


def _blocks(model: nn.Module, n_layers: int) -> list[nn.Module]:
    """The repeated decoder blocks: the ModuleList of length n_layers."""
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) == n_layers:
            return list(m)
    raise NotPlannable([f"model: found no list of {n_layers} blocks in {type(model).__name__}; "
                       "the planner sizes decoder-only transformers"])
