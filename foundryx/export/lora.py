"""Export of a LoRA run: a PEFT adapter folder, or the base with the adapters merged.

The adapter folder (``adapter_config.json``, ``adapter_model.safetensors``) is what
``peft.PeftModel.from_pretrained(base, folder)`` loads, on the Hugging Face base the export
format gives: ``hf_causal_lm``'s own pretrained folder; for an MPT, its export as Llama
(``llama``) or as ``foundryx_mpt`` (``mpt``). For the Llama export the fused ``Wqkv``'s
adapter becomes three: q_proj, k_proj, v_proj share its ``lora_A`` and each takes its rows of
``lora_B`` (``B A x`` split by rows is exactly ``B_q A x``, ``B_k A x``, ``B_v A x``).

``--merged`` folds each adapter into its frozen weight (``W + scale B A``, PEFT's merge) and
writes the plain model as an ordinary export.
"""

from __future__ import annotations

import logging
import math
import re
from pathlib import Path
from typing import Any

import torch
from torch import nn

from foundryx.checkpoint.metadata import save_tokenizer
from foundryx.errors import ExportError
from foundryx.export.writer import write_atomically
from foundryx.models.mpt.configuration import MPTConfig
from foundryx.models.peft.adapters import (
    ADAPTER,
    is_adapter_key,
    peft_config_dict,
    to_peft_key,
    write_adapter_folder,
)
from foundryx.models.peft.fused import FusedLoraLinear
from foundryx.models.peft.options import LoraOptions

log = logging.getLogger(__name__)

_LORA = re.compile(r"^(?P<layer>.+)\.(?P<ab>lora_[AB])\." + ADAPTER + r"\.weight$")
# MPT layer name (regex) -> Llama layer name; Wqkv is split separately.
_LLAMA_LAYERS = [
    (r"^transformer\.blocks\.(\d+)\.attn\.out_proj$", r"model.layers.\1.self_attn.o_proj"),
    (r"^transformer\.blocks\.(\d+)\.ffn\.(gate|up|down)_proj$", r"model.layers.\1.mlp.\2_proj"),
]
_WQKV = re.compile(r"^transformer\.blocks\.(\d+)\.attn\.Wqkv$")
# MPT's logical q/k/v targets: one adapter pair per slice of the fused Wqkv (FusedLoraLinear)
_SLICE = re.compile(r"^(?P<layer>.+\.Wqkv)\.(?P<ab>lora_[AB])\.(?P<slice>[qkv])\.weight$")


