"""The fused RMS norm, SwiGLU and RoPE operators (issue 51, ``fused_ops``): their Triton kernels
against a float64 reference (Triton's interpreter on a CPU: tests/conftest.py sets
TRITON_INTERPRET=1), the operators' torch references against Hugging Face's modules, one op a
call under fake tensors (the census's count and bytes), training steps of a LoRA Llama fused
and unfused, and where the swap steps aside."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch
from hf_tiny import HF_CONFIGS
from torch import nn

from benchmarks import op_census
from foundryx import builders
from foundryx.config.schema import FusedOpsConfig, TilingConfig
from foundryx.errors import ConfigError
from foundryx.kernels.rms_norm_op import rms_norm
from foundryx.kernels.rope_op import rope
from foundryx.kernels.swiglu_op import swiglu
from foundryx.parallel.fused_ops import FUSED, apply_fused_ops
from foundryx.parallel.parallelize import apply_tiling
from foundryx.parallel.policy import blocks

pytestmark = pytest.mark.usefixtures("one_thread")
CPU = torch.device("cpu")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


# ---------------------------------------------------------------------------------------
# float64 references, written from the definitions
# ---------------------------------------------------------------------------------------
def rms_norm_64(x, w, eps):
    x, w = x.double().requires_grad_(), w.double().requires_grad_()
    return x, w, w * x * (x.pow(2).mean(-1, keepdim=True) + eps).rsqrt()


def swiglu_64(g, u):
    g, u = g.double().requires_grad_(), u.double().requires_grad_()
    return g, u, g / (1 + torch.exp(-g)) * u


def close(got, want, dtype, what):
    """Within the rounding of ``dtype`` (relative to the largest value)."""
    tol = {torch.float32: 1e-5, torch.bfloat16: 2 ** -7}[dtype]
    err = (got.double() - want.double()).abs().max().item()
    assert err <= tol * want.abs().max().item(), (what, err, want.abs().max().item())


# ---------------------------------------------------------------------------------------
# the kernels (interpreter on a CPU)
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n", [300, 1000])  # not powers of two: masked tails
def test_the_rms_norm_kernels_match_float64(dtype, n):
    pytest.importorskip("triton")
    from foundryx.kernels import rms_norm as kernel

    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 5, n, generator=g) * 3).to(DEVICE, dtype)
    w = torch.randn(n, generator=g).to(DEVICE, dtype)
    dy = torch.randn(3, 5, n, generator=g).to(DEVICE, dtype)
    y, rstd = kernel.forward(x, w, 1e-5)
    assert y.dtype == dtype and y.shape == x.shape and rstd.shape == (3, 5)
    x64, w64, y64 = rms_norm_64(x.cpu(), w.cpu(), 1e-5)
    dx64, dw64 = torch.autograd.grad(y64, (x64, w64), dy.cpu().double())
    close(y.cpu(), y64, dtype, "y")
    close(rstd.cpu(), (x64.pow(2).mean(-1) + 1e-5).rsqrt(), torch.float32, "rstd")
    for want_dx, want_dw in ((True, True), (True, False), (False, True)):
        dx, dw = kernel.backward(dy, x, w, rstd, want_dx, want_dw)
        assert (dx is not None) == want_dx and (dw is not None) == want_dw
        if want_dx:
            close(dx.cpu(), dx64, dtype, "dx")
        if want_dw:  # a sum over 15 rows: a little more than one rounding
            close(dw.cpu(), dw64, dtype if dtype == torch.float32 else torch.bfloat16, "dw")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_swiglu_kernels_match_float64(dtype):
    pytest.importorskip("triton")
    from foundryx.kernels import swiglu as kernel

    gen = torch.Generator().manual_seed(0)
    g, u, dy = ((torch.randn(3, 700, generator=gen) * 4).to(DEVICE, dtype) for _ in range(3))
    y = kernel.forward(g, u)  # 2,100 values: three blocks, the last one masked
    g64, u64, y64 = swiglu_64(g.cpu(), u.cpu())
    dg64, du64 = torch.autograd.grad(y64, (g64, u64), dy.cpu().double())
    dg, du = kernel.backward(dy, g, u)
    close(y.cpu(), y64, dtype, "y")
    close(dg.cpu(), dg64, dtype, "dgate")
    close(du.cpu(), du64, dtype, "dup")


def rope_inputs(dtype, b=2, s=5, hq=4, hk=2, d=24):
    """q and k as the attention makes them (``[b, s, h, d]`` memory seen as ``[b, h, s, d]``),
    cos and sin of one sequence (``[1, s, d]``), and upstream gradients."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(b, s, hq, d, generator=gen).to(DEVICE, dtype).transpose(1, 2)
    k = torch.randn(b, s, hk, d, generator=gen).to(DEVICE, dtype).transpose(1, 2)
    cos, sin = (torch.randn(1, s, d, generator=gen).to(DEVICE, dtype) for _ in range(2))
    gq = torch.randn(b, s, hq, d, generator=gen).to(DEVICE, dtype).transpose(1, 2)
    gk = torch.randn(b, s, hk, d, generator=gen).to(DEVICE, dtype).transpose(1, 2)
    return q, k, cos, sin, gq, gk


