"""The LoRA fields of a model section (``peft_config``, ``pretrained_lora_id_or_path``,
``frozen_base``), declared once: every model section that supports LoRA (``mpt_causal_lm``'s
:class:`~foundryx.models.mpt.options.MPTOptions`, ``hf_causal_lm``'s
:class:`~foundryx.models.hf.HFCausalLMOptions`) inherits them, with their docs and their rule.
They are run options, applied to the built model from outside (``builders.build_model``), not
part of a model's own config."""

from __future__ import annotations

from dataclasses import dataclass, fields

from foundryx.config.types import option
from foundryx.models.peft.frozen_options import FrozenBaseOptions, frozen_base_problems
from foundryx.models.peft.options import LoraOptions


@dataclass(kw_only=True)
class LoraFields:
    """A model section's LoRA fields (keyword-only, so a section's own fields keep their
    order and defaults)."""

    peft_config: LoraOptions | None = option(
        "LoRA adapters (PEFT's field names; docs/finetuning.md): only they train. Applied to "
        "the built model from outside; not part of the model's own config", default=None)
    pretrained_lora_id_or_path: str | None = option(
        "a PEFT LoRA adapter folder to start from (adapter_config.json + "
        "adapter_model.safetensors); checked against peft_config, or peft_config is taken "
        "from it when absent (docs/finetuning.md)", default=None)
    frozen_base: FrozenBaseOptions | None = option(
        "with peft_config: store the frozen linear weights as nf4, fp8, int8 or bf16 and "
        "offload a share of them to host memory (docs/finetuning.md)", default=None)

    def lora_problems(self) -> list[str]:
        """The rule between the fields: a frozen base needs LoRA."""
        return frozen_base_problems(self.peft_config, self.frozen_base)


# the names of the LoRA fields (run options: not passed to a model's own config)
LORA_FIELDS = tuple(f.name for f in fields(LoraFields))
