"""Frozen weights stored as int8 or FP8 (e4m3) with one scale per output row (or as bf16), as
a tensor subclass FSDP2 shards and all-gathers in its low-precision form.

torchao covers NF4 on CPU (``torchao.dtypes.nf4tensor.NF4Tensor``, used for ``frozen_base:
nf4``), but its int8 and float8 tensors are built for inference kernels or for float8
*training* (high-precision master weights cast per step, CUDA ``_scaled_mm``): none of them
is a frozen, row-scaled weight that FSDP2 can shard on torch 2.7 + torchao 0.11 and torch 2.14
+ torchao 0.14 alike on CPU. :class:`RowScaledTensor` is that, and small: ``weight ~= qdata *
scale[:, None]``. Rows are the sharded dimension, so each rank's shard holds its rows' bytes
and their scales; FSDP2's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` hooks all-gather
exactly those (1 byte per weight plus 4 per row) and rebuild the subclass. The ops below are
the ones FSDP2 and ``nn.Module`` use to shard, pad, move and copy a parameter; anything else
(a matmul) raises, so a weight never silently turns into a plain dense tensor: layers
dequantize explicitly (:func:`foundryx.models.peft.frozen_base.dequantize`).
"""

from __future__ import annotations

import math
from typing import Any

import torch

aten = torch.ops.aten

QDTYPES = {"int8": torch.int8, "fp8": getattr(torch, "float8_e4m3fn", None), "bf16": torch.bfloat16}
QMAX = {"int8": 127.0, "fp8": 448.0}  # e4m3fn's largest finite value
# A row's scale never goes below this, so an all-zero (or underflowing) row gives zeros, not
# 0/0 = NaN (the trap of row-wise FP8 scales on near-zero rows).
MIN_SCALE = 1e-12