def rope_64(x, cos, sin):
    x = x.double().requires_grad_()
    half = x.shape[-1] // 2
    rot = torch.cat((-x[..., half:], x[..., :half]), -1)
    return x, x * cos.double().unsqueeze(1) + rot * sin.double().unsqueeze(1)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rope_kernel_matches_float64_and_keeps_the_strides(dtype):
    pytest.importorskip("triton")
    from foundryx.kernels import rope as kernel

    q, k, cos, sin, gq, gk = rope_inputs(dtype)
    qo, ko = kernel.rotate(q, k, cos, sin)
    dq, dk = kernel.rotate(gq, gk, cos, sin, backward=True)
    assert qo.stride() == q.stride() and ko.stride() == k.stride()
    for x, out, g, grad, what in ((q, qo, gq, dq, "q"), (k, ko, gk, dk, "k")):
        x64, y64 = rope_64(x.cpu(), cos.cpu(), sin.cpu())
        (dx64,) = torch.autograd.grad(y64, x64, g.cpu().double())
        close(out.cpu(), y64, dtype, what)
        close(grad.cpu(), dx64, dtype, "d" + what)


# ---------------------------------------------------------------------------------------
# the operators' CPU form against Hugging Face's modules
# ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_operators_give_hugging_face_s_numbers(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    norm = LlamaRMSNorm(300, eps=1e-5).to(dtype)
    norm.weight.data.normal_()
    x = torch.randn(2, 7, 300, dtype=dtype, requires_grad=True)
    dy = torch.randn(2, 7, 300, dtype=dtype)
    want = norm(x)
    want_dx, want_dw = torch.autograd.grad(want, (x, norm.weight), dy)
    got = rms_norm(x, norm.weight, norm.variance_epsilon)
    got_dx, got_dw = torch.autograd.grad(got, (x, norm.weight), dy)
    assert torch.equal(got, want)  # the same ops forward
    close(got_dx, want_dx, dtype, "dx")
    close(got_dw, want_dw, dtype, "dw")
    g, u = (torch.randn(2, 7, 64, dtype=dtype, requires_grad=True) for _ in range(2))
    dy = torch.randn(2, 7, 64, dtype=dtype)
    want = nn.functional.silu(g) * u
    got = swiglu(g, u)
    close(got, want, dtype, "swiglu")
    for a, b, what in zip(torch.autograd.grad(got, (g, u), dy),
                          torch.autograd.grad(want, (g, u), dy), ("dgate", "dup")):
        close(a, b, dtype, what)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rope_operator_gives_hugging_face_s_numbers(dtype):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    q, k, cos, sin, gq, gk = (t.cpu() for t in rope_inputs(dtype))
    q.requires_grad_(), k.requires_grad_()
    want = apply_rotary_pos_emb(q, k, cos, sin)
    got = rope(q, k, cos, sin)
    assert [t.stride() for t in got] == [t.stride() for t in want]
    for a, b, what in zip(got + torch.autograd.grad(got, (q, k), (gq, gk)),
                          want + torch.autograd.grad(want, (q, k), (gq, gk)),
                          ("q", "k", "dq", "dk")):
        close(a, b, dtype, what)


@pytest.mark.parametrize("impl", ["eager", "sdpa"])
def test_a_fused_llama_attention_gives_the_module_s_output(impl):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", **HF_CONFIGS["llama"])
    config._attn_implementation = impl
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    x = torch.randint(0, 100, (2, 12))
    want = model(x).logits
    said = apply_fused_ops(model, list(model.model.layers),
                           FusedOpsConfig(rms_norm=False, swiglu=False, rope=True), CPU)
    assert said == ["2 attentions' RoPE fused"]
    torch.testing.assert_close(model(x).logits, want, rtol=1e-5, atol=1e-5)
    out = model.generate(x[:1, :4], max_new_tokens=3, do_sample=False)  # the cache: HF's forward
    assert out.shape == (1, 7)


