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
    got = [decide(ctx, op) for op in (aten.mm.default, aten.mm.default, aten.mm.default,
                                      aten.add.Tensor,
                                      aten._scaled_dot_product_efficient_attention.default)]
    save, again = CheckpointPolicy.MUST_SAVE, CheckpointPolicy.PREFER_RECOMPUTE
    assert got == [save, again, save, again, save]


def test_mode_is_checked_by_the_schema():
    from foundryx.config import load_config

    with pytest.raises(ConfigError, match="activation_checkpointing.mode: expected one of"):
        load_config("yamls/quickstart.yaml", ["activation_checkpointing.mode=some"],
                    component_sections=[])
