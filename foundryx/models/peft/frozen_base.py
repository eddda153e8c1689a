"""Low-precision frozen base weights for LoRA (``model.frozen_base``), applied from outside.

After LoRA is injected, every frozen linear layer (PEFT's ``base_layer`` of each adapted layer
and any linear layer LoRA does not target; never the output projection) becomes a
:class:`LowPrecisionLinear` whose ``weight`` is a frozen parameter in the chosen storage:

- ``nf4``: torchao's ``NF4Tensor`` (QLoRA's 4-bit NormalFloat, a scale per 64 weights, the
  scales themselves quantized); it carries FSDP2's all-gather hooks.
- ``fp8`` / ``int8``: :class:`~foundryx.models.peft.rowwise.RowScaledTensor` (a scale per
  output row), ours, with the same hooks.
- ``bf16``: the same subclass holding bfloat16 rows (scales of 1), so that the unit keeps one
  original dtype (torch 2.7's FSDP2 refuses a bf16 base beside fp32 adapters) and the mixed
  precision policy does not upcast it before the all-gather.

FSDP2 shards and all-gathers these parameters as they are, so the low-precision bytes are
what each rank stores and what moves. The layer dequantizes its weight to the input's dtype
in the forward pass and again in the backward pass (nothing dense is kept between them), so
LoRA trains in the precision of the run (fp32, or bf16 under autocast).

``offload_fraction`` keeps that share of the layers' weights out of the model's parameters in
host memory, applied from outside by the builder (:mod:`foundryx.parallel.offload`, which sets
the layer's ``offload``; the layer only reads its weight through it), sharded: each of N ranks
holds its 1/N of the rows (``offload_rows``), in the low-precision storage, and all of a rank's
offloaded shards live in one exact-size host buffer (pinned with ``cudaHostRegister`` when
there is a GPU: per-tensor ``pin_memory()`` rounds every allocation up to a power of two,
pytorch#150517). When a layer runs, forward and backward, its shard is copied to the device and
all-gathered there in its low precision, and the whole weight is dropped after use; while one
runs, the copy of the next offloaded layer's shard is started. Offloaded weights are not in the
model's state dict (a LoRA checkpoint holds only the adapters).
"""

from __future__ import annotations

import functools
import logging
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import (
    DTensor,  # a tensor-parallel weight keeps its placement when dequantized
)

from foundryx.errors import ConfigError
from foundryx.kernels import nf4_dequant_op
from foundryx.models.peft import fp8_gemm
from foundryx.models.peft.frozen_options import PATH, FrozenBaseOptions
from foundryx.models.peft.lora import inner_model, linear_modules
from foundryx.models.peft.parts import checked_nf4_part, index_rows
from foundryx.models.peft.rowwise import RowScaledTensor

log = logging.getLogger(__name__)

NF4_BLOCK = 64  # QLoRA's block of weights per scale
NF4_SCALER_BLOCKS = (256, 128, 64, 32, 16, 8, 4, 2, 1)  # QLoRA's is 256


def _nf4_tensor_type() -> type:
    from foundryx.models.peft.torchao_nf4 import (
        NF4Tensor,  # torchao is a heavy import, needed only here
    )

    return NF4Tensor


def dequantize(weight: torch.Tensor, dtype: torch.dtype, nf4_chunk: int | None = None,
               nf4_op: bool = False) -> torch.Tensor:
    """A dense ``dtype`` copy of a frozen weight in any of the ``frozen_base`` storages,
    allocating little more than that copy (NF4: ``nf4_op``, the operator
    ``torch.ops.foundryx.nf4_dequantize`` (one kernel on a GPU, ``fused_ops.nf4_dequantize``),
    else torch ops ``nf4_chunk`` blocks at a time, None: the weight's device's,
    :data:`NF4_CHUNK_BLOCKS`). A tensor-parallel weight (a DTensor) is dequantized in its
    local part and stays a DTensor with the same placement."""
    if isinstance(weight, DTensor):
        return DTensor.from_local(dequantize(weight.to_local(), dtype, nf4_chunk, nf4_op),
                                  weight.device_mesh, weight.placements, run_check=False,
                                  shape=weight.shape, stride=weight.stride())
    if isinstance(weight, RowScaledTensor):
        return weight.dequantize(dtype)
    if hasattr(weight, "quantized_scalers") and weight.is_contiguous():  # torchao's NF4Tensor
        if nf4_op:
            return nf4_fused(weight, dtype, nf4_chunk)
        return nf4_dense(weight, dtype, nf4_chunk)
    return weight.to(dtype)  # NF4Tensor dequantizes on .to(dtype); bf16 casts