def test_a_frozen_weight_gets_no_gradient_and_no_kernel_for_it():
    x = torch.randn(4, 32, requires_grad=True)
    w = torch.randn(32)  # frozen (LoRA's base)
    seen = []
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append((func._overloadpacket.__name__, args[4:6] if len(args) > 5 else ()))
            return func(*args, **(kwargs or {}))

    y = rms_norm(x, w, 1e-6)
    with Ops():
        y.sum().backward()
    assert [s for s in seen if s[0].startswith("rms")] == [("rms_norm_backward", (True, False))]
    assert w.grad is None and x.grad is not None


# ---------------------------------------------------------------------------------------
# fake tensors and the op census: one op a call, its bytes
# ---------------------------------------------------------------------------------------
def test_the_census_counts_one_op_a_call_with_its_bytes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    b, s, d, f = 2, 64, 256, 688
    with FakeTensorMode():
        x = torch.empty(b, s, d, dtype=torch.bfloat16, requires_grad=True)
        w = torch.empty(d, dtype=torch.bfloat16)  # frozen
        gate = torch.empty(b, s, f, dtype=torch.bfloat16, requires_grad=True)
        up = torch.empty(b, s, f, dtype=torch.bfloat16, requires_grad=True)
        q = torch.empty(b, s, 8, 32, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
        k = torch.empty(b, s, 2, 32, dtype=torch.bfloat16).transpose(1, 2).requires_grad_()
        cos, sin = torch.empty(1, s, 32, dtype=torch.bfloat16), torch.empty(1, s, 32,
                                                                            dtype=torch.bfloat16)
        census = op_census.OpCensus({})
        with census:
            y = rms_norm(x, w, 1e-5)
            h = swiglu(gate, up)
            qo, ko = rope(q, k, cos, sin)
            with census.in_phase("backward"):
                torch.autograd.backward((y, h, qo, ko), tuple(torch.ones_like(t)
                                                              for t in (y, h, qo, ko)))
    rows = {(place.split(":")[0], op): r for (place, op), r in census.rows.items()}
    tokens = b * s
    norm_fwd = 2 * tokens * d * 2 + 2 * d + 4 * tokens  # x, w read; y, rstd (float32) written
    norm_bwd = 3 * tokens * d * 2 + 2 * d + 4 * tokens  # dy, x, w, rstd read; dx written
    glu_fwd = 3 * tokens * f * 2  # gate, up read; the product written
    glu_bwd = 5 * tokens * f * 2  # dy, gate, up read; dgate, dup written
    assert rows[("forward", "rms_norm")][:2] == [1, norm_fwd]
    assert rows[("backward", "rms_norm_backward")][:2] == [1, norm_bwd]
    assert rows[("forward", "swiglu")][:2] == [1, glu_fwd]
    assert rows[("backward", "swiglu_backward")][:2] == [1, glu_bwd]
    qk, cs = tokens * (8 + 2) * 32 * 2, 2 * s * 32 * 2  # q and k; cos and sin
    assert rows[("forward", "rope")][:2] == [1, 2 * qk + cs]  # q, k, cos, sin read; 2 written
    assert rows[("backward", "rope_backward")][:2] == [1, 2 * qk + cs]
    assert not any(op == "zeros" for _, op in rows)  # rstd's gradient is not materialised
    assert op_census.kind_of("layers.N.input_layernorm", "rms_norm") == "norms"
    assert op_census.kind_of("layers.N.mlp", "swiglu") == "activation (SwiGLU)"
    assert op_census.kind_of("layers.N.self_attn", "rope") == "RoPE"


# ---------------------------------------------------------------------------------------
# the swap on a model
# ---------------------------------------------------------------------------------------
SECTION = {"name": "hf_causal_lm", "pretrained": False,
           "config": {"model_type": "llama", **HF_CONFIGS["llama"]},
           "peft_config": {"target_modules": "all-linear", "r": 4, "lora_alpha": 16,
                           "lora_dropout": 0.1}}


def _build(fused: bool, section: dict = SECTION):
    from foundryx.parallel.wrappers import checkpoint_activations

    cfg = SimpleNamespace(model=section, optimizer={"name": "adamw", "lr": 1e-2})
    torch.manual_seed(0)
    model = builders.build_model(cfg, None)
    block_list = [m for _, m in blocks(model)]
    if fused:
        said = apply_fused_ops(model, block_list, FusedOpsConfig(True, True, True), CPU)
        assert said == ["5 RMS norms fused", "2 SwiGLU MLPs fused", "2 attentions' RoPE fused"]
    for m in block_list:  # recomputed in backward, as the recipes run
        checkpoint_activations(m)
    return model, builders.build_optimizer(cfg, model)


def _steps(fused: bool, n: int = 8):
    model, opt = _build(fused)
    ids = torch.randint(0, HF_CONFIGS["llama"]["vocab_size"], (n, 2, 24),
                        generator=torch.Generator().manual_seed(1))
    losses, grads = [], {}
    model.train()
    torch.manual_seed(3)  # LoRA's dropout: the same masks when drawn in the same order
    for i in range(n):
        batch = {"input_ids": ids[i]}
        loss = model.loss(model(batch), batch)
        loss.backward()
        if i == n - 1:
            grads = {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads


def test_eight_lora_steps_fused_equal_the_unfused_within_float32_rounding():
    fused, fused_grads = _steps(True)
    plain, plain_grads = _steps(False)
    assert fused == pytest.approx(plain, rel=1e-5)
    assert set(fused_grads) == set(plain_grads) and len(fused_grads) == 28
    for name, g in fused_grads.items():
        want = plain_grads[name]
        assert want.norm() > 0
        assert (g - want).norm() <= 1e-3 * want.norm(), (name, g.norm(), want.norm())


def test_auto_is_off_on_a_cpu_and_on_for_a_gpu_device():
    model, _ = _build(False)
    block_list = [m for _, m in blocks(model)]
    assert apply_fused_ops(model, block_list, FusedOpsConfig(), CPU) == []
    assert not any(getattr(m, FUSED, None) for m in model.modules())
    assert apply_fused_ops(model, block_list, FusedOpsConfig(rms_norm=True, swiglu=False),
                           CPU) == ["5 RMS norms fused"]


def test_an_unsupported_family_keeps_its_modules_and_says_so_in_one_line(caplog):
    """Gemma's norm (1 + weight) and its GELU MLP are not Llama's: nothing changes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("gemma", **{**HF_CONFIGS["llama"], "head_dim": 8})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    forwards = {id(m): m.forward for m in model.modules()}
    x = torch.randint(0, 100, (1, 8))
    before = model(x).logits
    with caplog.at_level(logging.INFO, logger="foundryx"):
        said = apply_fused_ops(model, list(model.model.layers), FusedOpsConfig(True, True, True),
                               CPU)
    assert said == []
    lines = [r.getMessage() for r in caplog.records]
    assert [line for line in lines if "GemmaRMSNorm" in line] == [
        "fused_ops.rms_norm: GemmaRMSNorm keeps the unfused path (foundryx fuses only the "
        "modules it has checked)"]
    assert sum("GemmaMLP" in line for line in lines) == 1
    assert sum("GemmaAttention" in line for line in lines) == 1
    assert all(m.forward == forwards[id(m)] for m in model.modules())
    assert torch.equal(model(x).logits, before)
    with pytest.raises(ConfigError, match="fused_ops.swiglu: true, but the model has no module"):
        apply_fused_ops(nn.Sequential(nn.Linear(2, 2)), [], FusedOpsConfig(swiglu=True), CPU)


def test_a_tiled_mlp_runs_the_fused_product_and_fused_norms_are_not_tiled(caplog):
    model, _ = _build(True)
    block_list = [m for _, m in blocks(model)]
    with caplog.at_level(logging.INFO, logger="foundryx"):
        said = apply_tiling(model, block_list, TilingConfig(mlp=True, norm=True, mlp_tokens=16),
                            48)
    assert said == ["MLP tiled by 16 tokens in 2 blocks"]
    assert any("the 5 fused RMS norms are not tiled" in r.getMessage() for r in caplog.records)
    mlp = block_list[0]._checkpoint_wrapped_module.mlp if hasattr(
        block_list[0], "_checkpoint_wrapped_module") else block_list[0].mlp
    x = torch.randn(2, 24, HF_CONFIGS["llama"]["hidden_size"], requires_grad=True)
    mlp.eval()  # no dropout: the tiles' result is the whole's
    seen = []
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func._overloadpacket.__name__)
            return func(*args, **(kwargs or {}))

    with Ops():
        y = mlp(x)
    assert seen.count("swiglu") == 3  # 48 tokens in tiles of 16
    want = mlp.down_proj(nn.functional.silu(mlp.gate_proj(x)) * mlp.up_proj(x))
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-6)


def test_the_section_is_checked_with_its_path_and_a_suggestion():
    from foundryx.config.types import dataclass_problems

    got = dataclass_problems(FusedOpsConfig, {"rms_norm": "maybe", "swiglue": True}, "fused_ops")
    assert sorted(got) == ["fused_ops.rms_norm: expected true/false or one of 'auto', got 'maybe'",
                           "fused_ops.swiglue: unknown key (did you mean 'swiglu'?)"]
    assert dataclass_problems(FusedOpsConfig, {"rms_norm": False, "swiglu": "auto"},
                              "fused_ops") == []


def test_the_flagship_census_runs_the_fused_ops_as_a_gpu_run_would():
    """benchmarks.op_census's foundryx side (the flagship recipe through the builders, on the
    tiny Llama shape): ``fused_ops`` reaches the model; one rms_norm a norm and one swiglu a
    MLP per forward and recompute, one backward op each; no silu or float32 norm arithmetic
    left; ``--set fused_ops...=false`` gives the unfused step back."""
    from pathlib import Path

    tiny = Path(__file__).parents[1] / "benchmarks" / "gpu_runbook" / "shapes" / "llama-tiny"
    got = op_census.census("bf16", tiny, batch=1, seq=32)
    ops = op_census.op_counts(got)
    layers = 2
    assert ops["rms_norm"] == (2 * layers + 1) + 2 * layers  # forward (+ final norm), recompute
    # backward: not the first norm's (its input, the frozen embedding's output, and its weight
    # want no gradient)
    assert ops["rms_norm_backward"] == 2 * layers
    assert ops["swiglu"] == 2 * layers and ops["swiglu_backward"] == layers
    assert ops["rope"] == 2 * layers and ops["rope_backward"] == layers
    assert not {"silu", "rsqrt", "neg"} & set(ops)
    off = op_census.census("bf16", tiny, batch=1, seq=32,
                           overrides=["fused_ops.rms_norm=false", "fused_ops.swiglu=false",
                                      "fused_ops.rope=false"])
    names = {key.split(" | ")[1] for key in off["places"]}
    assert not {"rms_norm", "swiglu", "rope"} & names and {"silu", "rsqrt", "neg"} <= names
    assert off["kernels"] > got["kernels"] and off["other_bytes"] > got["other_bytes"]


def test_tensor_parallel_modules_keep_the_unfused_path_said_in_one_line(caplog):
    """A model whose parameters are DTensors (tensor parallelism's plan applied first): the
    fused operators take whole tensors, so nothing is swapped."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import distribute_tensor

    model, _ = _build(False)
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        norm = model.model.model.norm
        norm.weight = nn.Parameter(distribute_tensor(norm.weight.detach(), mesh),
                                   requires_grad=False)
        with caplog.at_level(logging.INFO, logger="foundryx"):
            said = apply_fused_ops(model, [m for _, m in blocks(model)],
                                   FusedOpsConfig(rms_norm=True, swiglu=True), CPU)
    finally:
        dist.destroy_process_group()
    assert said == [] and not any(getattr(m, FUSED, None) for m in model.modules())
    lines = [r.getMessage() for r in caplog.records if "fused_ops" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("fused_ops: off under tensor parallelism")


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a CUDA device that cannot run")
def test_a_kernel_that_fails_its_first_call_keeps_the_unfused_path_said_in_one_line(caplog):
    """``auto`` for a CUDA device where none runs (this machine): each kernel's first-call
    check fails, and each kind of module keeps its forward, said in one line."""
    from foundryx.kernels import checks

    checks.first_call_problem.cache_clear()
    model, _ = _build(False)
    with caplog.at_level(logging.INFO, logger="foundryx"):
        said = apply_fused_ops(model, [m for _, m in blocks(model)], FusedOpsConfig(),
                               torch.device("cuda"))
    checks.first_call_problem.cache_clear()
    assert said == [] and not any(getattr(m, FUSED, None) for m in model.modules())
    lines = [r.getMessage() for r in caplog.records if "first check" in r.getMessage()]
    assert [line.split(":")[0] for line in lines] == ["fused_ops.rms_norm", "fused_ops.swiglu",
                                                      "fused_ops.rope"]
    assert all("keep the unfused path" in line for line in lines)
