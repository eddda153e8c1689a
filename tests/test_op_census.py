"""benchmarks/op_census.py's time on paper, checked against a step whose answer this test
computes by hand (issue 51: the census priced ``_scaled_mm`` from its scales, took the larger of
FLOP and byte time per place and op instead of per call, and counted causal attention whole)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from benchmarks import op_census
from benchmarks.instruments import fake_step

ROOT = Path(__file__).parents[1]

PEAK, FP8_PEAK, BW = 989e12, 1979e12, 3.35e12  # an H100's, as the census's docstring states
BF16, FP8, F32 = 2, 1, 4  # bytes per element


def test_a_hand_built_step_costs_each_call_at_the_larger_of_its_flop_and_byte_time():
    """Two linear layers in one place (a wide one, FLOP-bound, and a rank-8 one, byte-bound:
    a sum per place would hide the second's bytes), one FP8 GEMM, one causal attention, one
    elementwise op, one in-place GEMM (the one-pass adapter's ``addmm_``, which torch's FLOP
    counter misses)."""
    m, d, f, r = 4096, 1024, 4096, 8
    fm, fn, fk = 2048, 512, 1024
    b, h, s, hd = 1, 4, 256, 64
    with fake_step.fake_mode():
        x = torch.empty(m, d, dtype=torch.bfloat16)
        w1 = torch.empty(f, d, dtype=torch.bfloat16)
        w2 = torch.empty(r, f, dtype=torch.bfloat16)
        a8 = torch.empty(fm, fk).to(torch.float8_e4m3fn)
        b8 = torch.empty(fn, fk).to(torch.float8_e4m3fn).t()
        sa, sb = torch.empty(fm, 1), torch.empty(1, fn)
        q, k, v = (torch.empty(b, h, s, hd, dtype=torch.bfloat16) for _ in range(3))
        t, bt = torch.empty(m, r, dtype=torch.bfloat16), torch.empty(r, f, dtype=torch.bfloat16)

        def run(c):  # noqa: ANN001, ANN202
            with c.in_phase("forward"):
                hidden = F.linear(x, w1)
                F.linear(hidden, w2)
                torch._scaled_mm(a8, b8, sa, sb, out_dtype=torch.bfloat16)
                fake_step.flash_like_sdpa(q, k, v, is_causal=True)
                hidden * 2
                hidden.addmm_(t, bt)

        got = op_census.measure("hand", {}, run)

    wide = (2 * m * f * d, (m * d + f * d + m * f) * BF16)
    skinny = (2 * m * r * f, (m * f + r * f + m * r) * BF16)
    fp8 = (2 * fm * fn * fk, (fm * fk + fk * fn) * FP8 + (fm + fn) * F32 + fm * fn * BF16)
    attention = 4 * b * h * s * s * hd // 2  # causal: the kernel computes half the square
    mul_bytes = 2 * m * f * BF16
    inplace = (2 * m * f * r, (m * f + m * r + r * f) * BF16)  # reads its output, writes none
    want = (max(wide[0] / PEAK, wide[1] / BW) + max(skinny[0] / PEAK, skinny[1] / BW)
            + max(fp8[0] / FP8_PEAK, fp8[1] / BW) + attention / PEAK + mul_bytes / BW
            + max(inplace[0] / PEAK, inplace[1] / BW))
    assert wide[0] / PEAK > wide[1] / BW and skinny[1] / BW > skinny[0] / PEAK  # as meant
    assert got["paper_s"] == pytest.approx(want, rel=1e-12)
    assert got["compute_s"] == got["paper_s"] and got["optimizer_s"] == 0
    assert got["flop_counter"] == wide[0] + skinny[0] + fp8[0]
    assert got["gemm_flops"] == wide[0] + skinny[0] + fp8[0] + inplace[0]
    assert got["places"]["forward | _scaled_mm"][2] == fp8[0]  # from its operands, not scales
    assert got["attention_flops"] == attention
    assert got["kernels"] == 6 and got["launch_floor_s"] == pytest.approx(6 * 4e-6)
    assert got["other_bytes"] == mul_bytes


def test_the_optimizer_has_its_own_column():
    with fake_step.fake_mode():
        p = torch.empty(1000, 1000)

        def run(c):  # noqa: ANN001, ANN202
            with c.in_phase("optimizer"):
                p.add_(p)

        got = op_census.measure("opt", {}, run)
    assert got["optimizer_s"] == pytest.approx(2 * 1000 * 1000 * 4 / BW, rel=1e-12)
    assert got["compute_s"] == 0 and got["paper_s"] == got["optimizer_s"]
    assert got["other_bytes_by_kind"] == {"optimizer": 2 * 1000 * 1000 * 4}


@pytest.mark.parametrize("place, op, kind", [
    ("layers.N.self_attn.q_proj.lora_dropout", "native_dropout", "dropout"),
    ("recompute: layers.N.mlp.down_proj.lora_A", "_to_copy", "adapter path"),
    ("layers.N.input_layernorm", "mul", "norms"),
    ("backward: RsqrtBackward0", "mul", "norms"),
    ("layers.N.mlp.act_fn", "silu", "activation (SwiGLU)"),
    ("layers.N.mlp", "swiglu", "activation (SwiGLU)"),
    ("backward: GeneratedBackwardFor_foundryx_rms_norm_defaultBackward", "rms_norm_backward",
     "norms"),
    ("backward: LinearCrossEntropyBackward", "mul", "loss"),
    ("layers.N", "add", "residual adds"),
    ("recompute: layers.N", "add", "residual adds"),
    ("layers.N.mlp.down_proj", "add", "adapter path"),  # PEFT's result + scaling * B(A(x))
    ("layers.N.mlp.down_proj", "mul", "adapter path"),
    ("backward: _AdapterAddBackward", "mm", "adapter path"),
    ("layers.N.mlp.up_proj", "native_dropout", "dropout"),
    ("layers.N.self_attn", "_to_copy", "casts and copies"),
    ("optimizer", "_foreach_mul_", "optimizer"),
    ("layers.N.self_attn", "sum", "other"),
])
def test_the_other_bytes_are_sorted_by_kind(place, op, kind):
    assert op_census.kind_of(place, op) == kind


def test_a_training_step_s_attention_is_counted_causal_whatever_mask_the_model_passes():
    fake_step.ATTENTION_CALLS.clear()
    with fake_step.fake_mode():
        q = torch.empty(2, 4, 128, 32)
        fake_step.flash_like_sdpa(q, q, q, attn_mask=torch.empty(2, 1, 128, 128, dtype=torch.bool))
    assert fake_step.ATTENTION_CALLS == [("forward", 4 * 2 * 4 * 128 * 128 * 32 // 2)]


@pytest.mark.slow
def test_a_recipe_override_changes_foundryx_s_step_and_not_the_peer(tmp_path):
    """``--set``: selective checkpointing keeps the matmuls' outputs, so fewer GEMM FLOPs are
    recomputed; the peer runs as it is."""
    import json

    tiny = ROOT / "benchmarks" / "gpu_runbook" / "shapes" / "llama-tiny"
    runs = {}
    for name, extra in (("full", []), ("selective", ["--set",
                                                     "activation_checkpointing.mode=selective"])):
        out = tmp_path / f"{name}.json"
        assert op_census.main(["--shape", str(tiny), "--seq", "32", "--sides", "peer,bf16",
                               "--json", str(out), *extra]) == 0
        runs[name] = json.loads(out.read_text())
    assert runs["selective"]["peer"]["gemm_flops"] == runs["full"]["peer"]["gemm_flops"]
    assert runs["selective"]["bf16"]["gemm_flops"] < runs["full"]["bf16"]["gemm_flops"]
