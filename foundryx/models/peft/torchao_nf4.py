"""torchao's NF4 tensor, wherever the installed torchao keeps it (``torchao.dtypes.nf4tensor``
up to 0.17, ``torchao.quantization`` from 0.18), and the one way foundryx builds one from its
parts: :func:`nf4_from_parts`. Import it inside the function that needs it: torchao is a heavy
import.

torchao's public API quantizes a dense tensor (``to_nf4``); it has no constructor from parts,
which shard-on-read loading (codes computed a row range at a time), tensor parallelism's cuts
and the offload's gathers need. :func:`nf4_from_parts` goes through the tensor-subclass protocol
(``__tensor_flatten__`` / ``__tensor_unflatten__``, which FSDP2 and torch.compile rebuild NF4
tensors with, so torchao keeps it working): the metadata is that of a tensor ``to_nf4`` made,
with the shape and block count changed. ``tests/test_nf4_cpu.py`` rebuilds ``to_nf4``'s own
tensors this way, bit for bit, on each leg's torchao: a torchao that changes the protocol fails
there, not silently in a run.
"""

from __future__ import annotations

import functools
import importlib

try:  # torchao < 0.18
    _nf4 = importlib.import_module("torchao.dtypes.nf4tensor")
except ImportError:  # torchao >= 0.18: public name in torchao.quantization, helpers beside it
    import torchao.quantization

    _nf4 = importlib.import_module(torchao.quantization.NF4Tensor.__module__)

import torch

NF4Tensor = _nf4.NF4Tensor
to_nf4 = _nf4.to_nf4
get_block_absmax = _nf4.get_block_absmax


def nf4_from_parts(cls: type, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, *,
                   block_size: int, scaler_block_size: int, quantized_data: torch.Tensor,
                   quantized_scalers: torch.Tensor, quantization_factor: torch.Tensor,
                   scaler_mean: torch.Tensor, nf4: torch.Tensor) -> NF4Tensor:
    """An NF4 tensor of class ``cls`` (``NF4Tensor``, or a subclass of it that adds methods but
    no state) and logical ``shape`` (contiguous) and ``dtype`` on ``device``, holding the given
    parts (see the module's docstring)."""
    ctx = _template_metadata(dtype, block_size, scaler_block_size)
    size = torch.Size(shape)
    stride = torch.empty(size, device="meta").stride()
    meta = type(ctx["tensor_meta"])(size, stride, 0, dtype, device, False)
    ctx = {**ctx, "tensor_meta": meta, "n_blocks": quantized_scalers.numel()}
    inner = {"quantized_data": quantized_data, "scaler_mean": scaler_mean,
             "quantization_factor": quantization_factor, "quantized_scalers": quantized_scalers,
             "nf4": nf4}
    out = NF4Tensor.__tensor_unflatten__(inner, ctx, size, stride)
    if cls is not NF4Tensor:  # a subclass adding behaviour, no state: the fresh tensor becomes one
        out.__class__ = cls
    return out


@functools.cache
def _template_metadata(dtype: torch.dtype, block_size: int, scaler_block_size: int) -> dict:
    """The flatten metadata of a small tensor ``to_nf4`` made with these block sizes."""
    template = to_nf4(torch.ones(block_size * scaler_block_size, dtype=dtype), block_size,
                      scaler_block_size)
    return template.__tensor_flatten__()[1]


def nf4_parts(t: NF4Tensor) -> dict[str, torch.Tensor]:
    """The parts of ``t`` as :func:`nf4_from_parts` takes them."""
    names, _ = t.__tensor_flatten__()
    return {n: getattr(t, n) for n in names}


__all__ = ["NF4Tensor", "get_block_absmax", "nf4_from_parts", "nf4_parts", "to_nf4"]
