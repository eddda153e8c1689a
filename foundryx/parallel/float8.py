"""``float8``: torchao's float8 training applied from outside the model (as torchtitan's model
converters do), before activation checkpointing, compile and FSDP2.

Each chosen ``nn.Linear`` becomes torchao's ``Float8Linear``: its matmuls (forward and both
backward ones) run in float8 (e4m3) on the GPU's FP8 tensor cores with dynamic scales, per
tensor (``tensorwise``) or per row (``rowwise``: finer scales, closer to bf16, a little slower);
the weights, gradients and optimizer state stay in their usual dtypes. Layers whose dimensions
are not multiples of 16 (float8 GEMMs need them) and the layers named in ``float8.skip``
(default: the output head) keep their precision. Whether the GPU has FP8 tensor cores, and
what float8 cannot go with (amp_fp8, LoRA, tensor parallelism), is checked with the rest of the
config, before anything is built (:mod:`foundryx.config.hardware`).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import logging

from torch import nn

from foundryx.config.schema import Float8Config
from foundryx.errors import ConfigError

log = logging.getLogger(__name__)

FP8_ALIGN = 16  # float8 GEMMs (torch._scaled_mm) need both matrix dimensions divisible by 16


def float8_targets(model: nn.Module, skip: list[str]) -> tuple[list[str], list[str]]:
    """(names of the linear layers float8 converts, names left out and why)."""
    chosen, left = [], []
    for name, m in model.named_modules():
        if type(m) is not nn.Linear:
            continue
        short = name.rsplit(".", 1)[-1]
        if any(fnmatch.fnmatch(name, p) or fnmatch.fnmatch(short, p) for p in skip):
            left.append(f"{name} (float8.skip)")
        elif m.in_features % FP8_ALIGN or m.out_features % FP8_ALIGN:
            left.append(f"{name} ({m.in_features}x{m.out_features}: not multiples of {FP8_ALIGN})")
        else:
            chosen.append(name)
    return chosen, left


def apply_float8(model: nn.Module, options: Float8Config, *, emulate: bool = False) -> int:
    """Convert ``model``'s chosen linear layers to torchao's Float8Linear in place; returns how
    many. ``emulate`` (tests on CPU): torchao computes the float8 matmuls in higher precision."""
    # lazy: torchao is a heavy import, needed only when float8 is on
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    chosen, left = float8_targets(model, options.skip)
    if not chosen:
        raise ConfigError(["float8.enabled: the model has no nn.Linear layer float8 can convert "
                           f"(left out: {', '.join(left) or 'none'}); turn float8 off"])
    config = Float8LinearConfig.from_recipe_name(options.recipe)
    if emulate:
        config = dataclasses.replace(config, emulate=True)
    names = set(chosen)
    convert_to_float8_training(model, config=config,
                               module_filter_fn=lambda m, fqn: fqn in names)
    log.info("float8: %d linear layers train in float8 (torchao, %s scaling); %d keep their "
             "precision%s", len(chosen), options.recipe, len(left),
             f" ({', '.join(left[:4])}{', ...' if len(left) > 4 else ''})" if left else "")
    return len(chosen)
