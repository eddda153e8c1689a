"""The fused RMS norm, SwiGLU and RoPE operators (``fused_ops``) put into a model from outside.

:func:`fuse_rms_norm` replaces one RMS norm module's forward (Hugging Face's LlamaRMSNorm and
its exact copies, ``tiling.RMS_NORMS``) by ``torch.ops.foundryx.rms_norm``;
:func:`fuse_swiglu` replaces one MLP's forward (LlamaMLP and its copies: ``down(act(gate(x)) *
up(x))`` with a SiLU) by ``down(swiglu(gate(x), up(x)))``, its projections (LoRA-adapted or
not) called as they were, in the same order (LoRA's dropout draws the same masks);
:func:`fuse_rope` replaces one LlamaAttention's forward by the same steps with
``torch.ops.foundryx.rope`` for ``apply_rotary_pos_emb`` (a call with a cache, in generation,
runs the module's own forward). Each is a change to one module instance: transformers'
classes, the modules' names, parameters and state dict are untouched, and a module of any
other kind keeps its forward (said in one line by :func:`apply_fused_ops`, which picks the
modules). ``fused_ops.nf4_dequantize`` sets each NF4 frozen layer (``frozen_base``'s
``LowPrecisionLinear`` of storage ``nf4``) to decode its weight with
``torch.ops.foundryx.nf4_dequantize`` (its ``nf4_op``: forward, recompute and backward alike);
under tensor parallelism too (each rank decodes its local part).

Where ``tiling`` applies too: a tiled MLP runs the fused forward a tile at a time (they
compose: the fusion comes first); a fused RMS norm is not tiled, as it already keeps only its
input and a float32 statistic per token for backward, never a float32 copy of its input.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from foundryx.config.schema import FusedOpsConfig
from foundryx.errors import ConfigError
from foundryx.kernels.rms_norm_op import rms_norm
from foundryx.kernels.rope_op import rope
from foundryx.kernels.swiglu_op import swiglu
from foundryx.parallel.tiling import RMS_NORMS

log = logging.getLogger(__name__)

# Hugging Face MLPs computing exactly ``down_proj(act_fn(gate_proj(x)) * up_proj(x))`` (checked
# against transformers 4.57's and 5's source; Phi-3's gate_up_proj is one projection, so not
# here); the activation must also be a SiLU (hidden_act silu / swish)
SWIGLU_MLPS = frozenset({"LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP"})
SILU = frozenset({"SiLU", "SiLUActivation"})
# Hugging Face attentions whose forward is q/k/v projections, ``apply_rotary_pos_emb``, the
# cache, the attention interface with (dropout, scaling) and o_proj, nothing else (transformers
# 4.57's and 5's LlamaAttention; Mistral and Qwen2 pass a sliding window, Qwen3 adds q/k norms)
ROPE_ATTENTIONS = frozenset({"LlamaAttention"})
CACHE_KWARGS = ("past_key_values", "past_key_value", "cache", "cache_position")
FUSED = "_foundryx_fused"  # the attribute a fused module carries: "rms_norm", "swiglu", "rope"
# foundryx's frozen low-precision linear layer (foundryx.models.peft.frozen_base, which this
# layer does not import): an NF4 one (storage "nf4") decodes by the operator when its nf4_op is
# set
NF4_LAYERS = frozenset({"LowPrecisionLinear"})


def fuse_rms_norm(module: nn.Module) -> None:
    """``module`` (one of ``RMS_NORMS``) computed by ``torch.ops.foundryx.rms_norm``."""
    inner = module.forward
    eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))

    @functools.wraps(inner)
    def forward(x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, module.weight, eps)

    module.forward = forward
    setattr(module, FUSED, "rms_norm")


def fuse_swiglu(module: nn.Module) -> None:
    """``module`` (one of ``SWIGLU_MLPS``, with a SiLU) with its product fused."""
    inner = module.forward

    @functools.wraps(inner)
    def forward(x: torch.Tensor) -> torch.Tensor:
        return module.down_proj(swiglu(module.gate_proj(x), module.up_proj(x)))

    module.forward = forward
    setattr(module, FUSED, "swiglu")


def fuse_rope(module: nn.Module) -> None:
    """``module`` (one of ``ROPE_ATTENTIONS``) with its queries' and keys' rotation by
    ``torch.ops.foundryx.rope``; a call with a cache (generation) runs the module's own
    forward."""
    import inspect  # the module's own eager attention: where its class is defined

    inner = module.forward
    eager = getattr(inspect.getmodule(type(module)), "eager_attention_forward", None)

    @functools.wraps(inner)
    def forward(hidden_states: torch.Tensor, position_embeddings: Any = None,
                attention_mask: torch.Tensor | None = None, *args: Any, **kwargs: Any) -> Any:
        if args or position_embeddings is None or any(
                kwargs.get(k) is not None for k in CACHE_KWARGS[:3]):
            return inner(hidden_states, position_embeddings, attention_mask, *args, **kwargs)
        kwargs = {k: v for k, v in kwargs.items() if k not in CACHE_KWARGS}
        shape = (*hidden_states.shape[:-1], -1, module.head_dim)
        q = module.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = module.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = module.v_proj(hidden_states).view(shape).transpose(1, 2)
        q, k = rope(q, k, *position_embeddings)
        impl = module.config._attn_implementation
        attend = eager if impl in (None, "eager") else _attention_functions()[impl]
        out, weights = attend(module, q, k, v, attention_mask,
                              dropout=module.attention_dropout if module.training else 0.0,
                              scaling=module.scaling, **kwargs)
        out = out.reshape(*hidden_states.shape[:-1], -1).contiguous()
        return module.o_proj(out), weights

    module.forward = forward
    setattr(module, FUSED, "rope")


def _attention_functions() -> Any:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS  # heavy: HF models only

    return ALL_ATTENTION_FUNCTIONS


def rope_problem(module: nn.Module) -> str | None:
    """Why ``module`` (an attention) cannot take :func:`fuse_rope`, or None."""
    name = type(module).__name__
    if name not in ROPE_ATTENTIONS:
        return f"{name} is not one of {', '.join(sorted(ROPE_ATTENTIONS))}"
    if not all(hasattr(module, a) for a in ("q_proj", "k_proj", "v_proj", "o_proj", "head_dim",
                                            "scaling", "config")):
        return f"{name} lacks Llama's projections"
    return None


def _candidates(block_list: list[nn.Module], suffix: str,
                problem: Any) -> tuple[list[nn.Module], set[str]]:
    """The blocks' modules whose class name ends in ``suffix``, not fused yet, that ``problem``
    (a module -> why it cannot be fused, or None) accepts, and the reasons of the others."""
    fit, other = [], set()
    for block in block_list:
        for m in block.modules():
            if not type(m).__name__.endswith(suffix) or getattr(m, FUSED, None):
                continue
            why = problem(m)
            if why is None:
                fit.append(m)
            else:
                other.add(why)
    return fit, other


def attention_candidates(block_list: list[nn.Module]) -> tuple[list[nn.Module], set[str]]:
    """The blocks' attentions (class names ending in ``Attention``) :func:`fuse_rope` takes,
    and why the others cannot."""
    return _candidates(block_list, "Attention", rope_problem)


def swiglu_problem(module: nn.Module) -> str | None:
    """Why ``module`` (an MLP) cannot take :func:`fuse_swiglu`, or None."""
    name = type(module).__name__
    if name not in SWIGLU_MLPS:
        return f"{name} is not one of {', '.join(sorted(SWIGLU_MLPS))}"
    act = type(getattr(module, "act_fn", None)).__name__
    if act not in SILU:
        return f"{name}'s activation is {act}, not SiLU"
    return None


def norm_candidates(model: nn.Module) -> tuple[list[nn.Module], set[str]]:
    """The model's RMS norms :func:`fuse_rms_norm` computes exactly, and the class names of the
    other modules named ``*RMSNorm`` (which keep their forward)."""
    fit, other = [], set()
    for m in model.modules():
        name = type(m).__name__
        if name in RMS_NORMS and not getattr(m, FUSED, None):
            fit.append(m)
        elif name.endswith("RMSNorm") and not getattr(m, FUSED, None):
            other.add(name)
    return fit, other


def mlp_candidates(block_list: list[nn.Module]) -> tuple[list[nn.Module], set[str]]:
    """The blocks' MLPs (class names ending in ``MLP``) :func:`fuse_swiglu` takes, and why
    the others cannot (one reason per class)."""
    return _candidates(block_list, "MLP", swiglu_problem)


def wanted(choice: bool | str, device: torch.device) -> bool:
    """``true``, or ``auto`` on a GPU (CUDA or ROCm)."""
    return choice is True or (choice == "auto" and device.type == "cuda")


def apply_fused_ops(model: nn.Module, block_list: list[nn.Module], cfg: FusedOpsConfig,
                    device: torch.device) -> list[str]:
    """``fused_ops`` on ``model``: returns summary phrases; each module kind that keeps the
    unfused path is said in one line (an unsupported family, tensor parallelism, or a kernel
    that failed its first check on this device)."""
    said = apply_nf4_dequantize(model, cfg.nf4_dequantize, device)
    if any(isinstance(p, DTensor) for p in model.parameters()):
        if wanted(cfg.rms_norm, device) or wanted(cfg.swiglu, device):
            log.info("fused_ops: off under tensor parallelism (its plan splits the norms and "
                     "MLPs, and the fused operators take whole tensors); the RMS norms and "
                     "SwiGLU MLPs keep the unfused path")
        return said
    jobs = (("rms_norm", "RMS norms", cfg.rms_norm, norm_candidates(model), fuse_rms_norm),
            ("swiglu", "SwiGLU MLPs", cfg.swiglu, mlp_candidates(block_list), fuse_swiglu),
            ("rope", "attentions' RoPE", cfg.rope, attention_candidates(block_list), fuse_rope))
    for key, what, choice, (fit, other), fuse in jobs:
        if not wanted(choice, device):
            continue
        if other:
            log.info("fused_ops.%s: %s keep%s the unfused path (foundryx fuses only the "
                     "modules it has checked)", key, "; ".join(sorted(other)),
                     "s" if len(other) == 1 else "")
        if choice is True and not fit and not other:
            raise ConfigError([f"fused_ops.{key}: true, but the model has no module of a kind "
                               f"foundryx fuses ({', '.join(sorted(_kinds(key)))}); set "
                               f"fused_ops.{key}: auto or false"])
        if not fit:
            continue
        problem = kernel_problem(key, device)
        if problem:
            log.info("fused_ops.%s: the kernel failed its first check on %s (%s); the %s keep "
                     "the unfused path", key, device, problem, what)
            continue
        for m in fit:
            fuse(m)
        said.append(f"{len(fit)} {what} fused")
    return said


def nf4_candidates(model: nn.Module) -> list[nn.Module]:
    """The model's NF4 frozen layers (see NF4_LAYERS) not set to the operator yet."""
    return [m for m in model.modules() if type(m).__name__ in NF4_LAYERS
            and getattr(m, "storage", None) == "nf4" and not getattr(m, "nf4_op", True)]