# Blocks of 64 weights decoded at a time by nf4_dense (the torch ops; see the constant's module)
NF4_CHUNK_BLOCKS = nf4_dequant_op.CHUNK_BLOCKS


def _nf4_args(weight: torch.Tensor) -> tuple:
    """The parts of an NF4 weight as ``torch.ops.foundryx.nf4_dequantize`` takes them."""
    return (weight.quantized_data, weight.quantized_scalers, weight.quantization_factor,
            weight.scaler_mean, weight.nf4, weight.block_size, weight.scaler_block_size)


def nf4_dense(weight: torch.Tensor, dtype: torch.dtype, chunk: int | None = None) -> torch.Tensor:
    """torchao's NF4 dequantization (``NF4Tensor.get_original_weight().to(dtype)``, the same
    values bit for bit) by torch ops, ``chunk`` blocks at a time (None: NF4_CHUNK_BLOCKS of the
    weight's device): :func:`foundryx.kernels.nf4_dequant_op.nf4_dequantize_eager`."""
    flat = nf4_dequant_op.nf4_dequantize_eager(*_nf4_args(weight), dtype, chunk or 0)
    return flat.view(weight.shape)


def nf4_fused(weight: torch.Tensor, dtype: torch.dtype, chunk: int | None = None) -> torch.Tensor:
    """The same values as :func:`nf4_dense` by the operator ``torch.ops.foundryx.nf4_dequantize``
    (one Triton kernel on a GPU, the same torch ops elsewhere); parts it cannot decode
    (:func:`foundryx.kernels.nf4_dequant_op.problem`) take :func:`nf4_dense`, said once in one
    line per reason."""
    args = _nf4_args(weight)
    why = nf4_dequant_op.problem(*args, dtype)
    if why is None and weight.nf4.dtype != weight.dtype:
        why = f"its levels are {weight.nf4.dtype}, the tensor {weight.dtype}"
    if why is not None:
        _say_unfused(why)
        return nf4_dense(weight, dtype, chunk)
    return torch.ops.foundryx.nf4_dequantize(*args, dtype, chunk or 0).view(weight.shape)


@functools.cache
def _say_unfused(why: str) -> None:
    log.info("fused_ops.nf4_dequantize: an NF4 weight is decoded by torch ops, not the fused "
             "operator: %s", why)


def stored_bytes(weight: torch.Tensor) -> int:
    """Bytes a (local shard of a) frozen weight really holds: a DTensor's local tensor, the
    inner tensors of a low-precision subclass."""
    local = getattr(weight, "_local_tensor", weight)
    if hasattr(local, "__tensor_flatten__"):
        names, _ = local.__tensor_flatten__()
        return sum(stored_bytes(getattr(local, n)) for n in names)
    return local.numel() * local.element_size()


def to_nf4(weight: torch.Tensor, name: str, tp: int = 1, world: int = 1) -> torch.Tensor:
    """torchao's NF4 with 64-weight blocks and the largest scaler block (QLoRA's 256, or
    smaller for a small layer) that lets FSDP2 split the layer evenly over the ``world`` ranks; under
    tensor parallelism (``tp`` > 1) also one that makes each rank's columns of a row whole
    groups of scalers, so that TP's row and column parts are NF4 tensors of their own
    (:mod:`foundryx.models.peft.parts`)."""
    from foundryx.models.peft.torchao_nf4 import to_nf4 as torchao_to_nf4  # heavy import, only here

    blocks, rem = divmod(weight.numel(), NF4_BLOCK)

    def fits(s: int) -> bool:
        return (not rem and blocks % (s * world) == 0
                and (tp == 1 or weight.shape[1] % (NF4_BLOCK * s * tp) == 0))

    scaler = next((s for s in NF4_SCALER_BLOCKS if fits(s)), None)
    if tp > 1 and (scaler is None or weight.shape[0] % world):
        raise ConfigError([
            f"{PATH}.dtype: nf4 under parallelism.tp: {tp} needs each frozen linear weight's "
            f"columns to be a multiple of {NF4_BLOCK} x {tp} (tp), so that each rank's columns "
            f"are whole NF4 blocks, and its rows a multiple of {world} (ranks); {name!r} is "
            f"{tuple(weight.shape)}; use dtype: int8 or fp8 (any shape), or tp: 1"])
    if scaler is None or weight.shape[0] % world:
        raise ConfigError([
            f"{PATH}.dtype: nf4 needs each frozen linear weight's size to be a multiple of "
            f"{NF4_BLOCK} x {world} (ranks) and its rows of {world}; {name!r} is "
            f"{tuple(weight.shape)}; use dtype: int8 or fp8 (any shape), or leave that layer "
            "unsharded"])
    return torchao_to_nf4(weight.detach().contiguous(), NF4_BLOCK, scaler)


