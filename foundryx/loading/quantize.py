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
"""

from __future__ import annotations

from typing import Any

import torch

from foundryx.models.peft.rowwise import RowScaledTensor, quantize_rows


def rowwise(rows: torch.Tensor, kind: str, dtype: torch.dtype) -> RowScaledTensor:
    """``rows`` (any float dtype) as a RowScaledTensor of ``kind`` that dequantizes to ``dtype``.
    For float32 the checkpoint's rows are quantized as they are: ``quantize_rows`` makes its one
    float32 working copy (exact from any float), so a ``rows.to(float32)`` first would only be a
    second full-size float32 copy, the same bits."""
    qdata, scale = quantize_rows(rows if dtype == torch.float32 else rows.to(dtype), kind)
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
