"""NF4's levels and codes, and the scaling of a block by its absmax: what every NF4 encoder on
load shares (:mod:`~foundryx.loading.nf4_encode` on the CPU, :mod:`~foundryx.loading.nf4_device`
on a GPU), each bit for bit torchao's.

- :func:`levels`: the 16 NF4 levels of a dtype; :func:`nearest`: torchao's nearest-level code
  without its 16 comparisons per element (:func:`searched`, the two-level search alone);
- :func:`code_tables` / :func:`lookup_codes`: the code of each value by table look-ups on its
  top 16 bits; :func:`thresholds`: the 15 decision thresholds the C kernel compares with;
- :func:`scale_blocks`, :func:`finite_nonzero`, :func:`maxima_as_is`: torchao's
  ``get_block_absmax`` and ``blocks / scales``, and when a block's scaled values are in [-1, 1];
- :class:`Encoded`: a rank's rows encoded, before the whole weight's scaler mean is known.

torchao is imported here at module level (through :mod:`foundryx.models.peft.torchao_nf4`): every
process that imports :mod:`foundryx.loading` has imported it already, through transformers'
``modeling_utils`` (its torchao quantizer), on both torch legs.
"""

from __future__ import annotations

import functools
import sys
from typing import NamedTuple

import torch

from foundryx.loading.quantize import SIGN_MASKS, exact, row_absmax, scratch_tensor
from foundryx.models.peft.torchao_nf4 import NF4Tensor, to_nf4


def levels(dtype: torch.dtype) -> torch.Tensor:
    """The 16 NF4 levels of ``dtype``, ascending (torchao's ``NF4Tensor.nf4``)."""
    return to_nf4(torch.zeros(64, dtype=dtype), 64, 1).nf4


class Encoded(NamedTuple):
    """A rank's rows of an NF4 weight before the whole weight's scaler mean is known."""

    absmax: torch.Tensor
    codes: torch.Tensor
    shape: torch.Size


