"""NF4 on load, the shard (:func:`nf4`): a rank's encoded rows as an NF4 shard, their scalers
double-quantized around the whole weight's mean. That mean is the one statistic a rank cannot
compute alone: the ranks all-gather their block maxima (one number per 64 weights,
:func:`foundryx.parallel.dist.all_gather_rows`) and every rank takes the same ``mean()`` of the
same vector, so it is the full-weight value exactly. Blocks never straddle ranks: each rank's
rows are a whole number of scaler blocks, which ``frozen_base`` checks when it picks the scaler
block.
"""

from __future__ import annotations

from typing import Any

import torch

from foundryx.loading.nf4_codes import Encoded, levels
from foundryx.loading.nf4_encode import nf4_encode
from foundryx.models.peft.torchao_nf4 import nf4_from_parts
from foundryx.parallel.dist import all_gather_rows


def nf4(rows: torch.Tensor | Encoded, like: Any, dtype: torch.dtype,
        group: Any = None, start: int = 0) -> Any:
    """This rank's rows (``start`` on, or their :func:`nf4_encode`) as an NF4 shard of the
    type and block sizes of ``like`` (the meta NF4 shard FSDP2 made); the whole weight's scaler
    mean from the block maxima of every rank of ``group`` (None: this rank holds the whole
    weight), taken once per row range, in row order (ranks that hold the same rows, replicas
    or a tensor-parallel group, send them alike)."""
    block, scaler_block = like.block_size, like.scaler_block_size
    absmax, data, size = rows if isinstance(rows, Encoded) else nf4_encode(rows, block, dtype)
    blocks = absmax.numel()
    mean = all_gather_rows(absmax, start, group).mean()
    # torchao's double_quantize_scalers, on this rank's scaler blocks, around the whole mean
    centred = absmax - mean
    groups = centred.view(blocks // scaler_block, scaler_block)
    factor = 256 / (2 * groups.abs().max(dim=1).values)
    quantized_scalers = (groups * factor[:, None]).round().clamp(-128, 127).flatten().to(torch.int8)
    return nf4_from_parts(type(like), size, dtype, absmax.device, block_size=block,
                          scaler_block_size=scaler_block, quantized_data=data,
                          quantized_scalers=quantized_scalers,
                          quantization_factor=factor.contiguous(), scaler_mean=mean,
                          nf4=levels(dtype).to(absmax.device))
