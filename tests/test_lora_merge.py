"""``foundryx export --merged`` folds LoRA adapters into their layers
(:func:`foundryx.export.lora.merge_adapters`): for plain (not fused) layers, PEFT's
``lora.Linear`` on every linear layer of a tiny Hugging Face Llama, each merged weight is
``W + s * B @ A`` (``s = alpha / r``, or ``alpha / sqrt(r)`` with rslora) computed here in
float64 and rounded once to the weight's dtype, and the merged model gives the adapted
model's logits. (Fused layers' slices: tests/test_lora_checkpoints.py.)"""

from __future__ import annotations

import copy
import math

import pytest
import torch
from hf_tiny import HF_CONFIGS, VOCAB

from foundryx.export.lora import merge_adapters
from foundryx.models.peft.adapters import is_adapter_key
from foundryx.models.peft.lora import apply_lora
from foundryx.models.peft.options import LoraOptions

pytestmark = pytest.mark.usefixtures("one_thread")

# the unit roundoff of one rounding to each dtype (relative error of round-to-nearest)
UNIT = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}


def adapted_llama(dtype: torch.dtype, rslora: bool) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **HF_CONFIGS["llama"]))
    apply_lora(model, LoraOptions(target_modules="all-linear", r=4, lora_alpha=8,
                                  use_rslora=rslora))
    with torch.no_grad():  # B is zero at init: a merge that drops it would pass unnoticed
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.5)
    return model.to(dtype).eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("rslora", [False, True], ids=["alpha/r", "rslora"])
def test_merging_plain_layers_adds_the_scaled_product_once_rounded(dtype, rslora):
    model = adapted_llama(dtype, rslora)
    scale = 8 / (math.sqrt(4) if rslora else 4)
    want = {}
    for name, module in model.named_modules():
        if hasattr(module, "lora_A") and hasattr(module, "base_layer"):
            w = module.base_layer.weight.double()
            a, b = module.lora_A["default"].weight.double(), module.lora_B["default"].weight.double()
            want[f"{name}.weight"] = w + scale * (b @ a)
    assert len(want) == 7 * HF_CONFIGS["llama"]["num_hidden_layers"]  # q k v o gate up down
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        adapted = copy.deepcopy(model).double()(input_ids=ids).logits

    merged = merge_adapters(model)
    assert not [n for n, _ in merged.named_parameters() if is_adapter_key(n)]
    weights = dict(merged.named_parameters())
    for name, exact in want.items():
        got = weights[name]
        assert type(merged.get_submodule(name.removesuffix(".weight"))) is torch.nn.Linear
        assert got.dtype == dtype, name
        err = ((got.double() - exact).abs() / exact.abs()).max().item()
        assert err <= UNIT[dtype], (name, err)
    if dtype == torch.float32:
        with torch.no_grad():
            logits = merged.double()(input_ids=ids).logits
        assert (logits - adapted).abs().max() <= 1e-5
