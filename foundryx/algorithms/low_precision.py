"""``low_precision_layernorm``: Composer's LowPrecisionLayerNorm, saying when it does nothing."""

from __future__ import annotations

import logging

import torch
from composer.algorithms import LowPrecisionLayerNorm as _ComposerLPLN
from composer.core import Event, Precision, State
from composer.loggers import Logger

log = logging.getLogger("foundryx")


class LowPrecisionLayerNorm(_ComposerLPLN):
    """Replace the model's ``torch.nn.LayerNorm`` modules (``norm_type: layernorm``) with
    Composer's LPLayerNorm, which runs them in the autocast dtype instead of fp32. It applies
    under ``precision: amp_bf16`` or ``amp_fp16`` on a GPU; otherwise (fp32, CPU, a model without
    LayerNorm) it logs one line saying why it is not applied and leaves the model as it is."""

    def __init__(self) -> None:
        super().__init__(apply_at=Event.INIT)

    @staticmethod
    def why_not(state: State) -> str | None:
        precision = state.precision
        if precision not in (Precision.AMP_BF16, Precision.AMP_FP16):
            return (f"it acts only under autocast (precision: amp_bf16 or amp_fp16); this run's "
                    f"precision is {precision.value}")
        device = next((p.device.type for p in state.model.parameters()), "cpu")
        if device not in ("cuda", "meta"):
            return f"it is for GPUs (CUDA/ROCm); this run's model is on {device}"
        if not any(isinstance(m, torch.nn.LayerNorm) for m in state.model.modules()):
            return "the model has no torch.nn.LayerNorm (an MPT with norm_type: rmsnorm?)"
        return None

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        why = self.why_not(state)
        if why is not None:
            log.info("low_precision_layernorm: not applied: %s", why)
            return
        super().apply(event, state, logger)
        n = sum(type(m).__name__ == "LPLayerNorm" for m in state.model.modules())
        log.info("low_precision_layernorm: %d LayerNorm modules now run in %s", n,
                 state.precision.value)