def nearest(scaled: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
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
    codes = searched(scaled, lut)
    odd = ~(scaled.abs() <= 1)  # NaN, or beyond the levels (never a scaled block's value)
    if odd.any():  # where roundings tie far levels: torchao's own search
        codes[odd] = NF4Tensor.quantize_tensor_nearest(scaled[odd], lut).to(torch.uint8)
    return codes


def searched(scaled: torch.Tensor, lut: torch.Tensor) -> torch.Tensor:
    """:func:`nearest`'s two-level search alone (uint8 codes): torchao's code for every value
    in [-1, 1], and a code of no meaning for NaN or anything beyond."""
    idx = torch.searchsorted(lut, scaled)
    hi = idx.clamp(max=lut.numel() - 1)
    lo = idx.sub_(1).clamp_(min=0)
    pick_hi = (scaled - lut[hi]).abs_() < (scaled - lut[lo]).abs_()
    return torch.where(pick_hi, hi, lo).to(torch.uint8)


# the top 16 bits of a float32 on this machine: the second half-word on a little-endian one
_HIGH_HALF = 1 if sys.byteorder == "little" else 0


@functools.cache
def code_tables(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per bucket of values (the value's top 16 bits, read as an unsigned index: one value of a
    16-bit dtype, an interval of float32), its NF4 code by :func:`nearest`; for float32 also
    a threshold per bucket: within [-1, 1] the code only grows with the value and the levels
    are further apart than a bucket is wide, so a bucket holds one code or two, the higher one
    from the threshold on (the bucket's smallest value that :func:`nearest` gives it; +inf
    for a bucket of one code). Buckets beyond [-1, 1] get the smaller of their two ends' codes
    and no threshold (:func:`lookup_codes` searches exactly for the values there)."""
    lut = levels(dtype)
    top = torch.arange(1 << 16, dtype=torch.int64)
    if dtype.itemsize == 2:
        return nearest(top.to(torch.int16).view(dtype), lut), None
    low = (top << 16).to(torch.int32).view(torch.float32)
    high = ((top << 16) | 0xFFFF).to(torch.int32).view(torch.float32)
    a, b = nearest(low, lut), nearest(high, lut)
    code = torch.minimum(a, b)
    threshold = torch.full((1 << 16,), float("inf"))
    inside = (low.abs() <= 1) & (high.abs() <= 1)
    for t in ((a != b) & inside).nonzero().squeeze(1).tolist():  # at most one per boundary
        values = ((t << 16) | torch.arange(1 << 16, dtype=torch.int64)).to(torch.int32).view(torch.float32)
        threshold[t] = values[nearest(values, lut) > code[t]].min()
    return code, threshold


def lookup_codes(scaled: torch.Tensor, lut: torch.Tensor, within: bool = False) -> torch.Tensor:
    """:func:`nearest` of ``scaled`` (1-D, contiguous) by table look-ups per element (its top
    16 bits as the index; for float32 also the bucket's threshold). ``within``: the caller
    knows every value is in [-1, 1] (a block scaled by its finite, nonzero absmax); otherwise
    NaN and values beyond go through the exact search. On the CPU the result is this thread's
    scratch tensor ``codes``, valid until its next call."""
    if scaled.dtype not in (torch.float32, torch.bfloat16, torch.float16) or scaled.device.type != "cpu":
        return nearest(scaled, lut)
    table, threshold = code_tables(scaled.dtype)
    n = scaled.numel()
    halves = scaled.view(torch.uint16)
    if threshold is not None:
        halves = halves[_HIGH_HALF::2]
    index = scratch_tensor("index", n, torch.int32).copy_(halves)
    codes = torch.index_select(table, 0, index, out=scratch_tensor("codes", n, torch.uint8))
    if threshold is None:  # a 16-bit dtype: the table holds every value's code
        return codes
    bound = torch.index_select(threshold, 0, index, out=scratch_tensor("bound", n, torch.float32))
    codes.add_(torch.ge(scaled, bound, out=scratch_tensor("above", n, torch.bool)))
    if not within:
        odd = (~(scaled.abs() <= 1)).nonzero().squeeze(1)  # NaN, or beyond the levels
        if odd.numel():
            codes[odd] = nearest(scaled[odd], lut)
    return codes


@functools.cache
def thresholds(dtype: torch.dtype) -> torch.Tensor:
    """NF4's 15 decision thresholds for values of ``dtype`` in [-1, 1], ascending, as float32:
    the smallest value of ``dtype`` that :func:`nearest` puts above each level, so that a
    value's code is the number of thresholds at or below it (the code only grows with the
    value there, which this checks)."""
    table, threshold = code_tables(dtype)
    if threshold is not None:  # float32: one bucket holds each boundary, its threshold exact
        return threshold[threshold.isfinite()].sort().values
    values = torch.arange(1 << 16, dtype=torch.int64).to(torch.int16).view(dtype).float()
    inside = values.abs() <= 1
    values, order = values[inside].sort(stable=True)
    codes = table[inside][order]
    assert bool((codes[1:] >= codes[:-1]).all()), dtype
    return torch.stack([values[codes > k].min() for k in range(15)])


def maxima_as_is(src: torch.dtype, dtype: torch.dtype) -> bool:
    """Whether rows of ``src`` have their block maxima found on the rows as they are, before
    the copy to ``dtype`` (max never rounds): every value of ``src`` is one of ``dtype``
    (bfloat16 for a float32 NF4) and :func:`row_absmax` reads its bits."""
    return exact(src, dtype) and src in SIGN_MASKS


def scale_blocks(src: torch.Tensor, scaled: torch.Tensor, am: torch.Tensor, as_is: bool) -> None:
    """``src``'s blocks (rows) copied into ``scaled`` (of the NF4 dtype: the cast ``to``
    makes), their absmax into ``am``, and ``scaled`` divided by it in place: torchao's
    ``get_block_absmax`` and ``blocks / scales``."""
    scaled.copy_(src)
    if as_is:
        am.copy_(row_absmax(src))
    else:
        torch.amax(scaled.abs(), dim=1, out=am)
    torch.div(scaled, am[:, None], out=scaled)


def finite_nonzero(am: torch.Tensor) -> torch.Tensor:
    """Per block, whether its absmax scales it into [-1, 1]: neither 0 (0/0 is NaN), infinite
    (inf/inf) nor NaN. A finite, nonzero absmax does: ``|x| <= am`` gives ``|x / am| <= 1``
    after the division's rounding too (1 is a value of every dtype)."""
    return (am > 0) & (am < float("inf"))