def quantize_rows(weight: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(qdata, scale)`` for a 2-D ``weight``: per output row, ``scale = amax / qmax``
    (bf16: the weight rounded to bfloat16, scales of 1). One float32 working copy, scaled,
    rounded and clamped in place (a loader quantizes every rank's rows with it)."""
    if kind == "bf16":
        return weight.detach().to(torch.bfloat16), torch.ones(weight.shape[0], device=weight.device)
    w = weight.detach().to(torch.float32, copy=True)
    amax = torch.maximum(w.amax(dim=1), w.amin(dim=1).neg_()) if w.numel() else w.new_zeros(w.shape[0])
    scale = (amax / QMAX[kind]).clamp(min=MIN_SCALE)
    w.div_(scale[:, None])
    if kind == "int8":
        qdata = w.round_().clamp_(-127, 127).to(torch.int8)
    else:
        qdata = w.clamp_(-QMAX[kind], QMAX[kind]).to(QDTYPES[kind])
    return qdata, scale


class RowScaledTensor(torch.Tensor):
    """A frozen 2-D weight as ``qdata`` (int8, float8_e4m3fn or bfloat16, ``[out, in]``) and
    ``scale`` (float32, ``[out]``); its dtype is the dtype it dequantizes to by default (the
    original weight's, so under FSDP2 a bf16 base beside fp32 adapters and norms keeps the
    uniform original dtype torch 2.7's FSDP2 requires of a unit, and is not upcast by the
    mixed-precision policy before the all-gather)."""

    qdata: torch.Tensor
    scale: torch.Tensor

    @staticmethod
    def __new__(cls, qdata: torch.Tensor, scale: torch.Tensor, shape: Any = None,
                dtype: torch.dtype = torch.float32) -> RowScaledTensor:
        shape = torch.Size(qdata.shape if shape is None else shape)
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=qdata.device,
                                                   requires_grad=False)

    def __init__(self, qdata: torch.Tensor, scale: torch.Tensor, shape: Any = None,
                 dtype: torch.dtype = torch.float32) -> None:
        self.qdata, self.scale = qdata, scale

    @classmethod
    def from_weight(cls, weight: torch.Tensor, kind: str) -> RowScaledTensor:
        qdata, scale = quantize_rows(weight, kind)
        return cls(qdata, scale, dtype=weight.dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """A dense copy, scaled in place: one float32 weight at a time (an out-of-place
        ``qdata.float() * scale`` held two, the transient peak of every frozen layer); bf16
        rows (scales of 1) are only cast."""
        dtype = dtype or self.dtype
        if self.qdata.dtype == torch.bfloat16:
            return self.qdata.to(dtype)
        w = self.qdata.to(torch.float32)
        w.mul_(self.scale[:, None])
        return w.to(dtype)

    @property
    def kind(self) -> str:
        return {torch.int8: "int8", torch.bfloat16: "bf16"}.get(self.qdata.dtype, "fp8")

    def nbytes_stored(self) -> int:
        return self.qdata.nbytes + self.scale.nbytes

    def __repr__(self) -> str:
        return (f"RowScaledTensor({self.kind}, shape={tuple(self.shape)}, dtype={self.dtype}, "
                f"device={self.device})")

    # -- torch.compile / FSDP2 tensor-subclass protocol ---------------------------------
    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["qdata", "scale"], (tuple(self.shape), self.dtype)

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: Any, outer_size: Any,
                             outer_stride: Any) -> RowScaledTensor:
        return RowScaledTensor(inner["qdata"], inner["scale"], meta[0], meta[1])

    def fsdp_pre_all_gather(self, mesh: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        """What FSDP2 all-gathers: this shard's low-precision rows and their scales."""
        return (self.qdata, self.scale), (self.shape[1:], self.dtype)

    def fsdp_post_all_gather(self, outputs: tuple[torch.Tensor, ...], metadata: Any,
                             param_dtype: torch.dtype, *, out: torch.Tensor | None = None) -> Any:
        tail, dtype = metadata
        if len(outputs) == 1:
            # torch 2.14's FSDP2 skips the all-gather on a one-rank mesh (tp = world size) and
            # copies only the first input (qdata); there this shard is the whole weight, and its
            # scales are copied here (FSDP2 frees the unsharded tensors after use)
            qdata = outputs[0]
            if out is not None:
                out = getattr(out, "_local_tensor", out)  # a tensor-parallel DTensor's part
                out.qdata.copy_(qdata.view_as(out.qdata))
                out.scale.copy_(self.scale)
                return None
            scale = self.scale.clone()
        else:
            qdata, scale = outputs
        if out is not None:  # FSDP2 refilled the storages ``out`` already views
            return None
        rows = scale.numel()
        full = RowScaledTensor(qdata.view(rows, *tail), scale, (rows, *tail), dtype)
        return full, (qdata, scale)

    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        handler = _OPS.get(func)
        if handler is None:
            raise NotImplementedError(
                f"RowScaledTensor (a frozen int8/fp8 weight) does not support {func}; "
                "dequantize() it first")
        return handler(*args, **kwargs)


def _like(t: RowScaledTensor, qdata: torch.Tensor, scale: torch.Tensor,
          shape: Any = None) -> RowScaledTensor:
    return RowScaledTensor(qdata, scale, qdata.shape if shape is None else shape, t.dtype)


def _same(t, *args, **kwargs):  # detach, alias: the same data, a new wrapper
    return _like(t, t.qdata, t.scale, t.shape)


def _split(t, size, dim=0):
    if dim != 0:
        raise NotImplementedError("RowScaledTensor splits only along rows (dim 0)")
    return [_like(t, q, s) for q, s in zip(t.qdata.split(size), t.scale.split(size), strict=True)]


def _new_zeros(t, size, **kwargs):
    size = tuple(size)
    if len(size) != 2 or size[1:] != tuple(t.qdata.shape[1:]):
        raise NotImplementedError(f"RowScaledTensor.new_zeros{size}: only whole rows")
    return _like(t, t.qdata.new_zeros(size), t.scale.new_zeros(size[0]))


def _empty_like(t, **kwargs):
    """Same layout, new storages, on ``device`` when given (``to_empty`` materialises a meta
    weight with it)."""
    where = {"device": kwargs["device"]} if kwargs.get("device") is not None else {}
    return _like(t, torch.empty_like(t.qdata, **where), torch.empty_like(t.scale, **where), t.shape)


def _slice(t, dim=0, start=None, end=None, step=1):
    if step != 1 or dim not in (0, 1, -1):
        raise NotImplementedError("RowScaledTensor slices only whole rows or whole columns")
    if dim == 0:
        return _like(t, t.qdata[start:end], t.scale[start:end])
    # columns (a tensor-parallel row-wise layer's input features): every row keeps its scale
    qdata = t.qdata[:, start:end]
    return _like(t, qdata, t.scale, qdata.shape)


def _index(t, indices):
    """Rows picked by one index tensor (the tensor-parallel reorder of a fused layer's rows)."""
    if len(indices) != 1 or indices[0] is None:
        raise NotImplementedError("RowScaledTensor is indexed only by rows")
    q = t.qdata
    if q.is_floating_point() and q.element_size() == 1:  # torch 2.7 cannot index float8 on CPU
        picked = q.view(torch.uint8)[indices[0]].view(q.dtype)
    else:
        picked = q[indices[0]]
    return _like(t, picked, t.scale[indices[0]])


def _view(t, size):
    size = tuple(size)
    if size in ((-1,), (t.numel(),)) or size == tuple(t.shape):  # FSDP2's flat handle
        return _like(t, t.qdata, t.scale, (t.numel(),) if len(size) == 1 else t.shape)
    raise NotImplementedError(f"RowScaledTensor.view{size}")


def _as_strided(t, size, stride, storage_offset=0):
    size = tuple(size)
    contiguous = tuple(int(math.prod(size[i + 1:])) for i in range(len(size)))
    if size != tuple(t.qdata.shape) or tuple(stride) != contiguous or storage_offset:
        raise NotImplementedError(f"RowScaledTensor.as_strided{size, tuple(stride)}")
    return _like(t, t.qdata, t.scale)


def _copy_(dst, src, non_blocking=False):
    if not isinstance(src, RowScaledTensor):
        src = RowScaledTensor.from_weight(src.to(dst.device), dst.kind)
    dst.qdata.copy_(src.qdata, non_blocking=non_blocking)
    dst.scale.copy_(src.scale, non_blocking=non_blocking)
    return dst


def _to_copy(t, dtype=None, device=None, non_blocking=False, **kwargs):
    if dtype is not None and dtype != t.dtype and device is None:
        return t.dequantize(dtype)  # an explicit cast to a dense dtype
    move = dict(device=device, non_blocking=non_blocking)
    return _like(t, t.qdata.to(**move), t.scale.to(**move), t.shape)


def _clone(t, **kwargs):
    return _like(t, t.qdata.clone(), t.scale.clone(), t.shape)


def _is_pinned(t, device=None):
    return t.qdata.is_pinned() and t.scale.is_pinned()


def _pin_memory(t, device=None):
    return _like(t, t.qdata.pin_memory(), t.scale.pin_memory(), t.shape)


_OPS = {
    aten.detach.default: _same, aten.alias.default: _same,
    aten.split.Tensor: _split, aten.new_zeros.default: _new_zeros,
    aten.empty_like.default: _empty_like, aten.slice.Tensor: _slice, aten.view.default: _view,
    aten.index.Tensor: _index,
    aten.as_strided.default: _as_strided, aten.copy_.default: _copy_,
    aten._to_copy.default: _to_copy, aten.clone.default: _clone,
    aten.is_pinned.default: _is_pinned, aten._pin_memory.default: _pin_memory,
}
