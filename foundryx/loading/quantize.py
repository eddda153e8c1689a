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

import functools
import sys
import threading
from typing import Any, NamedTuple

import torch

from foundryx.kernels import nf4_cpu
from foundryx.models.peft.rowwise import MIN_SCALE, QDTYPES, QMAX, RowScaledTensor

CHUNK = 1 << 18  # float32 elements of scratch per reader thread (1 MiB: stays in cache)
# elements of an NF4 chunk on a GPU: ~40 bytes of transient device memory each (80 MiB); no
# cache to fit, and each chunk is a dozen kernel launches
DEVICE_CHUNK = 1 << 21
_scratch = threading.local()


def exact(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether every value of ``src`` is a value of ``dst`` (a cast that never rounds)."""
    wider = {torch.bfloat16: (torch.float32, torch.float64), torch.float16: (torch.float32, torch.float64),
             torch.float32: (torch.float64,)}
    return src == dst or dst in wider.get(src, ())


def _scratch_tensor(name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
    """This thread's scratch tensor ``name``: ``n`` elements of ``dtype``, reused chunk after
    chunk (fresh chunk-sized temporaries are fresh pages to fault in: most of the kernel time
    of an NF4 load, since the loader hands freed memory back to the OS as it goes)."""
    bufs = getattr(_scratch, "named", None)
    if bufs is None:
        bufs = _scratch.named = {}
    buf = bufs.get(name)
    if buf is None or buf.numel() < n or buf.dtype != dtype:
        buf = bufs[name] = torch.empty(max(n, CHUNK), dtype=dtype)
    return buf[:n]


def _buffer(rows: int, cols: int) -> torch.Tensor:
    """This thread's float32 scratch rows of the row-scaled formats."""
    return _scratch_tensor("rows", rows * cols, torch.float32).view(rows, cols)


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
    from foundryx.models.peft.torchao_nf4 import (
        to_nf4,  # torchao is a heavy import, needed only here
    )

    return to_nf4(torch.zeros(64, dtype=dtype), 64, 1).nf4


class Encoded(NamedTuple):
    """A rank's rows of an NF4 weight before the whole weight's scaler mean is known."""

    absmax: torch.Tensor
    codes: torch.Tensor
    shape: torch.Size


def _nearest(scaled: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """The index of the NF4 level nearest each of ``scaled`` (1-D), bit for bit torchao's
    ``quantize_tensor_nearest`` (``argmin |value - level|`` over the 16 levels, the first
    index on a tie, computed in ``scaled``'s dtype) without its 16 comparisons per element:
    the two levels around the value (``searchsorted``) are the only candidates, because
    ``|value - level|`` rounds monotonically in the level and the levels are further apart
    (>= 0.079) than any rounding of a difference below 2 (the smallest gap stays strict), so
    no level further out can tie with the nearer neighbour; on a tie between the two the
    lower index wins, as argmin's first. That holds for ``|value| <= 1``, every value of a
    block scaled by its absmax; NaN (a block of zeros scaled by its absmax 0) and anything
    beyond go through torchao's own search."""
    from foundryx.models.peft.torchao_nf4 import NF4Tensor

    codes = _searched(scaled, lut)
    odd = ~(scaled.abs() <= 1)  # NaN, or beyond the levels (never a scaled block's value)
    if odd.any():  # where roundings tie far levels: torchao's own search
        codes[odd] = NF4Tensor.quantize_tensor_nearest(scaled[odd], lut).to(torch.uint8)
    return codes


def _searched(scaled: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """:func:`_nearest`'s two-level search alone (uint8 codes): torchao's code for every value
    in [-1, 1], and a code of no meaning for NaN or anything beyond."""
    idx = torch.searchsorted(lut, scaled)
    hi = idx.clamp(max=lut.numel() - 1)
    lo = idx.sub_(1).clamp_(min=0)
    pick_hi = (scaled - lut[hi]).abs_() < (scaled - lut[lo]).abs_()
    return torch.where(pick_hi, hi, lo).to(torch.uint8)


# the top 16 bits of a float32 on this machine: the second half-word on a little-endian one
_HIGH_HALF = 1 if sys.byteorder == "little" else 0


@functools.cache
def _code_tables(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per bucket of values (the value's top 16 bits, read as an unsigned index: one value of a
    16-bit dtype, an interval of float32), its NF4 code by :func:`_nearest`; for float32 also
    a threshold per bucket: within [-1, 1] the code only grows with the value and the levels
    are further apart than a bucket is wide, so a bucket holds one code or two, the higher one
    from the threshold on (the bucket's smallest value that :func:`_nearest` gives it; +inf
    for a bucket of one code). Buckets beyond [-1, 1] get the smaller of their two ends' codes
    and no threshold (:func:`_codes` searches exactly for the values there)."""
    lut = _nf4_lut(dtype)
    top = torch.arange(1 << 16, dtype=torch.int64)
    if dtype.itemsize == 2:
        return _nearest(top.to(torch.int16).view(dtype), lut), None
    low = (top << 16).to(torch.int32).view(torch.float32)
    high = ((top << 16) | 0xFFFF).to(torch.int32).view(torch.float32)
    a, b = _nearest(low, lut), _nearest(high, lut)
    code = torch.minimum(a, b)
    threshold = torch.full((1 << 16,), float("inf"))
    inside = (low.abs() <= 1) & (high.abs() <= 1)
    for t in ((a != b) & inside).nonzero().squeeze(1).tolist():  # at most one per boundary
        values = ((t << 16) | torch.arange(1 << 16, dtype=torch.int64)).to(torch.int32).view(torch.float32)
        threshold[t] = values[_nearest(values, lut) > code[t]].min()
    return code, threshold


def _codes(scaled: torch.Tensor, lut: torch.Tensor, within: bool = False) -> torch.Tensor:
    """:func:`_nearest` of ``scaled`` (1-D, contiguous) by table look-ups per element (its top
    16 bits as the index; for float32 also the bucket's threshold). ``within``: the caller
    knows every value is in [-1, 1] (a block scaled by its finite, nonzero absmax); otherwise
    NaN and values beyond go through the exact search. On the CPU the result is this thread's
    scratch tensor ``codes``, valid until its next call."""
    if scaled.dtype not in (torch.float32, torch.bfloat16, torch.float16) or scaled.device.type != "cpu":
        return _nearest(scaled, lut)
    table, threshold = _code_tables(scaled.dtype)
    n = scaled.numel()
    halves = scaled.view(torch.uint16)
    if threshold is not None:
        halves = halves[_HIGH_HALF::2]
    index = _scratch_tensor("index", n, torch.int32).copy_(halves)
    codes = torch.index_select(table, 0, index, out=_scratch_tensor("codes", n, torch.uint8))
    if threshold is None:  # a 16-bit dtype: the table holds every value's code
        return codes
    bound = torch.index_select(threshold, 0, index, out=_scratch_tensor("bound", n, torch.float32))
    codes.add_(torch.ge(scaled, bound, out=_scratch_tensor("above", n, torch.bool)))
    if not within:
        odd = (~(scaled.abs() <= 1)).nonzero().squeeze(1)  # NaN, or beyond the levels
        if odd.numel():
            codes[odd] = _nearest(scaled[odd], lut)
    return codes


def _pack(codes: torch.Tensor, out: torch.Tensor) -> None:
    """Two 4-bit codes a byte, the first in the high half (torchao's order), into ``out``:
    read as 16-bit words (little-endian: the first code in the low byte), ``(w << 4) | (w >>
    8)`` holds the byte in its low 8 bits, which the copy into ``out`` keeps."""
    if sys.byteorder != "little":
        torch.bitwise_or(codes[::2] << 4, codes[1::2], out=out)
        return
    words = codes.view(torch.int16)
    high = torch.bitwise_left_shift(words, 4, out=_scratch_tensor("high", words.numel(), torch.int16))
    low = torch.bitwise_right_shift(words, 8, out=_scratch_tensor("low", words.numel(), torch.int16))
    out.copy_(high.bitwise_or_(low))


@functools.cache
def thresholds(dtype: torch.dtype) -> torch.Tensor:
    """NF4's 15 decision thresholds for values of ``dtype`` in [-1, 1], ascending, as float32:
    the smallest value of ``dtype`` that :func:`_nearest` puts above each level, so that a
    value's code is the number of thresholds at or below it (the code only grows with the
    value there, which this checks)."""
    table, threshold = _code_tables(dtype)
    if threshold is not None:  # float32: one bucket holds each boundary, its threshold exact
        return threshold[threshold.isfinite()].sort().values
    values = torch.arange(1 << 16, dtype=torch.int64).to(torch.int16).view(dtype).float()
    inside = values.abs() <= 1
    values, order = values[inside].sort(stable=True)
    codes = table[inside][order]
    assert bool((codes[1:] >= codes[:-1]).all()), dtype
    return torch.stack([values[codes > k].min() for k in range(15)])


def nf4_encode(rows: torch.Tensor, block: int, dtype: torch.dtype) -> Encoded:
    """``(absmax per block, packed 4-bit codes, shape)`` of ``rows`` as ``dtype``: what torchao's
    ``get_block_absmax`` and ``convert_to_norm_float_weight`` give for ``rows.to(dtype)``,
    bit for bit. On the CPU by :mod:`foundryx.kernels.nf4_cpu` (one pass per element, the
    codes from :func:`thresholds`); without a C compiler, or for a slice with a block that
    scales out of [-1, 1], by torch ops a chunk of blocks at a time (no whole-weight copy, no
    16-level comparison tensor; see :func:`_nearest`) through this thread's scratch tensors;
    on a GPU by :func:`_nf4_encode_device`. Needs nothing from other ranks: it runs in a
    reader thread; :func:`nf4` finishes with the one collective."""
    if rows.device.type != "cpu":
        return _nf4_encode_device(rows, block, dtype)
    flat = rows.reshape(-1)
    n = flat.numel()
    absmax = torch.empty(n // block, dtype=dtype)
    packed = torch.empty(n // 2, dtype=torch.uint8)
    if nf4_cpu.supports(flat.dtype, dtype, block, rows.device) and nf4_cpu.available():
        scales = absmax if dtype == torch.float32 else torch.empty(n // block)
        if not nf4_cpu.encode(flat.contiguous(), block, dtype, thresholds(dtype), scales, packed):
            if scales is not absmax:
                absmax.copy_(scales)  # a bfloat16 block's absmax is a bfloat16 value: exact
            return Encoded(absmax, packed, rows.shape)
        # a block of zeros, an infinity or NaN: the whole slice as torch's ops encode it
    lut = _nf4_lut(dtype)
    step = max(1, CHUNK // block) * block
    as_is = _maxima_as_is(flat.dtype, dtype)
    for s in range(0, n, step):
        e = min(s + step, n)
        # the chunk as ``dtype`` (the cast ``to`` makes) in a scratch copy, divided in place
        # below (a promoting division would run far slower)
        scaled = _scratch_tensor("scaled", e - s, dtype).view(-1, block)
        am = absmax[s // block:e // block]
        _scale_blocks(flat[s:e].view(-1, block), scaled, am, as_is)
        within = bool(_finite_nonzero(am).all())  # no 0/0, inf/inf: no NaN
        _pack(_codes(scaled.view(-1), lut, within), packed[s // 2:e // 2])
    return Encoded(absmax, packed, rows.shape)


def _maxima_as_is(src: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether rows of ``src`` have their block maxima found on the rows as they are, before
    the copy to ``dtype`` (max never rounds): every value of ``src`` is one of ``dtype``
    (bfloat16 for a float32 NF4) and :func:`_absmax` reads its bits."""
    return exact(src, dtype) and src in _SIGN


def _scale_blocks(src: torch.Tensor, scaled: torch.Tensor, am: torch.Tensor, as_is: bool) -> None:
    """``src``'s blocks (rows) copied into ``scaled`` (of the NF4 dtype: the cast ``to``
    makes), their absmax into ``am``, and ``scaled`` divided by it in place: torchao's
    ``get_block_absmax`` and ``blocks / scales``."""
    scaled.copy_(src)
    if as_is:
        am.copy_(_absmax(src))
    else:
        torch.amax(scaled.abs(), dim=1, out=am)
    torch.div(scaled, am[:, None], out=scaled)


def _finite_nonzero(am: torch.Tensor) -> torch.Tensor:
    """Per block, whether its absmax scales it into [-1, 1]: neither 0 (0/0 is NaN), infinite
    (inf/inf) nor NaN. A finite, nonzero absmax does: ``|x| <= am`` gives ``|x / am| <= 1``
    after the division's rounding too (1 is a value of every dtype)."""
    return (am > 0) & (am < float("inf"))


@functools.cache
def _device_lut(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The NF4 levels of ``dtype`` on ``device``, copied there once per process (a copy from
    the host per weight would be a host sync per weight)."""
    return _nf4_lut(dtype).to(device)


def _nf4_encode_device(rows: torch.Tensor, block: int, dtype: torch.dtype) -> Encoded:
    """:func:`nf4_encode` on a GPU (or any device; tests run it on CPU tensors): the same torch
    ops, bit for bit, with at most one host sync per weight rather than two per chunk (about
    10^5 a rank for a 405B model, each one stalling the reader thread on the device's queue).

    The chunk loop never asks the host: each value's code comes from the two-level search
    alone (:func:`_searched`), torchao's for every value of a block with a finite, nonzero
    absmax. The blocks that have none (a block of zeros, an infinity or a NaN: rare) are found
    after the loop, from the block maxima, in the one sync (``nonzero``), and encoded again
    by torchao's own search (:func:`_recode`). Chunks of :data:`DEVICE_CHUNK` elements in
    fresh device tensors (the caching allocator reuses them); ``block`` is even, as NF4's."""
    flat = rows.reshape(-1)
    n = flat.numel()
    absmax = torch.empty(n // block, dtype=dtype, device=rows.device)
    packed = torch.empty(n // 2, dtype=torch.uint8, device=rows.device)
    lut = _device_lut(dtype, rows.device)
    step = max(1, DEVICE_CHUNK // block) * block
    as_is = _maxima_as_is(flat.dtype, dtype)
    for s in range(0, n, step):
        e = min(s + step, n)
        scaled = torch.empty((e - s) // block, block, dtype=dtype, device=rows.device)
        _scale_blocks(flat[s:e].view(-1, block), scaled, absmax[s // block:e // block], as_is)
        codes = _searched(scaled.view(-1), lut)
        torch.bitwise_or(codes[::2] << 4, codes[1::2], out=packed[s // 2:e // 2])
    odd = (~_finite_nonzero(absmax)).nonzero().squeeze(1)  # the one host sync
    if odd.numel():
        _recode(flat.view(-1, block), odd, absmax, packed.view(-1, block // 2), lut, step // block)
    return Encoded(absmax, packed, rows.shape)


def _recode(blocks: torch.Tensor, odd: torch.Tensor, absmax: torch.Tensor, packed: torch.Tensor,
            lut: torch.Tensor, step: int) -> None:
    """The blocks ``odd`` of ``blocks`` (their absmax 0, infinite or NaN, already in
    ``absmax``) encoded again into their rows of ``packed`` by torchao's own nearest-level
    search (``quantize_tensor_nearest``: what :func:`_nearest` does for the values its
    two-level search cannot place, and the same as that search for every other value), at
    most ``step`` blocks at a time (the search holds 16 differences per value: a weight of
    zeros is all odd blocks). No host sync: ``odd`` is a device tensor of known length."""
    from foundryx.models.peft.torchao_nf4 import NF4Tensor

    for i in range(0, odd.numel(), step):
        which = odd[i:i + step]
        scaled = blocks[which].to(absmax.dtype)
        torch.div(scaled, absmax[which, None], out=scaled)
        codes = NF4Tensor.quantize_tensor_nearest(scaled.view(-1), lut).to(torch.uint8)
        packed[which] = (codes[::2] << 4 | codes[1::2]).view(len(which), -1)


def nf4(rows: torch.Tensor | Encoded, like: Any, dtype: torch.dtype,
        group: Any = None, start: int = 0) -> Any:
    """This rank's rows (``start`` on, or their :func:`nf4_encode`) as an NF4 shard of the
    type and block sizes of ``like`` (the meta NF4 shard FSDP2 made); the whole weight's scaler
    mean from the block maxima of every rank of ``group`` (None: this rank holds the whole
    weight), taken once per row range, in row order (ranks that hold the same rows, replicas
    or a tensor-parallel group, send them alike)."""
    from foundryx.models.peft.torchao_nf4 import nf4_from_parts

    block, scaler_block = like.block_size, like.scaler_block_size
    absmax, data, size = rows if isinstance(rows, Encoded) else nf4_encode(rows, block, dtype)
    blocks = absmax.numel()
    whole = absmax
    if group is not None and torch.distributed.get_world_size(group) > 1:
        n = torch.distributed.get_world_size(group)
        parts = [torch.empty_like(absmax) for _ in range(n)]
        torch.distributed.all_gather(parts, absmax, group=group)
        mine = torch.tensor([start], device=absmax.device)
        starts = [torch.empty_like(mine) for _ in range(n)]
        torch.distributed.all_gather(starts, mine, group=group)
        first = {int(s): p for s, p in reversed(list(zip(starts, parts)))}
        whole = torch.cat([first[s] for s in sorted(first)])
    mean = whole.mean()
    # torchao's double_quantize_scalers, on this rank's scaler blocks, around the whole mean
    centred = absmax - mean
    groups = centred.view(blocks // scaler_block, scaler_block)
    factor = 256 / (2 * groups.abs().max(dim=1).values)
    quantized_scalers = (groups * factor[:, None]).round().clamp(-128, 127).flatten().to(torch.int8)
    return nf4_from_parts(type(like), size, dtype, absmax.device, block_size=block,
                          scaler_block_size=scaler_block, quantized_data=data,
                          quantized_scalers=quantized_scalers,
                          quantization_factor=factor.contiguous(), scaler_mean=mean,
                          nf4=_nf4_lut(dtype).to(absmax.device))