def to_storage(weight: torch.Tensor, dtype: str, name: str, tp: int = 1,
               world: int = 1) -> torch.Tensor:
    if dtype == "nf4":
        return to_nf4(weight, name, tp, world)
    return RowScaledTensor.from_weight(weight, dtype)  # fp8, int8 and bf16


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype ``F.linear(x, ...)`` returns here: autocast's, else ``x``'s."""
    kind = x.device.type
    if torch.is_autocast_enabled(kind):
        return torch.get_autocast_dtype(kind)
    return x.dtype


class _FrozenLinearFn(torch.autograd.Function):
    """``x @ W^T + b`` with ``W`` dequantized in forward and again in backward, so no dense
    copy of ``W`` stays alive for backward; ``W`` and ``b`` are frozen (no gradients). An FP8
    weight on FP8 tensor cores (``layer.fp8_gemm``) is not dequantized: both GEMMs run in FP8
    (:mod:`foundryx.models.peft.fp8_gemm`)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: LowPrecisionLinear) -> torch.Tensor:  # noqa: ANN001
        ctx.layer, ctx.x_dtype = layer, x.dtype
        w = layer.stored_weight(x.device)
        ctx.fp8 = layer.fp8_gemm is not None and isinstance(w, RowScaledTensor)
        if not ctx.fp8:  # a tensor-parallel weight (a DTensor) is dequantized too
            # straight to the dtype the product runs in: under autocast a float32 input (a
            # float32 norm's output) would have the weight dequantized to float32 and then
            # cast again to bf16 by autocast (two weight-sized copies a call; the op census)
            dtype = _compute_dtype(x)
            bias = None if layer.bias is None else layer.bias.to(dtype)
            return F.linear(x, dequantize(w, dtype, layer.nf4_chunk, layer.nf4_op), bias)
        y = fp8_gemm.linear(x, w.qdata, w.scale, layer.fp8_gemm, _compute_dtype(x),
                            op=layer.fp8_quantize_op)
        return y if layer.bias is None else y + layer.bias.to(y.dtype)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        if not ctx.needs_input_grad[0]:  # e.g. the first layer: its input needs no gradient
            return None, None
        w = ctx.layer.stored_weight(grad.device, backward=True)
        if ctx.fp8:
            return fp8_gemm.input_grad(grad, w.qdata, w.scale, ctx.layer.fp8_gemm,
                                       ctx.x_dtype, op=ctx.layer.fp8_quantize_op), None
        return grad @ dequantize(w, grad.dtype, ctx.layer.nf4_chunk, ctx.layer.nf4_op), None


class WeightSource(Protocol):
    """Where an offloaded layer's weight comes from (``foundryx.parallel.offload.Offloaded``):
    the whole weight on ``device`` when the layer runs; ``host``: what stays in host memory."""

    host: torch.Tensor

    def take(self, device: torch.device, backward: bool = False) -> torch.Tensor: ...


class LowPrecisionLinear(nn.Module):
    """A frozen linear layer whose weight is stored in ``frozen_base``'s dtype (or, offloaded,
    in host memory) and dequantized when it runs."""

    def __init__(self, linear: nn.Linear, dtype: str, name: str, tp: int = 1,
                 world: int = 1) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.storage, self.name = dtype, name
        self.weight = nn.Parameter(to_storage(linear.weight, dtype, name, tp, world),
                                   requires_grad=False)
        self.bias = (None if linear.bias is None
                     else nn.Parameter(linear.bias.detach().clone(), requires_grad=False))
        self.offload: WeightSource | None = None  # set from outside: foundryx.parallel.offload
        # the float8 dtype of this layer's FP8 GEMMs, None: dequantized (fp8_gemm.choose)
        self.fp8_gemm: torch.dtype | None = None
        self.fp8_quantize_op = False  # its rows quantized by one kernel (fp8_gemm.quantize)
        self.nf4_chunk: int | None = None  # NF4 blocks decoded at a time; None: the device's
        # NF4 decoded by torch.ops.foundryx.nf4_dequantize (fused_ops.nf4_dequantize, set from
        # outside: foundryx.parallel.fused_ops), else by torch ops
        self.nf4_op = False
        if hasattr(linear, "_fused"):  # a fused layer's part sizes (LoRA slices, TP's row order)
            self._fused = linear._fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FrozenLinearFn.apply(x, self)

    def stored_weight(self, device: torch.device, backward: bool = False) -> torch.Tensor:
        """The whole weight in its storage, on ``device`` when offloaded."""
        return self.weight if self.offload is None else self.offload.take(device, backward)

    def dense_weight(self, dtype: torch.dtype, device: torch.device,
                     backward: bool = False) -> torch.Tensor:
        return dequantize(self.stored_weight(device, backward), dtype, self.nf4_chunk,
                          self.nf4_op)

    def tp_part(self, dim: int, start: int, stop: int) -> torch.Tensor:
        """Tensor parallelism's cut of the weight in its storage: rows ``[start, stop)``
        (``dim`` 0, with their scales) or those columns of every row (``dim`` 1; a row-scaled
        row keeps its scale, an NF4 row its blocks' scalers)."""
        w = self.weight.detach()
        if self.storage == "nf4":
            return checked_nf4_part(w, self.name, **({"rows": slice(start, stop)} if dim == 0
                                               else {"columns": (start, stop)}))
        return w.narrow(dim, start, stop - start).clone()

    def reorder_rows(self, order: torch.Tensor) -> None:
        """Put the weight's rows (and the bias's) in ``order`` (TP's order of a fused layer)."""
        if self.weight is not None and not self.weight.is_meta:
            self.weight = nn.Parameter(index_rows(self.weight.detach(), order, self.name),
                                       requires_grad=False)
        if self.bias is not None and not self.bias.is_meta:
            self.bias = nn.Parameter(self.bias.detach()[order], requires_grad=False)

    def extra_repr(self) -> str:
        where = ", offloaded" if self.offload is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"storage={self.storage}{where}"


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, attr, new)


