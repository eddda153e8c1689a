"""``model.peft_config``: LoRA's options, with PEFT's own field names (as LLM Foundry has them).

Declared here once and used as a field of every model section that supports LoRA
(``mpt_causal_lm``, ``hf_causal_lm``); the one validator checks it with the rest of the model
section. Adapters are applied by :func:`foundryx.models.peft.lora.apply_lora` after the model
is built and before parallelism.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from foundryx.config.types import option

ALL_LINEAR = "all-linear"

# PEFT's other methods: named, so a config naming one is told why rather than "not LORA".
OTHER_PEFT_TYPES = ("ADALORA", "IA3", "LOHA", "LOKR", "OFT", "BOFT", "VERA", "PREFIX_TUNING",
                    "PROMPT_TUNING", "P_TUNING", "ADAPTION_PROMPT", "LN_TUNING", "XLORA",
                    "FOURIERFT", "HRA", "VBLORA")
_ONLY_LORA = "foundryx trains LoRA only; write peft_type: LORA (or remove peft_config for full fine-tuning)"


@dataclass
class LoraOptions:
    """``peft_config``: LoRA adapters on the linear layers named by ``target_modules``; only
    the adapters train."""

    target_modules: list[str] | Literal["all-linear"] = option(
        "the linear layers to adapt: a list of module names (a name matches a module whose "
        "dotted path is it or ends with '.<name>', e.g. q_proj or Wqkv), or all-linear (every "
        "linear layer but the output projection)")
    peft_type: Literal["LORA"] = option(
        "the PEFT method; only LORA", default="LORA",
        unsupported={t: _ONLY_LORA for t in OTHER_PEFT_TYPES})
    r: int = option("rank of each adapter (at most the smaller dimension of every target)",
                    default=8, gt=0)
    lora_alpha: float = option("scaling numerator: the update is (lora_alpha / r) B A x "
                               "(lora_alpha / sqrt(r) with use_rslora)", default=8, gt=0)
    lora_dropout: float = option("dropout on the adapters' input", default=0.0, ge=0, lt=1)
    use_rslora: bool = option("rank-stabilised scaling lora_alpha / sqrt(r)", default=False)
    one_pass: bool = option(
        "the adapter path in one pass (foundryx's LoRA layer: no float32 copy of the input, "
        "dropout in the compute dtype, B's output added into the base output in place, "
        "backward through rank r first); false: PEFT's own lora.Linear forward",
        default=True)

    def problems(self) -> list[str]:
        if isinstance(self.target_modules, list) and not self.target_modules:
            return ["target_modules: an empty list adapts nothing; name modules (e.g. [q_proj, "
                    "v_proj]) or write all-linear"]
        return []

