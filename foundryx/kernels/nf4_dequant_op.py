"""``torch.ops.foundryx.nf4_dequantize``: a frozen NF4 weight decoded to a dense one as one torch
operator.

A custom operator (``torch.library.custom_op``) so that what looks at a step op by op sees one
op where a GPU runs one kernel: FakeTensorMode and torch's memory tracker (its fake
implementation: the output, nothing else), benchmarks/op_census.py (priced at the parts read
and the output written: about 2.5 bytes a weight into bfloat16, where the torch ops move about
18) and ``torch.compile`` (which keeps it whole). On a GPU (CUDA or ROCm) it runs
:mod:`foundryx.kernels.nf4_dequant`'s Triton kernel; on any other device
:func:`nf4_dequantize_eager`, torchao's arithmetic (``NF4Tensor.get_original_weight().to(dtype)``)
a chunk of blocks at a time, which the kernel reproduces bit for bit (tests/test_nf4_dequant.py).

The operator takes the NF4 tensor's parts (torchao's ``quantized_data``, ``quantized_scalers``,
``quantization_factor``, ``scaler_mean`` and ``nf4``), not the tensor subclass, and returns the
weight flat; :func:`foundryx.models.peft.frozen_base.dequantize` calls it where the frozen layer
is set to (``fused_ops.nf4_dequantize``).
"""

from __future__ import annotations

from types import MappingProxyType

import torch

# dtypes the kernel computes in (the NF4 tensor's) and writes, each as the kernel's constant
KINDS = MappingProxyType({torch.float32: 0, torch.bfloat16: 1, torch.float16: 2})

# Blocks decoded at a time by the torch ops. Each chunk costs about ten kernels and a transient
# of about 15 bytes per weight. On a CPU a kernel costs little: small chunks keep the transient
# at a few MB. On a GPU each launch costs microseconds: with the CPU's chunks an 8B model's NF4
# step ran 12 s instead of 1.4 s (the first H100 run, benchmarks/RESULTS.md), so there a chunk
# is 2^24 weights (at most 4 per layer of an 8B model; about 140 MB). A constant (read-only).
CHUNK_BLOCKS = MappingProxyType({"cpu": 4096, "gpu": (1 << 24) // 64})


def scalers_eager(scalers: torch.Tensor, factors: torch.Tensor, mean: torch.Tensor,
                  scaler_block_size: int, dtype: torch.dtype) -> torch.Tensor:
    """Each block's absmax in the NF4 dtype ``dtype``, as torchao's ``dequantize_scalers``:
    ``(scaler / factor).to(dtype) + mean``."""
    per_group = scalers.view(-1, scaler_block_size)
    return (per_group / factors.unsqueeze(-1)).flatten().to(dtype) + mean


def nf4_dequantize_eager(data: torch.Tensor, scalers: torch.Tensor, factors: torch.Tensor,
                         mean: torch.Tensor, levels: torch.Tensor, block_size: int,
                         scaler_block_size: int, dtype: torch.dtype,
                         chunk: int = 0) -> torch.Tensor:
    """torchao's NF4 dequantization (``get_original_weight().to(dtype)``, the same values bit
    for bit), flat, written into one preallocated ``dtype`` tensor ``chunk`` blocks at a time
    (0: :data:`CHUNK_BLOCKS` of the device). torchao's decodes the whole weight at once through
    int64 indices and several full-size intermediates: about 5x a float32 copy of the weight
    at its peak."""
    blocks = scalers.numel()
    step = chunk or CHUNK_BLOCKS["cpu" if data.device.type == "cpu" else "gpu"]
    scale_all = scalers_eager(scalers, factors, mean, scaler_block_size, levels.dtype)
    packed = data.view(blocks, block_size // 2)  # two codes a byte, the first in the high half
    out = torch.empty(blocks, block_size // 2, 2, dtype=dtype, device=data.device)
    for start in range(0, blocks, step):
        codes = packed[start:start + step]
        scale = scale_all[start:start + step, None]
        out[start:start + step, :, 0] = levels[(codes >> 4).long()] * scale
        out[start:start + step, :, 1] = levels[(codes & 0b1111).long()] * scale
    return out.view(-1)


def problem(data: torch.Tensor, scalers: torch.Tensor, factors: torch.Tensor,
            mean: torch.Tensor, levels: torch.Tensor, block_size: int, scaler_block_size: int,
            dtype: torch.dtype) -> str | None:
    """Why the operator cannot decode these parts into ``dtype`` (a sentence), or None: the
    kernel's dtypes (float32, bfloat16, float16: the NF4 dtype and the output), torchao's
    layout (uint8 codes, int8 scalers, contiguous parts whose sizes agree), an even block."""
    names = ", ".join(str(d).removeprefix("torch.") for d in KINDS)
    if dtype not in KINDS:
        return f"output dtype {dtype} is not one of {names}"
    if levels.dtype not in KINDS or not (factors.dtype == mean.dtype == levels.dtype):
        return (f"the NF4 dtype (levels {levels.dtype}, factors {factors.dtype}, mean "
                f"{mean.dtype}) is not one of {names} throughout")
    if data.dtype != torch.uint8 or scalers.dtype != torch.int8:
        return f"codes {data.dtype} and scalers {scalers.dtype}, not uint8 and int8"
    if block_size < 2 or block_size % 2 or scaler_block_size < 1:
        return f"block size {block_size} (scaler block {scaler_block_size}) is not even"
    if (levels.numel() != 16 or mean.numel() != 1
            or scalers.numel() * block_size != 2 * data.numel()
            or scalers.numel() != factors.numel() * scaler_block_size):
        return (f"the parts' sizes do not agree ({data.numel()} bytes, {scalers.numel()} "
                f"scalers, {factors.numel()} factors, {levels.numel()} levels)")
    if not all(t.is_contiguous() for t in (data, scalers, factors, levels)):
        return "a part is not contiguous"
    return None


@torch.library.custom_op("foundryx::nf4_dequantize", mutates_args=())
def nf4_dequantize(data: torch.Tensor, scalers: torch.Tensor, factors: torch.Tensor,
                   mean: torch.Tensor, levels: torch.Tensor, block_size: int,
                   scaler_block_size: int, dtype: torch.dtype, chunk: int) -> torch.Tensor:
    """:func:`nf4_dequantize_eager` on a device without the kernel."""
    return nf4_dequantize_eager(data, scalers, factors, mean, levels, block_size,
                                scaler_block_size, dtype, chunk)


@nf4_dequantize.register_kernel("cuda")
def _on_a_gpu(data: torch.Tensor, scalers: torch.Tensor, factors: torch.Tensor,
              mean: torch.Tensor, levels: torch.Tensor, block_size: int,
              scaler_block_size: int, dtype: torch.dtype, chunk: int) -> torch.Tensor:
    from foundryx.kernels import nf4_dequant  # Triton (heavy): imported on a GPU's first call

    return nf4_dequant.dequantize(data, scalers, factors, mean, levels, block_size,
                                  scaler_block_size, dtype)


@nf4_dequantize.register_fake
def _fake(data: torch.Tensor, scalers: torch.Tensor, factors: torch.Tensor,
          mean: torch.Tensor, levels: torch.Tensor, block_size: int, scaler_block_size: int,
          dtype: torch.dtype, chunk: int) -> torch.Tensor:
    return torch.empty(2 * data.numel(), dtype=dtype, device=data.device)
