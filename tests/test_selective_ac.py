"""``activation_checkpointing.mode: selective``: the same loss and gradients as no
checkpointing, with saved activations between none and a full checkpoint of each block."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from foundryx.config.schema import ActivationCheckpointingConfig, CompileConfig
from foundryx.errors import ConfigError
from foundryx.models.mpt.configuration import MPTConfig
from foundryx.models.mpt.modeling import MPTForCausalLM, causal_lm_loss
from foundryx.parallel.parallelize import apply_block_policies


def tiny():
    torch.manual_seed(0)
    return MPTForCausalLM(MPTConfig(d_model=64, n_heads=4, n_layers=3, max_seq_len=32,
                                    vocab_size=96, no_bias=True))


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func._overloadpacket.__name__ in ("mm", "addmm", "bmm")
        return func(*args, **(kwargs or {}))


def step(model, x):
    """Loss, gradients and the matmuls the backward ran (its own and any recomputed)."""
    loss = causal_lm_loss(model(x).logits, x)
    with CountMatmuls() as count:
        loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()], count.n


def test_selective_keeps_gradients_and_recomputes_between_none_and_full():
    x = torch.randint(0, 96, (2, 32))
    ref = tiny()
    results = {"none": step(ref, x)}
    for mode in ("full", "selective"):
        model = tiny()
        summary = apply_block_policies(
            model, ActivationCheckpointingConfig(enabled=True, mode=mode),
            CompileConfig(enabled=False), torch.device("cpu"))
        assert summary == [f"{'selective ' if mode == 'selective' else ''}activation "
                           "checkpointing on 3 modules"]
        results[mode] = step(model, x)
    for mode in ("full", "selective"):
        torch.testing.assert_close(results[mode][0], results["none"][0])
        for a, b in zip(results[mode][1], results["none"][1]):
            torch.testing.assert_close(a, b)
    none, full, selective = (results[m][2] for m in ("none", "full", "selective"))
    assert none < selective < full, (none, selective, full)  # matmuls recomputed: 0 < some < all


def test_the_policy_keeps_every_other_matmul_and_attention():
    from torch.utils.checkpoint import CheckpointPolicy

    from foundryx.parallel.selective_ac import policy

    decide = policy({"forward": 0, "recompute": 0})
    ctx = type("Ctx", (), {"is_recompute": False})()
    aten = torch.ops.aten
    x, w, r = torch.empty(8, 16), torch.empty(16, 16), torch.empty(16, 4)
    got = [decide(ctx, op, *args) for op, args in (
        (aten.mm.default, (x, w)), (aten.mm.default, (x, r)), (aten.mm.default, (x, w)),
        (aten.add.Tensor, (x, x)),
        (aten._scaled_dot_product_efficient_attention.default, ()),
        (aten.mm.default, (x, r)),
        (aten.addmm_.default, (x, x[:, :4], r.t())),  # into the kept 8 x 16 product: kept
        (aten.addmm_.default, (x[:, :4], x, r)),  # into the recomputed 8 x 4 one: recomputed
        (aten.addmm.default, (x, x[:, :4], r.t())),  # into a product, out of place: recomputed,
        (aten.addmm.default, (torch.empty(16), x, w)),  # not counted; with a bias: the 5th mm
        (aten.mm.default, (x, w)))]  # the 6th
    save, again = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert got == [save, again, save, again, save, again, save, again, again, save, again]


def test_mode_is_checked_by_the_schema():
    from foundryx.config import load_config

    with pytest.raises(ConfigError, match="activation_checkpointing.mode: expected one of"):
        load_config("yamls/quickstart.yaml", ["activation_checkpointing.mode=some"],
                    component_sections=[])


@pytest.mark.parametrize("one_pass", [True, False])
def test_selective_keeps_lora_gradients_with_the_one_pass_adapter(one_pass):
    """LoRA's one-pass adapter adds into the base layer's output in place (``addmm_``): the
    kept output already holds the sum, so the recompute must not add it again (it did: the
    gradients were garbage before the policy made ``addmm_`` follow its product)."""
    from types import SimpleNamespace

    from hf_tiny import HF_CONFIGS

    from foundryx import builders

    def run(mode):
        section = {"name": "hf_causal_lm", "pretrained": False,
                   "config": {"model_type": "llama", **HF_CONFIGS["llama"]},
                   "peft_config": {"target_modules": "all-linear", "r": 4, "lora_alpha": 16,
                                   "lora_dropout": 0.1, "one_pass": one_pass}}
        torch.manual_seed(0)
        model = builders.build_model(SimpleNamespace(model=section), None)
        for n, p in model.named_parameters():
            if "lora_B" in n:  # B starts at zero: A's gradients would be zero on every side
                torch.nn.init.normal_(p, std=0.5)
        if mode:
            apply_block_policies(model, ActivationCheckpointingConfig(enabled=True, mode=mode),
                                 CompileConfig(enabled=False), torch.device("cpu"))
        model.train()
        ids = torch.randint(0, HF_CONFIGS["llama"]["vocab_size"], (2, 24),
                            generator=torch.Generator().manual_seed(1))
        torch.manual_seed(3)  # the same dropout masks on every side
        loss = model.loss(model({"input_ids": ids}), {"input_ids": ids})
        loss.backward()
        return loss.detach(), {k: p.grad for k, p in model.named_parameters() if p.requires_grad}

    want_loss, want = run(None)
    got_loss, got = run("selective")
    torch.testing.assert_close(got_loss, want_loss)
    assert want and all(want[k].abs().max() > 0 for k in want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], msg=k)


def test_selective_keeps_an_fp8_tensor_core_base_product():
    """An FP8 frozen base on tensor cores (``torch._scaled_mm``, torch 2.15's CPU one here) with
    LoRA in one pass: its base products are counted and kept as mm's are, so backward runs no
    forward ``_scaled_mm`` again (the input gradients' remain), and the gradients are those of
    no checkpointing."""
    from foundryx.models.peft import fp8_gemm

    if not fp8_gemm._scaled_mm_runs_on("cpu"):
        pytest.skip("this torch has no CPU _scaled_mm (torch 2.7: CUDA only)")
    from test_fp8_gemm import lora_fp8_model, token_batch

    class CountScaled(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func is torch.ops.aten._scaled_mm.default
            return func(*args, **(kwargs or {}))

    results = {}
    for mode in (None, "full", "selective"):
        model = lora_fp8_model("tensor_cores")
        if mode:
            apply_block_policies(model, ActivationCheckpointingConfig(enabled=True, mode=mode),
                                 CompileConfig(enabled=False), torch.device("cpu"))
        batch = token_batch()
        loss = model.loss(model(batch), batch)
        with CountScaled() as count:
            loss.backward()
        results[mode] = (loss.detach(), [p.grad for p in model.parameters() if p.requires_grad],
                         count.n)
    for mode in ("full", "selective"):
        torch.testing.assert_close(results[mode][0], results[None][0])
        for a, b in zip(results[mode][1], results[None][1]):
            torch.testing.assert_close(a, b)
    layers = sum(getattr(m, "fp8_gemm", None) is not None
                 for m in lora_fp8_model("tensor_cores").modules())
    assert results["full"][2] - results[None][2] == layers  # full reruns every base product
    assert results["selective"][2] == results[None][2]  # selective keeps them all