def apply_frozen_base(model: nn.Module, options: FrozenBaseOptions, tp: int = 1,
                      world: int = 1, device: torch.device | None = None) -> nn.Module:
    """Store the frozen linear weights of a LoRA model (``model``, after ``apply_lora``) as
    ``options.dtype`` and log one line (``options.offload_fraction`` is applied from outside:
    ``foundryx.builders.apply_frozen_storage``); ``world``: the number of processes, ``tp``:
    the run's tensor-parallel degree (NF4's blocks are aligned to its column split); an FP8
    base on a ``device`` (the run's) with FP8 tensor cores multiplies in FP8 there (one more
    line says whether: :func:`foundryx.models.peft.fp8_gemm.choose`).
    Raises ConfigError when the model has no frozen linear layer or a layer NF4 cannot split."""
    inner = inner_model(model)
    frozen = {name: m for name, m in linear_modules(inner).items()
              if not m.weight.requires_grad and ".lora_" not in f".{name}"}
    if not frozen:
        raise ConfigError([f"{PATH}: the model has no frozen linear layers (is peft_config "
                           "set?); remove frozen_base or add peft_config"])
    before = sum(m.weight.numel() * m.weight.element_size() for m in frozen.values())
    layers = []
    for name, linear in frozen.items():
        layer = LowPrecisionLinear(linear, options.dtype, name, tp, world)
        _replace(inner, name, layer)
        layers.append(layer)
    after = sum(stored_bytes(layer.weight) for layer in layers)
    log.info("frozen_base: %d linear layers stored as %s: %.1f MB -> %.1f MB", len(layers),
             options.dtype, before / 2**20, after / 2**20)
    fp8_gemm.choose(device, layers, tp, options.fp8_gemm, options.fp8_rows)
    return model


def _data_dtype(weight: torch.Tensor) -> torch.dtype:
    """The dtype of a frozen weight's stored values (NF4: its packed uint8 codes; a row-scaled
    format: its quantized rows), not the dtype it dequantizes to."""
    local = getattr(weight, "_local_tensor", weight)
    for name in ("quantized_data", "qdata"):
        if hasattr(local, name):
            return getattr(local, name).dtype
    return local.dtype


def storage_on_rank(model: nn.Module) -> dict | None:
    """What this rank holds of a low-precision frozen base: the format, the stored values'
    dtype, the layers and the bytes on the device, and the offloaded layers and their bytes in
    host memory (this rank's rows); None without a frozen base. The run logs it per rank."""
    layers = [m for m in model.modules() if isinstance(m, LowPrecisionLinear)]
    if not layers:
        return None
    kept = [m for m in layers if m.offload is None]
    off = [m for m in layers if m.offload is not None]
    return {"format": layers[0].storage,
            "stored_dtype": str(_data_dtype(kept[0].weight if kept else off[0].offload.host)).removeprefix("torch."),
            "layers": len(layers), "weights": sum(m.in_features * m.out_features for m in layers),
            "device_bytes": sum(stored_bytes(m.weight) for m in kept),
            "offloaded": len(off), "host_bytes": sum(stored_bytes(m.offload.host) for m in off)}