def apply_nf4_dequantize(model: nn.Module, choice: bool | str,
                         device: torch.device) -> list[str]:
    """``fused_ops.nf4_dequantize`` (``choice``) on ``model``'s NF4 frozen layers: returns
    summary phrases; a kernel that fails its first check on ``device`` keeps the torch ops,
    said in one line. A weight the operator cannot decode (a dtype or layout the kernel
    lacks) is said when it first runs (foundryx.models.peft.frozen_base.nf4_fused)."""
    if not wanted(choice, device):
        return []
    fit = nf4_candidates(model)
    if choice is True and not fit:
        raise ConfigError(["fused_ops.nf4_dequantize: true, but the model has no NF4 frozen "
                           "base (model.frozen_base.dtype: nf4); set fused_ops.nf4_dequantize: "
                           "auto or false"])
    if not fit:
        return []
    problem = kernel_problem("nf4_dequantize", device)
    if problem:
        log.info("fused_ops.nf4_dequantize: the kernel failed its first check on %s (%s); the "
                 "NF4 layers keep decoding by torch ops", device, problem)
        return []
    for m in fit:
        m.nf4_op = True
    return [f"{len(fit)} NF4 layers decoded by one kernel"]


def _kinds(key: str) -> frozenset[str]:
    return {"rms_norm": RMS_NORMS, "swiglu": SWIGLU_MLPS, "rope": ROPE_ATTENTIONS}[key]


def kernel_problem(key: str, device: torch.device) -> str | None:
    """On a GPU, why the kernel of ``key`` cannot serve (it fails to compile or run, or
    differs from the torch reference on a small input), or None; elsewhere None (the
    operator runs its torch reference)."""
    if device.type != "cuda":
        return None
    from foundryx.kernels import checks  # the first call compiles the kernels (Triton)

    return checks.first_call_problem(key, device)
