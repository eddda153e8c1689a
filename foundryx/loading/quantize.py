"""Quantize on load, the row-scaled formats: a rank turns its own rows of a frozen weight into
the ``frozen_base`` storage, bit for bit what quantizing the whole weight and then sharding it
gives. fp8 / int8 / bf16 (:class:`~foundryx.models.peft.rowwise.RowScaledTensor`): a scale per
output row, computed from that row alone, so a rank's rows need nothing from the others.

Rows are computed in chunks through one float32 scratch buffer per thread, reused for every
tensor (no whole-tensor float32 copy is allocated: allocating and first touching those was most
of the quantization's time, and its transient memory), with the same float32 operations, in the
same order, as :func:`~foundryx.models.peft.rowwise.quantize_rows` on the whole weight (less a
clamp that changes nothing, see :func:`rowwise`), one pass per chunk while it is in cache.

The per-thread scratch tensors (:func:`scratch_tensor`), the exact-cast rule (:func:`exact`)
and the one-pass row absmax (:func:`row_absmax`) are shared with NF4's CPU encoder
(:mod:`foundryx.loading.nf4_encode`). NF4 on load: :mod:`~foundryx.loading.nf4_codes` (levels
and codes), :mod:`~foundryx.loading.nf4_encode` (the C kernel's dispatch and the CPU chunk
path), :mod:`~foundryx.loading.nf4_device` (the device path), :mod:`~foundryx.loading.nf4_shard`
(the shard, from the block maxima every rank gathers).
"""

from __future__ import annotations

import threading

import torch

from foundryx.models.peft.rowwise import MIN_SCALE, QDTYPES, QMAX, RowScaledTensor

CHUNK = 1 << 18  # float32 elements of scratch per reader thread (1 MiB: stays in cache)
_scratch = threading.local()


def exact(src: torch.dtype, dst: torch.dtype) -> bool:
    """Whether every value of ``src`` is a value of ``dst`` (a cast that never rounds)."""
    wider = {torch.bfloat16: (torch.float32, torch.float64), torch.float16: (torch.float32, torch.float64),
             torch.float32: (torch.float64,)}
    return src == dst or dst in wider.get(src, ())


def scratch_tensor(name: str, n: int, dtype: torch.dtype) -> torch.Tensor:
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
    return scratch_tensor("rows", rows * cols, torch.float32).view(rows, cols)


SIGN_MASKS = {torch.bfloat16: (torch.int16, 0x7FFF), torch.float16: (torch.int16, 0x7FFF),
         torch.float32: (torch.int32, 0x7FFFFFFF)}


def row_absmax(c: torch.Tensor) -> torch.Tensor:
    """Per row, the float32 ``max(amax, -amin)`` of ``quantize_rows``, in one pass: the
    largest magnitude, found as the largest sign-cleared bit pattern (IEEE magnitudes order
    as their bits do, NaN above infinity, so a NaN row gives NaN as ``amax`` does); max and
    min never round, so a bfloat16 chunk's is its float32 copy's."""
    bits, mask = SIGN_MASKS[c.dtype]
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
        if c.dtype not in SIGN_MASKS:  # (float64): the float32 working copy's values
            c = w.copy_(c)
        torch.div(row_absmax(c), QMAX[kind], out=scale[i:j]).clamp_(min=MIN_SCALE)
        if c.dtype != torch.float32:
            c = w.copy_(c)  # the float32 working copy (exact from bfloat16 / float16)
        torch.div(c, scale[i:j, None], out=w)
        if kind == "int8":
            w.round_()
        qdata[i:j].copy_(w)
    return RowScaledTensor(qdata, scale, dtype=dtype)
