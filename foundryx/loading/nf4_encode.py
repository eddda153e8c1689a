"""NF4 on load on the CPU: a rank's rows to their block maxima and packed 4-bit codes
(:func:`nf4_encode`), bit for bit torchao's, by the first of these that can:

- the C kernel (:mod:`foundryx.kernels.nf4_cpu`: one pass per element, the codes from
  :func:`~foundryx.loading.nf4_codes.thresholds`), when a C compiler is there and no block
  scales out of [-1, 1];
- torch ops a chunk of blocks at a time (:func:`_encode_in_chunks`: no whole-weight copy, no
  16-level comparison tensor) through this thread's scratch tensors.

A device tensor goes to :func:`foundryx.loading.nf4_device.encode_on_device`. Needs nothing from
other ranks: it runs in a reader thread; :func:`foundryx.loading.nf4_shard.nf4` finishes with the
one collective.
"""

from __future__ import annotations

import sys

import torch

from foundryx.kernels import nf4_cpu
from foundryx.loading.nf4_codes import (
    Encoded,
    finite_nonzero,
    levels,
    lookup_codes,
    maxima_as_is,
    scale_blocks,
    thresholds,
)
from foundryx.loading.nf4_device import encode_on_device
from foundryx.loading.quantize import CHUNK, scratch_tensor


def nf4_encode(rows: torch.Tensor, block: int, dtype: torch.dtype) -> Encoded:
    """``(absmax per block, packed 4-bit codes, shape)`` of ``rows`` as ``dtype``: what torchao's
    ``get_block_absmax`` and ``convert_to_norm_float_weight`` give for ``rows.to(dtype)``,
    bit for bit. On the CPU by :mod:`foundryx.kernels.nf4_cpu` (one pass per element, the
    codes from :func:`thresholds`); without a C compiler, or for a slice with a block that
    scales out of [-1, 1], by :func:`_encode_in_chunks`; on a GPU by :func:`encode_on_device`.
    Needs nothing from other ranks: it runs in a reader thread;
    :func:`~foundryx.loading.nf4_shard.nf4` finishes with the one collective."""
    if rows.device.type != "cpu":
        return encode_on_device(rows, block, dtype)
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
    return _encode_in_chunks(flat, block, dtype, absmax, packed, rows.shape)


def _encode_in_chunks(flat: torch.Tensor, block: int, dtype: torch.dtype, absmax: torch.Tensor,
                      packed: torch.Tensor, shape: torch.Size) -> Encoded:
    """:func:`nf4_encode` of ``flat`` (the rows, 1-D) into ``absmax`` and ``packed`` by torch
    ops a chunk of blocks at a time (no whole-weight copy, no 16-level comparison tensor; see
    :func:`~foundryx.loading.nf4_codes.nearest`) through this thread's scratch tensors."""
    n = flat.numel()
    lut = levels(dtype)
    step = max(1, CHUNK // block) * block
    as_is = maxima_as_is(flat.dtype, dtype)
    for s in range(0, n, step):
        e = min(s + step, n)
        # the chunk as ``dtype`` (the cast ``to`` makes) in a scratch copy, divided in place
        # below (a promoting division would run far slower)
        scaled = scratch_tensor("scaled", e - s, dtype).view(-1, block)
        am = absmax[s // block:e // block]
        scale_blocks(flat[s:e].view(-1, block), scaled, am, as_is)
        within = bool(finite_nonzero(am).all())  # no 0/0, inf/inf: no NaN
        _pack(lookup_codes(scaled.view(-1), lut, within), packed[s // 2:e // 2])
    return Encoded(absmax, packed, shape)


def _pack(codes: torch.Tensor, out: torch.Tensor) -> None:
    """Two 4-bit codes a byte, the first in the high half (torchao's order), into ``out``:
    read as 16-bit words (little-endian: the first code in the low byte), ``(w << 4) | (w >>
    8)`` holds the byte in its low 8 bits, which the copy into ``out`` keeps."""
    if sys.byteorder != "little":
        torch.bitwise_or(codes[::2] << 4, codes[1::2], out=out)
        return
    words = codes.view(torch.int16)
    high = torch.bitwise_left_shift(words, 4, out=scratch_tensor("high", words.numel(), torch.int16))
    low = torch.bitwise_right_shift(words, 8, out=scratch_tensor("low", words.numel(), torch.int16))
    out.copy_(high.bitwise_or_(low))
