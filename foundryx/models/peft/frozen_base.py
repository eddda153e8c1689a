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

``offload_fraction`` keeps that share of the layers' weights out of the model's parameters
in host memory, sharded: each of N ranks holds its 1/N of the rows (``offload_rows``), in
the low-precision storage, and all of a rank's offloaded shards live in one exact-size host
buffer (pinned with ``cudaHostRegister`` when there is a GPU: per-tensor ``pin_memory()``
rounds every allocation up to a power of two, pytorch#150517). When a layer runs, forward
and backward, its shard is copied to the device and all-gathered there in its low
precision, and the whole weight is dropped after use; while one runs, the copy of the next
offloaded layer's shard is started. Offloaded weights are not in the model's state dict (a
LoRA checkpoint holds only the adapters).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from foundryx.errors import ConfigError
from foundryx.models.peft.frozen_options import FrozenBaseOptions
from foundryx.models.peft.lora import inner_model, linear_modules
from foundryx.models.peft.nf4_parts import nf4_part
from foundryx.models.peft.rowwise import RowScaledTensor

log = logging.getLogger(__name__)

PATH = "model.frozen_base"
NF4_BLOCK = 64  # QLoRA's block of weights per scale
NF4_SCALER_BLOCKS = (256, 128, 64, 32, 16, 8, 4, 2, 1)  # QLoRA's is 256


def _nf4_tensor_type() -> type:
    from torchao.dtypes.nf4tensor import NF4Tensor  # torchao is a heavy import, needed only here

    return NF4Tensor


def dequantize(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A dense ``dtype`` copy of a frozen weight in any of the ``frozen_base`` storages,
    allocating little more than that copy. A tensor-parallel weight (a DTensor) is dequantized
    in its local part and stays a DTensor with the same placement."""
    if isinstance(weight, DTensor):
        return DTensor.from_local(dequantize(weight.to_local(), dtype), weight.device_mesh,
                                  weight.placements, run_check=False, shape=weight.shape,
                                  stride=weight.stride())
    if isinstance(weight, RowScaledTensor):
        return weight.dequantize(dtype)
    if hasattr(weight, "quantized_scalers") and weight.is_contiguous():  # torchao's NF4Tensor
        return nf4_dense(weight, dtype)
    return weight.to(dtype)  # NF4Tensor dequantizes on .to(dtype); bf16 casts


NF4_CHUNK_BLOCKS = 4096  # blocks of 64 weights decoded at a time by nf4_dense


def nf4_dense(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """torchao's NF4 dequantization (``NF4Tensor.get_original_weight().to(dtype)``, the same
    values bit for bit) written into one preallocated ``dtype`` tensor a few thousand blocks
    at a time. torchao's decodes the whole weight at once through int64 indices and several
    full-size float intermediates: about 5x a float32 copy of the weight at its peak, the
    transient peak of every NF4 layer, forward and backward."""
    blocks = weight.numel() // weight.block_size
    scalers = weight.dequantize_scalers(weight.quantized_scalers, weight.quantization_factor,
                                        weight.scaler_block_size)  # one per block (small)
    packed = weight.quantized_data.view(blocks, weight.block_size // 2)  # two codes a byte
    out = torch.empty(blocks, weight.block_size // 2, 2, dtype=dtype, device=weight.device)
    for start in range(0, blocks, NF4_CHUNK_BLOCKS):
        codes = packed[start:start + NF4_CHUNK_BLOCKS]
        scale = scalers[start:start + NF4_CHUNK_BLOCKS, None]
        out[start:start + NF4_CHUNK_BLOCKS, :, 0] = weight.nf4[(codes >> 4).long()] * scale
        out[start:start + NF4_CHUNK_BLOCKS, :, 1] = weight.nf4[(codes & 0b1111).long()] * scale
    return out.view(weight.shape)


def stored_bytes(weight: torch.Tensor) -> int:
    """Bytes a (local shard of a) frozen weight really holds: a DTensor's local tensor, the
    inner tensors of a low-precision subclass."""
    local = getattr(weight, "_local_tensor", weight)
    if hasattr(local, "__tensor_flatten__"):
        names, _ = local.__tensor_flatten__()
        return sum(stored_bytes(getattr(local, n)) for n in names)
    return local.numel() * local.element_size()


def _world_size() -> int:
    dist = torch.distributed
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def to_nf4(weight: torch.Tensor, name: str, tp: int = 1) -> torch.Tensor:
    """torchao's NF4 with 64-weight blocks and the largest scaler block (QLoRA's 256, or
    smaller for a small layer) that lets FSDP2 split the layer evenly over the ranks; under
    tensor parallelism (``tp`` > 1) also one that makes each rank's columns of a row whole
    groups of scalers, so that TP's row and column parts are NF4 tensors of their own
    (:mod:`foundryx.models.peft.nf4_parts`)."""
    from torchao.dtypes.nf4tensor import to_nf4 as torchao_to_nf4  # heavy import, only here

    blocks, rem = divmod(weight.numel(), NF4_BLOCK)
    world = _world_size()

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


def to_storage(weight: torch.Tensor, dtype: str, name: str, tp: int = 1) -> torch.Tensor:
    if dtype == "nf4":
        return to_nf4(weight, name, tp)
    return RowScaledTensor.from_weight(weight, dtype)  # fp8, int8 and bf16


class _FrozenLinearFn(torch.autograd.Function):
    """``x @ W^T + b`` with ``W`` dequantized in forward and again in backward, so no dense
    copy of ``W`` stays alive for backward; ``W`` and ``b`` are frozen (no gradients)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, layer: LowPrecisionLinear) -> torch.Tensor:  # noqa: ANN001
        ctx.layer = layer
        bias = None if layer.bias is None else layer.bias.to(x.dtype)
        return F.linear(x, layer.dense_weight(x.dtype, x.device), bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        if not ctx.needs_input_grad[0]:  # e.g. the first layer: its input needs no gradient
            return None, None
        w = ctx.layer.dense_weight(grad.dtype, grad.device, backward=True)
        return grad @ w, None


class LowPrecisionLinear(nn.Module):
    """A frozen linear layer whose weight is stored in ``frozen_base``'s dtype (or, offloaded,
    in host memory) and dequantized when it runs."""

    def __init__(self, linear: nn.Linear, dtype: str, name: str, tp: int = 1) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.storage, self.name = dtype, name
        self.weight = nn.Parameter(to_storage(linear.weight, dtype, name, tp), requires_grad=False)
        self.bias = (None if linear.bias is None
                     else nn.Parameter(linear.bias.detach().clone(), requires_grad=False))
        self.offload: _Offloaded | None = None
        if hasattr(linear, "_fused"):  # a fused layer's part sizes (LoRA slices, TP's row order)
            self._fused = linear._fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _FrozenLinearFn.apply(x, self)

    def dense_weight(self, dtype: torch.dtype, device: torch.device,
                     backward: bool = False) -> torch.Tensor:
        if self.offload is None:
            return dequantize(self.weight, dtype)
        return dequantize(self.offload.take(device, backward), dtype)

    def tp_part(self, dim: int, start: int, stop: int) -> torch.Tensor:
        """Tensor parallelism's cut of the weight in its storage: rows ``[start, stop)``
        (``dim`` 0, with their scales) or those columns of every row (``dim`` 1; a row-scaled
        row keeps its scale, an NF4 row its blocks' scalers)."""
        w = self.weight.detach()
        if self.storage == "nf4":
            return _nf4_part(w, self.name, **({"rows": slice(start, stop)} if dim == 0
                                               else {"columns": (start, stop)}))
        return w.narrow(dim, start, stop - start).clone()

    def reorder_rows(self, order: torch.Tensor) -> None:
        """Put the weight's rows (and the bias's) in ``order`` (TP's order of a fused layer)."""
        if self.weight is not None and not self.weight.is_meta:
            self.weight = nn.Parameter(_index_rows(self.weight.detach(), order, self.name),
                                       requires_grad=False)
        if self.bias is not None and not self.bias.is_meta:
            self.bias = nn.Parameter(self.bias.detach()[order], requires_grad=False)

    def extra_repr(self) -> str:
        where = ", offloaded" if self.offload is not None else ""
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"storage={self.storage}{where}"


def offload_rows(rows: int, rank: int, world: int) -> tuple[int, int]:
    """Rows ``[start, stop)`` of a ``rows``-row offloaded weight that ``rank`` of ``world``
    holds (torch.chunk's split, as FSDP2's)."""
    per = -(-rows // world)
    return min(rank * per, rows), min((rank + 1) * per, rows)


def _rank() -> int:
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _take_rows(storage: torch.Tensor, start: int, stop: int) -> torch.Tensor:
    """A copy (not a view) of rows ``[start, stop)`` of a frozen-base storage tensor."""
    if isinstance(storage, RowScaledTensor):
        return RowScaledTensor(storage.qdata[start:stop].clone(), storage.scale[start:stop].clone(),
                               dtype=storage.dtype)
    per = stop - start  # NF4: rows split evenly (to_nf4 checked it)
    part = storage.split(per)[start // per]
    out = torch.empty_like(part)
    out.copy_(part)  # torchao's NF4 copy_ returns None
    return out


def _nf4_part(storage: torch.Tensor, name: str, **where: Any) -> torch.Tensor:
    try:
        return nf4_part(storage, **where)
    except ValueError as e:  # to_nf4 aligns the blocks for TP; a model built without it
        raise ConfigError([f"{PATH}.dtype: nf4: tensor parallelism cannot split {name!r}: {e}; "
                           "use dtype: int8 or fp8, or tp: 1"]) from None


def _index_rows(storage: torch.Tensor, order: torch.Tensor, name: str = "") -> torch.Tensor:
    """A low-precision weight's rows in ``order``."""
    if not isinstance(storage, RowScaledTensor):
        return _nf4_part(storage, name, rows=order)
    q = storage.qdata  # float8 has no CPU index kernel: its bytes are reordered
    q = q.view(torch.uint8)[order].view(q.dtype) if q.element_size() == 1 else q[order]
    return RowScaledTensor(q, storage.scale[order], dtype=storage.dtype)


def _take_columns(storage: torch.Tensor, start: int, stop: int, name: str = "") -> torch.Tensor:
    """A copy of columns ``[start, stop)`` of a low-precision weight (each row's scale whole:
    a row's scale comes from all of its columns; NF4: whole groups of blocks)."""
    if not isinstance(storage, RowScaledTensor):
        return _nf4_part(storage, name, columns=(start, stop))
    return RowScaledTensor(storage.qdata[:, start:stop].clone(), storage.scale.clone(),
                           dtype=storage.dtype)


def _all_gather(t: torch.Tensor, world: int, group: object = None) -> torch.Tensor:
    """Every rank's ``t`` (the same shape on all) concatenated along dim 0, in rank order of
    ``group`` (None: every rank); one-byte float types travel as bytes (gloo has no float8)."""
    if world == 1:
        return t
    as_bytes = t.dtype.itemsize == 1 and t.dtype != torch.uint8 and t.dtype != torch.int8
    send = (t.view(torch.uint8) if as_bytes else t).contiguous()
    parts = [torch.empty_like(send) for _ in range(world)]
    torch.distributed.all_gather(parts, send, group=group)
    out = torch.cat(parts)
    return out.view(t.dtype) if as_bytes else out


def _gather_rows(local: torch.Tensor, rows: int, world: int, group: object = None) -> torch.Tensor:
    """The whole weight (under TP: this rank's block of it) from the row shards (``local``, on
    the device) of the ``world`` ranks of ``group``, all-gathered in its low-precision form."""
    if isinstance(local, RowScaledTensor):
        per, n = -(-rows // world), local.qdata.shape[0]  # the last ranks may hold fewer rows
        q, sc = local.qdata, local.scale
        if n < per:
            q = torch.cat([q, q.new_zeros(per - n, *q.shape[1:])])
            sc = torch.cat([sc, sc.new_zeros(per - n)])
        return RowScaledTensor(_all_gather(q, world, group)[:rows],
                               _all_gather(sc, world, group)[:rows], dtype=local.dtype)
    from torchao.dtypes.nf4tensor import NF4Tensor, SubclassTensorArgs  # heavy import, only here

    whole = torch.Size((rows, *local.shape[1:]))  # NF4: every rank holds equal parts
    meta = SubclassTensorArgs(whole, (whole[1], 1), 0, local.dtype, local.device, False)
    scalers = _all_gather(local.quantized_scalers, world, group)
    return NF4Tensor(meta, local.block_size, scalers.numel(), local.scaler_block_size, scalers,
                     _all_gather(local.quantization_factor, world, group), local.scaler_mean,
                     _all_gather(local.quantized_data, world, group), local.nf4)


class _Offloaded:
    """One layer's frozen weight kept in host memory (with ``rows`` set: this rank's row
    shard of it); :meth:`take` gives the whole weight on the device (from the copy prefetched,
    else a fresh one, all-gathered when sharded) and starts the copy of the next layer's.

    Under tensor parallelism (:meth:`split_for_tp`) the weight is this rank's TP block instead
    (rows of a column-wise layer, columns of a row-wise one), sharded by rows over the
    data-parallel ranks that share the block, and :meth:`take` gives it as a DTensor."""

    def __init__(self, host: torch.Tensor, rows: int | None = None, world: int = 1,
                 name: str = "") -> None:
        self.rows, self.world = rows, world  # rows None: host is the whole weight
        self.name = name  # the layer's, for messages
        self.group: object = None  # the process group the rows are split over (None: all ranks)
        self.row_offset = 0  # under TP, column-wise: the whole weight's row the block starts at
        self.columns: tuple[int, int] | None = None  # under TP, row-wise: the block's columns
        self.placed: tuple[DeviceMesh, tuple, torch.Size] | None = None  # under TP: the DTensor
        self.host = host
        self.set_host(host)
        self.next: _Offloaded | None = None
        self.prev: _Offloaded | None = None
        self.pending: tuple[torch.device, torch.Tensor, object] | None = None
        self.copies = 0  # host -> device copies made (tests count them)

    def set_host(self, host: torch.Tensor) -> None:
        """Hold ``host`` (this rank's rows when sharded; a meta placeholder until a loader
        fills it; :func:`pack_offloaded` moves it into the shared host buffer)."""
        self.host = host

    def shard_range(self) -> tuple[int, int]:
        """The rows of the whole weight this rank holds (of its columns, under TP row-wise)."""
        if self.rows is None:
            return 0, self.host.shape[0]
        rank = _rank() if self.group is None else torch.distributed.get_rank(self.group)
        start, stop = offload_rows(self.rows, rank, self.world)
        return self.row_offset + start, self.row_offset + stop

    def split_for_tp(self, mesh: DeviceMesh, placement: Any, group: object,
                     order: torch.Tensor | None = None) -> None:
        """Keep this rank's tensor-parallel block of the weight (``placement`` over ``mesh``:
        Shard(0), rows, for a column-wise layer, in ``order`` when TP reorders a fused layer's
        rows; Shard(1), columns, for a row-wise one, each row's scale whole), its rows split
        over ``group``, the data-parallel ranks that hold the same block. A weight already in
        host memory is gathered whole once to be cut again (a meta placeholder: the loader
        reads the new rows)."""
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape = torch.Size((self.rows or self.host.shape[0], *self.host.shape[1:]))
        whole = None
        if not self.host.is_meta:
            whole = self.host if self.rows is None else _gather_rows(self.host, self.rows, self.world)
            if order is not None:
                whole = _index_rows(whole, order, self.name)
        local, offset = compute_local_shape_and_global_offset(shape, mesh, [placement])
        self.group, self.world = group, torch.distributed.get_world_size(group)
        self.placed = (mesh, (placement,), shape)
        if placement.dim == 0:
            self.rows, self.row_offset = local[0], offset[0]
        else:
            self.rows, self.columns = shape[0], (offset[1], offset[1] + local[1])
        if whole is not None:
            start, stop = self.shard_range()
            part = _take_rows(whole, start, stop)
            self.set_host(part if self.columns is None
                          else _take_columns(part, *self.columns, self.name))

    def _copy(self, device: torch.device) -> tuple[torch.Tensor, object]:
        self.copies += 1
        if device.type == "cuda":
            stream = _copy_stream(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                w = self.host.to(device, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
            return w, event
        # On CPU "the device" is host memory too: still a real copy, dropped after use. Copied
        # into an empty tensor of the same layout, not clone()d: torchao's NF4Tensor.clone()
        # dequantizes the whole weight and quantizes it again (~10x its fp32 size, and slow).
        if device == self.host.device:
            return torch.empty_like(self.host).copy_(self.host), None
        return self.host.to(device), None

    def prefetch(self, device: torch.device) -> None:
        if self.pending is None:
            self.pending = (device, *self._copy(device))

    def take(self, device: torch.device, backward: bool = False) -> torch.Tensor:
        if self.pending is not None and self.pending[0] == device:
            _, w, event = self.pending
        else:
            w, event = self._copy(device)
        self.pending = None
        if event is not None:
            torch.cuda.current_stream(device).wait_event(event)
        if self.rows is not None:
            w = _gather_rows(w, self.rows, self.world, self.group)
        if self.placed is not None:
            mesh, placements, shape = self.placed
            w = DTensor.from_local(w, mesh, placements, run_check=False, shape=shape,
                                   stride=(shape[1], 1))
        neighbour = self.prev if backward else self.next  # backward runs the layers reversed
        if neighbour is not None:
            neighbour.prefetch(device)
        return w


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _copy_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


def offload_layers(layers: list[LowPrecisionLinear], fraction: float) -> list[LowPrecisionLinear]:
    """Move ``fraction`` of ``layers`` (spread evenly over the model, in forward order) to host
    memory, each rank keeping its row shard of each (a meta weight stays a placeholder for a
    loader to fill), and chain them for prefetching; the offloaded layers."""
    count = round(fraction * len(layers))
    chosen = [layers[(i * len(layers)) // count] for i in range(count)] if count else []
    world = _world_size()
    chain: list[_Offloaded] = []
    for layer in chosen:
        whole = layer.weight.detach()
        del layer._parameters["weight"]
        layer.weight = None  # a plain attribute now: not a parameter, not in the state dict
        rows = whole.shape[0] if world > 1 else None
        layer.offload = _Offloaded(whole, rows, world, layer.name)
        if rows is not None and not whole.is_meta:
            layer.offload.set_host(_take_rows(whole, *layer.offload.shard_range()))
        del whole
        chain.append(layer.offload)
    for a, b in zip(chain, chain[1:]):
        a.next, b.prev = b, a
    if not any(layer.offload.host.is_meta for layer in chosen):
        pack_offloaded(chosen)
    return chosen


def _inner(t: torch.Tensor) -> tuple[list[str], object]:
    return t.__tensor_flatten__() if hasattr(t, "__tensor_flatten__") else ([], None)


def pack_offloaded(layers: list[LowPrecisionLinear]) -> int:
    """Move every offloaded shard's bytes into one exact-size host buffer (pinned in place
    with ``cudaHostRegister`` when there is a GPU); its size in bytes."""
    hosts = [layer.offload for layer in layers if layer.offload is not None]
    parts = [(o, n, getattr(o.host, n)) for o in hosts for n in _inner(o.host)[0]]
    align = 64
    total = sum(-(-t.nbytes // align) * align for _, _, t in parts)
    buffer = torch.empty(total, dtype=torch.uint8)
    if torch.cuda.is_available() and total:
        torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), total, 0)
    at, inner = 0, {}
    for o, n, t in parts:
        view = buffer[at:at + t.nbytes].view(t.dtype).view(t.shape)
        view.copy_(t)
        inner.setdefault(id(o), {})[n] = view
        at += -(-t.nbytes // align) * align
    for o in hosts:
        names, meta = _inner(o.host)
        if names:
            o.host = type(o.host).__tensor_unflatten__(inner[id(o)], meta, o.host.shape,
                                                       o.host.stride())
        o.buffer = buffer  # keeps it alive
    return total


def _replace(root: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, attr = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, attr, new)


def apply_frozen_base(model: nn.Module, options: FrozenBaseOptions, tp: int = 1) -> nn.Module:
    """Store the frozen linear weights of a LoRA model (``model``, after ``apply_lora``) as
    ``options.dtype``, offload ``options.offload_fraction`` of them, and log one line; ``tp``:
    the run's tensor-parallel degree (NF4's blocks are aligned to its column split).
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
        layer = LowPrecisionLinear(linear, options.dtype, name, tp)
        _replace(inner, name, layer)
        layers.append(layer)
    after = sum(stored_bytes(layer.weight) for layer in layers)
    offloaded = offload_layers(layers, options.offload_fraction)
    off_bytes = sum(stored_bytes(layer.offload.host) for layer in offloaded)
    if offloaded and offloaded[0].offload.host.is_meta:
        off_bytes //= _world_size()  # placeholders: each rank will hold its rows
    log.info("frozen_base: %d linear layers stored as %s: %.1f MB -> %.1f MB%s", len(layers),
             options.dtype, before / 2**20, after / 2**20,
             f"; {len(offloaded)} of them offloaded to host memory ({off_bytes / 2**20:.1f} MB on "
             f"each of {_world_size()} ranks)"
             if offloaded else "")
    return model
