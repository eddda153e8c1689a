"""NF4 on load on a GPU (:func:`encode_on_device`): the CPU encoder's torch ops, bit for bit,
with at most one host sync per weight.
"""

from __future__ import annotations

import functools

import torch

from foundryx.loading.nf4_codes import (
    Encoded,
    finite_nonzero,
    levels,
    maxima_as_is,
    scale_blocks,
    searched,
)
from foundryx.models.peft.torchao_nf4 import NF4Tensor

# elements of an NF4 chunk on a GPU: ~40 bytes of transient device memory each (80 MiB); no
# cache to fit, and each chunk is a dozen kernel launches
DEVICE_CHUNK = 1 << 21


@functools.cache
def _device_lut(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The NF4 levels of ``dtype`` on ``device``, copied there once per process (a copy from
    the host per weight would be a host sync per weight)."""
    return levels(dtype).to(device)


def encode_on_device(rows: torch.Tensor, block: int, dtype: torch.dtype) -> Encoded:
    """:func:`~foundryx.loading.nf4_encode.nf4_encode` on a GPU (or any device; tests run it
    on CPU tensors): the same torch ops, bit for bit, with at most one host sync per weight
    rather than two per chunk (about 10^5 a rank for a 405B model, each one stalling the
    reader thread on the device's queue).

    The chunk loop never asks the host: each value's code comes from the two-level search
    alone (:func:`searched`), torchao's for every value of a block with a finite, nonzero
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
    as_is = maxima_as_is(flat.dtype, dtype)
    for s in range(0, n, step):
        e = min(s + step, n)
        scaled = torch.empty((e - s) // block, block, dtype=dtype, device=rows.device)
        scale_blocks(flat[s:e].view(-1, block), scaled, absmax[s // block:e // block], as_is)
        codes = searched(scaled.view(-1), lut)
        torch.bitwise_or(codes[::2] << 4, codes[1::2], out=packed[s // 2:e // 2])
    odd = (~finite_nonzero(absmax)).nonzero().squeeze(1)  # the one host sync
    if odd.numel():
        _recode(flat.view(-1, block), odd, absmax, packed.view(-1, block // 2), lut, step // block)
    return Encoded(absmax, packed, rows.shape)


def _recode(blocks: torch.Tensor, odd: torch.Tensor, absmax: torch.Tensor, packed: torch.Tensor,
            lut: torch.Tensor, step: int) -> None:
    """The blocks ``odd`` of ``blocks`` (their absmax 0, infinite or NaN, already in
    ``absmax``) encoded again into their rows of ``packed`` by torchao's own nearest-level
    search (``quantize_tensor_nearest``: what :func:`nearest` does for the values its
    two-level search cannot place, and the same as that search for every other value), at
    most ``step`` blocks at a time (the search holds 16 differences per value: a weight of
    zeros is all odd blocks). No host sync: ``odd`` is a device tensor of known length."""
    for i in range(0, odd.numel(), step):
        which = odd[i:i + step]
        scaled = blocks[which].to(absmax.dtype)
        torch.div(scaled, absmax[which, None], out=scaled)
        codes = NF4Tensor.quantize_tensor_nearest(scaled.view(-1), lut).to(torch.uint8)
        packed[which] = (codes[::2] << 4 | codes[1::2]).view(len(which), -1)
