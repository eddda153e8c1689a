"""The judge of the LoRA export tests, run as its own process with plain transformers + peft
(it never imports foundryx): logits of a PEFT adapter on its base and of a merged export.

    python peft_judge.py BASE ADAPTER MERGED IDS.pt OUT.pt
"""

import sys

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM


def main(base: str, adapter: str, merged: str, ids_path: str, out: str) -> None:
    ids = torch.load(ids_path, weights_only=True)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval()
    plain = AutoModelForCausalLM.from_pretrained(merged).eval()
    with torch.no_grad():
        result = {"adapter": model(input_ids=ids).logits, "merged": plain(input_ids=ids).logits,
                  "base": model.get_base_model().__class__.__name__,
                  "merged_class": type(plain).__name__}
    assert not any(name.startswith("foundryx") for name in sys.modules), "imported foundryx"
    torch.save(result, out)


if __name__ == "__main__":
    main(*sys.argv[1:6])
