"""The judge of the LoRA export tests, run as its own process with plain transformers + peft
(it never imports foundryx): logits of a PEFT adapter on its base and of a merged export.

Both run in float64 (the stored float32 weights, exactly widened), as the trained model does in
the tests: what is compared is then the exported weights, which a wrong name, slice, scale or
merge changes far beyond 1e-5, and not the rounding of two float32 implementations (MPT's and
Llama's, merged and unmerged), which alone differ by about 1e-5 on these logits.

    python peft_judge.py BASE ADAPTER MERGED IDS.pt OUT.pt
"""

import sys

import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM


def main(base: str, adapter: str, merged: str, ids_path: str, out: str) -> None:
    ids = torch.load(ids_path, weights_only=True)
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapter).eval().double()
    plain = AutoModelForCausalLM.from_pretrained(merged).eval().double()
    with torch.no_grad():
        result = {"adapter": model(input_ids=ids).logits, "merged": plain(input_ids=ids).logits,
                  "base": model.get_base_model().__class__.__name__,
                  "merged_class": type(plain).__name__}
    assert not any(name.startswith("foundryx") for name in sys.modules), "imported foundryx"
    torch.save(result, out)


if __name__ == "__main__":
    main(*sys.argv[1:6])
