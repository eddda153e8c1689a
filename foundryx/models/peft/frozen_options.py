"""``model.frozen_base``: how the frozen linear weights of a LoRA run are stored.

Declared once and used as a field of every model section that supports LoRA
(``mpt_causal_lm``, ``hf_causal_lm``); applied by
:func:`foundryx.models.peft.frozen_base.apply_frozen_base` after LoRA and before
parallelism. docs/finetuning.md says what each dtype does.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from foundryx.config.types import option

DTYPES = ("nf4", "fp8", "int8", "bf16")
PATH = "model.frozen_base"  # the section, in messages


def has_float8() -> bool:
    """Whether this torch has the FP8 e4m3 dtype ``frozen_base: {dtype: fp8}`` stores."""
    return getattr(torch, "float8_e4m3fn", None) is not None


@dataclass
class FrozenBaseOptions:
    """``frozen_base``: the storage of the frozen linear weights under LoRA (every linear
    layer but the output projection), dequantized layer by layer in the forward pass."""

    dtype: Literal["nf4", "fp8", "int8", "bf16"] = option(
        "nf4 (QLoRA's 4-bit NormalFloat, a scale per 64 weights; torchao's NF4Tensor), fp8 "
        "(e4m3, a scale per output row), int8 (a scale per output row) or bf16")
    offload_fraction: float = option(
        "share of the frozen linear layers whose weights stay in (pinned) CPU memory and are "
        "copied to the device when their layer runs, the next one prefetched", default=0.0,
        ge=0, le=1)
    fp8_gemm: Literal["auto", "tensor_cores", "cast"] = option(
        "where an fp8 base multiplies: auto: on FP8 tensor cores where the GPU has them "
        "(NVIDIA compute capability 8.9+, AMD gfx942/gfx950; one line says which), else cast "
        "to the compute dtype per layer; tensor_cores: row-wise scaled _scaled_mm on any "
        "device (a CPU: torch's where it has one, else emulated in float32); cast: "
        "dequantize per layer everywhere", default="auto")
    fp8_rows: Literal["auto", "torch", "kernel"] = option(
        "how fp8 tensor-core GEMMs quantize activations and gradients per row: auto: "
        "foundryx's one-pass Triton kernel on a GPU (checked once against the torch ops), "
        "torch ops elsewhere; torch: torch ops everywhere; kernel: the operator "
        "torch.ops.foundryx.fp8_quantize_rows on any device, unchecked", default="auto")

    def problems(self) -> list[str]:
        out = []
        if self.dtype == "fp8" and not has_float8():
            out.append(f"dtype: fp8 needs torch.float8_e4m3fn, which torch {torch.__version__} "
                       "does not have; use dtype: int8 (the same bytes, a scale per row) or a "
                       "newer torch")
        out += [f"{key}: {value} applies to dtype: fp8 (this base is {self.dtype}); remove it"
                for key, value in (("fp8_gemm", self.fp8_gemm), ("fp8_rows", self.fp8_rows))
                if value != "auto" and self.dtype != "fp8"]
        return out


def frozen_base_problems(peft_config: Any, frozen_base: FrozenBaseOptions | None) -> list[str]:
    """A model section's rule: a frozen base needs LoRA (without it every weight trains)."""
    if frozen_base is None or peft_config is not None:
        return []
    return ["frozen_base: applies to the frozen linear weights of a LoRA run, and without "
            "peft_config every weight trains; add peft_config (docs/finetuning.md) or remove "
            "frozen_base"]
