"""``CausalLMBase``: Composer's HuggingFaceModel for foundryx's causal LMs, without the scan
of every transformers model class that its constructor makes.

``HuggingFaceModel.__init__`` (Composer 0.32.1, frozen upstream) calls
``_is_registered_causal_lm``, which lists transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING`` and so
imports every causal-LM modeling module transformers ships (~200). Measured on a 2-core machine:
5.5 s per process, and one of those modules calls ``torch.compile`` at import, which starts
inductor's compile-worker pool (two more Python processes) and costs 3.3 s more at exit. The
answer only decides ``shift_labels`` when it is not given and a warning when it is false;
foundryx's models are causal LMs and pass ``shift_labels=True``, so the scan is skipped for them.
"""

from __future__ import annotations

from typing import Any

from composer.models import HuggingFaceModel
from composer.models import huggingface as composer_hf


class CausalLMBase(HuggingFaceModel):
    """A HuggingFaceModel whose wrapped model is a causal LM (labels shifted by one)."""

    def __init__(self, **kwargs: Any):
        scan = composer_hf._is_registered_causal_lm
        composer_hf._is_registered_causal_lm = lambda model: True
        try:
            super().__init__(shift_labels=True, **kwargs)
        finally:
            composer_hf._is_registered_causal_lm = scan
