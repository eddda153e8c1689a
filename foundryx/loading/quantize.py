"""Quantize on load: a rank turns its own rows of a frozen weight into the ``frozen_base``
storage, bit for bit what quantizing the whole weight and then sharding it gives.

- fp8 / int8 / bf16 (:class:`~foundryx.models.peft.rowwise.RowScaledTensor`): a scale per
  output row, computed from that row alone, so a rank's rows need nothing from the others.
- nf4 (torchao's ``NF4Tensor``): a scale per 64 weights (blocks never straddle ranks: each
  rank's rows are a whole number of scaler blocks, which ``frozen_base`` checks when it picks
  the scaler block) and the scales double-quantized around their mean over the *whole*
  weight. That mean is the one statistic a rank cannot compute alone: the ranks all-gather
  their block maxima (one number per 64 weights) and every rank takes the same ``mean()`` of
  the same vector, so it is the full-weight value exactly.

Row-scaled formats are computed in chunks of rows through one float32 scratch buffer per
thread, reused for every tensor (no whole-tensor float32 copy is allocated: allocating and
first touching those was most of the quantization's time, and its transient memory), with
the same float32 operations, in the same order, as
:func:`~foundryx.models.peft.rowwise.quantize_rows` on the whole weight (less a clamp that
changes nothing, see :func:`rowwise`), one pass per chunk while it is in cache.
"""

from __future__ import annotations

import threading
from typing import Any

import torch

from foundryx.models.peft.rowwise import MIN_SCALE, QDTYPES, QMAX, RowScaledTensor

CHUNK = 1 << 18  # float32 elements of scratch per reader thread (1 MiB: stays in cache)
_scratch = threading.local()


def exact(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether every value of ``src`` is a value of ``dst`` (a cast that never rounds)."""
    wider = {torch.bfloat16: (torch.float32, torch.float64), torch.float16: (torch.float32, torch.float64),
             torch.float32: (torch.float64,)}
    return src == dst or dst in wider.get(src, ())


def _buffer(rows: int, cols: int) -> torch.Tensor:
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.numel() < rows * cols:
        buf = _scratch.buf = torch.empty(max(rows * cols, CHUNK), dtype=torch.float32)
    return buf[:rows * cols].view(rows, cols)


_SIGN = {torch.bfloat16: (torch.int16, 0x7FFF), torch.float16: (torch.int16, 0x7FFF),
         torch.float32: (torch.int32, 0x7FFFFFFF)}


def _absmax(c: torch.Tensor) -> torch.Tensor:
    """Per row, the float32 ``max(amax, -amin)`` of ``quantize_rows``, in one pass: the
    largest magnitude, found as the largest sign-cleared bit pattern (IEEE magnitudes order
    as their bits do, NaN above infinity, so a NaN row gives NaN as ``amax`` does); max and
    min never round, so a bfloat16 chunk's is its float32 copy's."""
    bits, mask = _SIGN[c.dtype]
    return (c.view(bits) & mask).amax(dim=1).view(c.dtype).float()


def rowwise(rows: torch.Tensor, kind: str, dtype: torch.dtype) -> RowScaledTensor:
    """``rows`` (any float dtype, on the CPU or a device) as a RowScaledTensor of ``kind``
    that dequantizes to ``dtype``: bit for bit ``RowScaledTensor.from_weight(rows.to(dtype),
    kind)``, computed a chunk of rows at a time (see the module doc).

    One pass per chunk while it is in cache: its rows' absmax, scales, then the quantized
    rows. ``quantize_rows`` clamps the scaled rows to the format's range before the cast; that
    clamp changes nothing and is left out: a finite ``|x| <= amax`` divided by ``scale =
    max(amax / QMAX, MIN_SCALE)`` is at most ``QMAX`` by a rounding of the division (a few
    ulps of float32), which int8's ``round`` and float8's nearest-value cast both take to
    ``QMAX``; NaN stays NaN either way (the tests compare against ``quantize_rows``)."""
    if rows.dim() != 2 or not rows.numel() or rows.device.type != "cpu":
        return RowScaledTensor.from_weight(rows.to(dtype), kind)
    same = exact(rows.dtype, dtype)
    n, cols = rows.shape
    step = max(1, CHUNK // cols)
    chunks = [(i, min(i + step, n)) for i in range(0, n, step)]

    def part(i: int, j: int) -> torch.Tensor:
        return rows[i:j] if same else rows[i:j].to(dtype)

    if kind == "bf16":  # the weight rounded to bfloat16, scales of 1 (quantize_rows)
        qdata = torch.empty((n, cols), dtype=torch.bfloat16)
        for i, j in chunks:
            qdata[i:j].copy_(part(i, j))
        return RowScaledTensor(qdata, torch.ones(n), dtype=dtype)
    scale = torch.empty(n, dtype=torch.float32)
    qdata = torch.empty((n, cols), dtype=QDTYPES[kind])
    for i, j in chunks:
        c, w = part(i, j), _buffer(j - i, cols)
        if c.dtype not in _SIGN:  # (float64): the float32 working copy's values
            c = w.copy_(c)
        torch.div(_absmax(c), QMAX[kind], out=scale[i:j]).clamp_(min=MIN_SCALE)
        if c.dtype != torch.float32:
            c = w.copy_(c)  # the float32 working copy (exact from bfloat16 / float16)
        torch.div(c, scale[i:j, None], out=w)
        if kind == "int8":
            w.round_()
        qdata[i:j].copy_(w)
    return RowScaledTensor(qdata, scale, dtype=dtype)


def _nf4_lut(dtype: torch.dtype) -> torch.Tensor:
    from torchao.dtypes.nf4tensor import to_nf4  # torchao is a heavy import, needed only here

    return to_nf4(torch.zeros(64, dtype=dtype), 64, 1).nf4


def nf4(rows: torch.Tensor, like: Any, dtype: torch.dtype, group: Any = None) -> Any:
    """This rank's rows as an ``NF4Tensor`` shard with the block sizes of ``like`` (the meta
    NF4 shard FSDP2 made); the whole weight's scaler mean from the block maxima of every rank
    of ``group`` (None: this rank holds the whole weight)."""
    from torchao.dtypes.nf4tensor import NF4Tensor, SubclassTensorArgs, get_block_absmax

    w = rows.to(dtype).contiguous()
    block, scaler_block = like.block_size, like.scaler_block_size
    blocks = w.numel() // block
    absmax = get_block_absmax(w.flatten(), block)
    whole = absmax
    if group is not None and torch.distributed.get_world_size(group) > 1:
        parts = [torch.empty_like(absmax) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(parts, absmax, group=group)
        whole = torch.cat(parts)
    mean = whole.mean()
    # torchao's double_quantize_scalers, on this rank's scaler blocks, around the whole mean
    centred = absmax - mean
    groups = centred.view(blocks // scaler_block, scaler_block)
    factor = 256 / (2 * groups.abs().max(dim=1).values)
    quantized_scalers = (groups * factor[:, None]).round().clamp(-128, 127).flatten().to(torch.int8)
    lut = _nf4_lut(dtype)
    data = NF4Tensor.convert_to_norm_float_weight(w, blocks, block, lut)
    meta = SubclassTensorArgs(w.size(), w.stride(), 0, dtype, w.device, False)
    return NF4Tensor(meta, block, like.n_blocks, scaler_block, quantized_scalers,
                     factor.contiguous(), mean, data, lut)
