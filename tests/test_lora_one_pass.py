"""LoRA's adapter path in one pass (issue 51, ``peft_config.one_pass``, on by default):
the same numbers as PEFT's own layer, checked against a float64 reference with the dropout's
own mask, through training steps of a Llama, on every frozen base, and where it steps aside."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from hf_tiny import HF_CONFIGS

from foundryx import builders
from foundryx.models.peft.one_pass import OnePassLoraLinear, adapter_add

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("p", [0.0, 0.3])
@pytest.mark.parametrize("contiguous", [True, False])
def test_the_adapter_path_equals_a_float64_reference_with_the_same_mask(p, contiguous):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 7, 16, dtype=torch.float64, generator=g, requires_grad=True)
    a = torch.randn(4, 16, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(12, 4, dtype=torch.float64, generator=g, requires_grad=True)
    w = torch.randn(12, 16, dtype=torch.float64, generator=g)
    up = torch.randn(3, 7, 12, dtype=torch.float64, generator=g)  # the upstream gradient

    def base():
        out = x @ w.t()
        return out if contiguous else out.transpose(0, 1).contiguous().transpose(0, 1)

    torch.manual_seed(5)
    got = adapter_add(base(), x, a, b, 2.5, p, True)
    got_grads = torch.autograd.grad((got * up).sum(), (x, a, b))
    torch.manual_seed(5)  # the same draw: the mask the one pass used
    h, _ = torch.native_dropout(x.reshape(-1, 16), p, True) if p else (x.reshape(-1, 16), None)
    want = base() + 2.5 * (h @ a.t() @ b.t()).view(3, 7, 12)
    want_grads = torch.autograd.grad((want * up).sum(), (x, a, b))
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for name, gg, ww in zip("xab", got_grads, want_grads):
        torch.testing.assert_close(gg, ww, rtol=0, atol=1e-12, msg=name)
    if p:  # a real mask: some inputs dropped (the comparison above used it)
        assert 0 < (h == 0).sum() < h.numel()


SECTION = {"name": "hf_causal_lm", "pretrained": False,
           "config": {"model_type": "llama", **HF_CONFIGS["llama"]},
           "peft_config": {"target_modules": "all-linear", "r": 4, "lora_alpha": 16,
                           "lora_dropout": 0.0}}


def _build(one_pass: bool, frozen: str | None = None):
    section = {**SECTION, "peft_config": {**SECTION["peft_config"], "one_pass": one_pass}}
    if frozen:
        section["frozen_base"] = {"dtype": frozen}
    cfg = SimpleNamespace(model=section, optimizer={"name": "adamw", "lr": 1e-2})
    torch.manual_seed(0)
    model = builders.build_model(cfg, None)
    return model, builders.build_optimizer(cfg, model)


def _steps(one_pass: bool, n: int = 8, frozen: str | None = None, autocast: bool = False):
    model, opt = _build(one_pass, frozen)
    ids = torch.randint(0, HF_CONFIGS["llama"]["vocab_size"], (n, 2, 24),
                        generator=torch.Generator().manual_seed(1))
    losses, first = [], {}
    model.train()
    for i in range(n):
        batch = {"input_ids": ids[i]}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            loss = model.loss(model(batch), batch)
        loss.backward()
        if i == n - 1:  # B is no longer zero: A's gradients too
            first = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return model, losses, first


def test_eight_llama_lora_steps_equal_peft_s_own_layer_within_float32_rounding():
    model, ours, our_grads = _steps(True)
    _, peft, peft_grads = _steps(False)
    assert sum(isinstance(m, OnePassLoraLinear) for m in model.modules()) == 14  # 2 x q..down
    assert ours == pytest.approx(peft, rel=1e-5)
    assert set(our_grads) == set(peft_grads) and len(our_grads) == 28
    nonzero = 0
    for name, g in our_grads.items():  # the last step's
        want = peft_grads[name]
        assert (g - want).norm() <= 1e-3 * want.norm(), (name, g.norm(), want.norm())
        nonzero += bool(want.norm() > 0)
    assert nonzero == 28


@pytest.mark.parametrize("frozen", ["bf16", "int8", "fp8", "nf4"])
def test_every_frozen_base_takes_the_one_pass_with_peft_s_numbers(frozen):
    """Under bf16 autocast (the GPU recipe's precision) on each low-precision base: the loss
    of PEFT's own layer within bf16 rounding, adapters' gradients in their float32."""
    model, ours, grads = _steps(True, n=2, frozen=frozen, autocast=True)
    _, peft, _ = _steps(False, n=2, frozen=frozen, autocast=True)
    assert ours == pytest.approx(peft, rel=2e-2)
    assert all(g.dtype == torch.float32 for g in grads.values())


def test_where_the_one_pass_does_not_apply_peft_s_forward_runs(caplog):
    model, _ = _build(True)
    layer = next(m for m in model.modules() if isinstance(m, OnePassLoraLinear))
    x = torch.randn(2, 5, layer.in_features)
    assert layer.applies((), {})
    layer.merge()
    assert not layer.applies((), {})  # merged: the base holds the update
    merged = layer(x)
    layer.unmerge()
    torch.testing.assert_close(layer(x), merged, rtol=1e-5, atol=1e-6)
    layer.one_pass = False  # as tensor parallelism sets it
    assert not layer.applies((), {})
    with caplog.at_level(logging.INFO, logger="foundryx"):
        _build(True)
    assert any("adapter path in one pass" in r.getMessage() for r in caplog.records)
