"""What a model's tensor-parallel plan allows: finding it, the degrees it admits, and the
messages for a degree it does not (or an operator this torch cannot split)."""

from __future__ import annotations

import math
import re
from typing import Any

import torch
from torch import nn

from foundryx.errors import ConfigError
from foundryx.parallel.tp_kv import kv_problem

PLAN_HOOK = "foundryx_tp_plan"  # HF models have a tp_plan of their own
# The models that declare a plan (said when a model without one asks for tp).
MODELS_WITH_PLANS = ("mpt_causal_lm (MPT)",
                     "hf_causal_lm with a Llama, Mistral/Ministral, Qwen2, Qwen3 or Gemma 3 "
                     "model")


def find_plan(model: nn.Module,
              hook: str = PLAN_HOOK) -> tuple[str, nn.Module, dict[str, Any]] | None:
    """``(prefix, owner, plan)`` of the first owner (the model, then its direct children)
    that declares a plan through ``hook`` (the tensor-parallel plan's by default); None when
    none does (or its plan is None)."""
    for name, owner in (("", model), *model.named_children()):
        fn = getattr(owner, hook, None)
        if callable(fn):
            plan = fn()
            if plan is not None:
                return (f"{name}." if name else ""), owner, plan
    return None


def valid_degrees(numbers: dict[str, int]) -> list[int]:
    g = 0
    for v in numbers.values():
        g = math.gcd(g, int(v))
    return [d for d in range(1, g + 1) if g % d == 0] if g else [1]


def plan_problems(model: nn.Module, tp: int, model_name: str = "the model") -> list[str]:
    """What stops ``model`` from running at tensor-parallel degree ``tp`` (empty: nothing)."""
    if tp == 1:
        return []
    found = find_plan(model)
    if found is None:
        return [f"parallelism.tp: {tp}, but {model_name} declares no tensor-parallel plan; "
                f"models with one: {', '.join(MODELS_WITH_PLANS)} (or set tp: 1)"]
    plan = found[2]
    if plan.get("unsupported"):
        return [f"parallelism.tp: {tp}: {plan['unsupported']} (or set tp: 1)"]
    divisible, kv = plan.get("divisible", {}), plan.get("kv_heads")
    bad = {k: v for k, v in divisible.items() if int(v) % tp}
    if not bad and kv_problem(kv, tp) is None:
        return []
    degrees = [d for d in valid_degrees(divisible) if kv_problem(kv, d) is None]
    nearest = min(degrees, key=lambda d: (abs(d - tp), -d))
    valid = f"valid degrees: {', '.join(map(str, degrees))} (nearest: {nearest})"
    if not bad:
        return [f"{kv_problem(kv, tp)}; {valid}"]
    numbers = ", ".join(f"{k}={v}" for k, v in divisible.items())
    return [f"parallelism.tp: {tp} does not divide {', '.join(bad)} of the model ({numbers}); "
            f"{valid}"]


TESTED_TORCH = ("2.7.0", "2.15.0")  # the two legs of make test; tests/test_tp.py runs on both
_MISSING_OP = re.compile(r"Operator (\S+) does not have a sharding strategy registered")


def missing_op_error(err: BaseException, tp: int) -> ConfigError | None:
    """The error to show for ``err`` when it is DTensor saying that this torch has no
    tensor-parallel rule for an operator the model runs (None: it is something else)."""
    found = _MISSING_OP.search(str(err))
    if tp == 1 or found is None:
        return None
    return ConfigError([
        f"parallelism.tp: {tp}: torch {torch.__version__} has no tensor-parallel (DTensor) rule "
        f"for {found.group(1)}, which this model runs; foundryx's tensor parallelism is tested "
        f"on torch {' and '.join(TESTED_TORCH)} (make install-modern installs "
        f"{TESTED_TORCH[-1]}); use one of those, or tp: 1"])