def adapter_weights(model: nn.Module | dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``{inner-model name: tensor}`` of the LoRA weights of a Hugging Face model (or of its
    state dict); ExportError for adapters that are not PEFT's plain LoRA layers."""
    state = model if isinstance(model, dict) else model.state_dict()
    out = {k: v for k, v in state.items() if is_adapter_key(k)}
    odd = [k for k in out if not (_LORA.match(k) or _SLICE.match(k))]
    if odd:
        raise ExportError(f"{odd[0]}: not a LoRA weight foundryx can export "
                          f"(<layer>.lora_A.{ADAPTER}.weight, or an MPT Wqkv slice's "
                          "<layer>.Wqkv.lora_A.<q|k|v>.weight); export with --merged")
    return out


def to_llama(cfg: MPTConfig, weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An MPT's adapter weights under LlamaForCausalLM's layer names (Wqkv split)."""
    d, kv = cfg.d_model, cfg.kv_n_heads * cfg.head_dim
    out: dict[str, torch.Tensor] = {}
    for key, tensor in weights.items():
        sliced = _SLICE.match(key)
        if sliced:  # a q/k/v slice's own adapter is exactly that projection's adapter
            i = _WQKV.match(sliced.group("layer")).group(1)
            proj = f"model.layers.{i}.self_attn.{sliced.group('slice')}_proj"
            out[f"{proj}.{sliced.group('ab')}.{ADAPTER}.weight"] = tensor
            continue
        m = _LORA.match(key)
        layer, ab = m.group("layer"), m.group("ab")
        qkv = _WQKV.match(layer)
        if qkv:
            prefix = f"model.layers.{qkv.group(1)}.self_attn"
            parts = ((tensor,) * 3 if ab == "lora_A" else tensor.split((d, kv, kv), dim=0))
            for proj, part in zip(("q_proj", "k_proj", "v_proj"), parts):
                out[f"{prefix}.{proj}.{ab}.{ADAPTER}.weight"] = part.clone()
            continue
        for pattern, repl in _LLAMA_LAYERS:
            new, n = re.subn(pattern, repl, layer)
            if n:
                out[f"{new}.{ab}.{ADAPTER}.weight"] = tensor
                break
        else:
            raise ExportError(f"{layer}: no Llama layer for this MPT adapter; export with "
                              "--format mpt (or --merged)")
    return out


def targets_of(weights: dict[str, torch.Tensor]) -> list[str]:
    return sorted({(_LORA.match(k) or _SLICE.match(k)).group("layer").rsplit(".", 1)[-1]
                   for k in weights})


def options_of(model: nn.Module) -> LoraOptions:
    """The LoRA options of a model with injected PEFT LoRA layers, read from its layers."""
    from peft.tuners.lora import LoraLayer  # a heavy optional import, used only here

    layers = {name.rsplit(".", 1)[-1]: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    if not layers:
        raise ExportError("the model has no PEFT LoRA layers to export")
    layer = next(iter(layers.values()))
    r, alpha = layer.r[ADAPTER], layer.lora_alpha[ADAPTER]
    dropout = layer.lora_dropout[ADAPTER]
    return LoraOptions(target_modules=sorted(layers), r=r, lora_alpha=alpha,
                       lora_dropout=dropout.p if isinstance(dropout, nn.Dropout) else 0.0,
                       use_rslora=not math.isclose(layer.scaling[ADAPTER], alpha / r))


def write_adapter(model: nn.Module, options: LoraOptions, tokenizer: Any, out: str | Path, *,
                  fmt: str, base: str | None, dtype: torch.dtype | None = None,
                  overwrite: bool = False, source: str = "",
                  weights: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the adapters of ``model`` (a Hugging Face model with injected LoRA layers; or
    ``weights``, its gathered state dict, with ``model`` giving the config) as a PEFT adapter
    folder ``out`` for the base of export format ``fmt``."""
    weights = adapter_weights(model if weights is None else weights)
    if fmt == "llama":
        weights = to_llama(model.config, weights)
    elif any(_SLICE.match(k) for k in weights):
        raise ExportError("MPT's q/k/v slice adapters have PEFT names only on the Llama export of "
                          "the base (q_proj, k_proj, v_proj): export with --format llama, or "
                          "--merged for the model with the adapters folded in")
    tensors = {to_peft_key(k): v.detach().to("cpu", dtype or v.dtype) for k, v in weights.items()}
    config = peft_config_dict(options, targets_of(weights), base)

    def fill(tmp: Path) -> None:
        write_adapter_folder(tmp, tensors, config)
        if tokenizer is not None and hasattr(tokenizer, "save_pretrained"):
            save_tokenizer(tokenizer, tmp)  # model_input_names without token_type_ids

    out = write_atomically(out, fill, overwrite)
    kind = {"llama": "a Llama", "mpt": "a foundryx_mpt"}.get(fmt, "its Hugging Face")
    log.info("exported the LoRA adapter of %s (%d weights, for %s base%s) to %s",
             source or "the model", len(tensors), kind, f" {base}" if base else "", out)
    return out


def merge_adapters(model: nn.Module) -> nn.Module:
    """Fold every LoRA layer of ``model`` into its frozen linear layer and put that layer back
    in its place (in place; returns ``model``, now a plain Hugging Face model)."""
    from peft.tuners.lora import LoraLayer  # a heavy optional import, used only here

    layers = [(name, m) for name, m in model.named_modules()
              if isinstance(m, (LoraLayer, FusedLoraLinear))]
    for name, layer in layers:
        # merged in float64, rounded once to the weight's dtype: in fp32, W + BA alone would
        # round differently from the trained model's W x + B (A x) by more than the export's
        # promise (logits within 1e-5) once adapters are large
        dtype = next(layer.parameters()).dtype
        with torch.no_grad():
            layer.to(torch.float64)
            if isinstance(layer, FusedLoraLinear):
                base = layer.merge()
            else:
                layer.merge()
                base = layer.get_base_layer()
            base.to(dtype)
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, base)
    left = [n for n, _ in model.named_parameters() if is_adapter_key(n)]
    if left:
        raise ExportError(f"{left[0]}: cannot merge this adapter (not a PEFT LoRA layer)")
    log.info("merged %d LoRA adapters into their base weights", len(layers))
    return model
