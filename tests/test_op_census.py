"""benchmarks/op_census.py's time on paper, checked against a step whose answer this test
computes by hand (issue 51: the census priced ``_scaled_mm`` from its scales, took the larger of
FLOP and byte time per place and op instead of per call, and counted causal attention whole)."""

from __future__ import annotations

import contextlib
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


def optimizer_kernels(make, shapes: list[tuple[int, ...]], dtype=torch.float32) -> dict:
    """The census of the second step of ``make(params)`` over fake CUDA parameters of
    ``shapes`` (the first makes the optimizer state), as the op census traces a side's
    optimizer: {op: kernels} and the total."""
    with fake_step.fake_mode():
        ps = [torch.nn.Parameter(torch.empty(s, device="cuda", dtype=dtype)) for s in shapes]
        opt = make(ps)

        def step(c=None):  # noqa: ANN001, ANN202
            for p in ps:
                p.grad = torch.empty_like(p)
            with (c.in_phase("optimizer") if c else contextlib.nullcontext()), \
                    fake_step.ScalarsRead():
                opt.step()

        step()
        got = op_census.measure("opt", {}, step, optimizer_on_gpu=True)
    ops = {k.split(" | ")[1]: n for k, (n, _, _) in got["places"].items()}
    assert got["optimizer_kernels"] == got["kernels"] == sum(ops.values())
    return ops


def test_the_optimizer_is_counted_as_a_gpu_launches_it():
    """torch's AdamW over N parameters on a GPU: the for-loop 8 kernels a parameter (its step
    counts are host tensors: no kernel), foreach 8 multi-tensor ops whatever N, fused 2 (the
    step counts, on the GPU, and the update); foundryx's decoupled_adamw: Composer's loop 9 a
    parameter (+1 with weight decay: its step counts are GPU tensors) and auto = fused."""
    from foundryx.optim.decoupled_adamw import DecoupledAdamW

    shapes = [(64, 16), (16,), (8, 3, 5), (1,), (300, 7)]
    n = len(shapes)
    loop = optimizer_kernels(lambda ps: torch.optim.AdamW(ps, foreach=False), shapes)
    assert loop == {"mul_": 2 * n, "lerp_": n, "addcmul_": n, "sqrt": n, "div": n, "add_": n,
                    "addcdiv_": n}  # decay and second moment: 2 mul_ a parameter
    foreach = optimizer_kernels(lambda ps: torch.optim.AdamW(ps, foreach=True), shapes)
    assert foreach == {"_foreach_mul_": 2, "_foreach_lerp_": 1, "_foreach_addcmul_": 1,
                       "_foreach_sqrt": 1, "_foreach_div_": 1, "_foreach_add_": 1,
                       "_foreach_addcdiv_": 1}
    fused = optimizer_kernels(lambda ps: torch.optim.AdamW(ps, fused=True), shapes)
    assert fused == {"_foreach_add_": 1, "_fused_adamw_": 1}
    composer_loop = optimizer_kernels(
        lambda ps: DecoupledAdamW(ps, weight_decay=0.0, implementation="for-loop"), shapes)
    assert sum(composer_loop.values()) == 9 * n
    decayed = optimizer_kernels(lambda ps: DecoupledAdamW(ps, implementation="for-loop"), shapes)
    assert sum(decayed.values()) == 10 * n
    assert optimizer_kernels(lambda ps: DecoupledAdamW(ps), shapes) == fused  # auto on a GPU


def test_a_multi_tensor_op_launches_as_many_kernels_as_its_lists_need():
    """An H100's multi-tensor apply: at most 2,240 blocks of 65,536 elements a launch, and at
    most 770 tensors in one list, 252 in four (a fused AdamW: params, grads, both moments)."""
    assert op_census.multi_tensor_launches([1] * 770, depth=1) == 1
    assert op_census.multi_tensor_launches([1] * 771, depth=1) == 2
    assert op_census.multi_tensor_launches([65536 * 2240 + 1], depth=1) == 2
    assert op_census.multi_tensor_launches([0, 0], depth=1) == 0
    # 300 one-block tensors: fused AdamW's 4 lists take 252 a launch, its step counts 1 list
    fused = optimizer_kernels(lambda ps: torch.optim.AdamW(ps, fused=True), [(64,)] * 300)
    assert fused == {"_foreach_add_": 1, "_fused_adamw_": 2}
    # 3 tensors of 1,000 blocks each: 2,240 blocks a launch, the second tensor cut short
    big = optimizer_kernels(lambda ps: torch.optim.AdamW(ps, fused=True), [(1000, 65536)] * 3)
    assert big == {"_foreach_add_": 1, "_fused_adamw_": 2}
