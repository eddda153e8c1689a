"""The judge of the model-family tests, run as its own process with plain transformers + peft
(never foundryx), possibly of the other torch leg: for each ``(base, adapter)`` folder pair, load
the base, the adapter and its tokenizer as a Hugging Face user does and report what they hold
and give.

    python family_judge.py CASES.json IDS.pt OUT.pt
"""

import json
import sys

import torch
import transformers
from peft import PeftModel
from peft.utils import get_peft_model_state_dict
from transformers import AutoModelForCausalLM, AutoTokenizer


def main(cases_path: str, ids_path: str, out: str) -> None:
    ids = torch.load(ids_path, weights_only=True)
    result = {"transformers": transformers.__version__}
    for name, (base, adapter) in json.loads(open(cases_path).read()).items():
        plain = AutoModelForCausalLM.from_pretrained(base).eval()
        with torch.no_grad():
            before = plain(input_ids=ids).logits.float()
        model = PeftModel.from_pretrained(plain, adapter).eval()
        with torch.no_grad():
            after = model(input_ids=ids).logits.float()
        result[name] = {"class": type(model.get_base_model()).__name__,
                        "adapter": {k: v.float() for k, v in get_peft_model_state_dict(model).items()},
                        "finite": bool(torch.isfinite(after).all()),
                        "tokens": AutoTokenizer.from_pretrained(adapter)("the king")["input_ids"],
                        "changed": float((after - before).abs().max())}
    assert not any(n.startswith("foundryx") for n in sys.modules), "imported foundryx"
    torch.save(result, out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
