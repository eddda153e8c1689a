"""FP8 GEMMs of a frozen FP8 base (foundryx.models.peft.fp8_gemm): the capability rule, the
formulation against a float64 reference, its error against the cast path (one layer, and the
losses and gradients of a few LoRA steps, the FP8 path forced on the CPU), and the GPU call's
operands against torch's own ``_scaled_mm`` checks on fake CUDA tensors."""

from __future__ import annotations

import logging

import pytest
import torch
from hf_tiny import LLAMA_STYLE, MPT_TINY, token_batch

from foundryx.builders import apply_frozen_storage
from foundryx.models.peft import fp8_gemm
from foundryx.models.peft.frozen_base import LowPrecisionLinear
from foundryx.models.peft.frozen_options import FrozenBaseOptions
from foundryx.models.peft.lora import apply_lora
from foundryx.models.peft.options import LoraOptions
from foundryx.models.peft.rowwise import RowScaledTensor
from foundryx.runtime.devices import fp8_gemm_dtype

E4M3 = torch.float8_e4m3fn
FNUZ = getattr(torch, "float8_e4m3fnuz", None)
# Relative (Frobenius) error of one layer's output and input gradient against the cast path:
# e4m3 rounds each activation with a relative error of at most 2^-4, 2.6% RMS on these
# Gaussian values (measured 0.0254-0.0265 at 64x64x192 to 2048x1024x4096).
LAYER_TOL = 0.035
# A few LoRA steps of the tiny model: each loss within 2% (measured at most 0.97% over 6
# steps), the adapters' gradients within 40% as a vector (measured 0.20-0.35 over 4 steps)
# and pointing the same way (cosine >= 0.9). The tiny random model amplifies each layer's
# output error about 7x into the gradients: a 2.6% random perturbation of every frozen
# layer's output instead of FP8 gives 17-25%, and bf16 autocast's rounding gives 3.5%.
LOSS_TOL, GRAD_TOL, GRAD_COS = 0.02, 0.4, 0.9


pytestmark = pytest.mark.usefixtures("one_thread")


# -- the capability rule ------------------------------------------------------------------

@pytest.mark.parametrize(("capability", "arch", "hip", "want"), [
    ((8, 0), None, None, None),               # A100: no FP8
    ((8, 6), None, None, None),               # A10 / RTX 30xx
    ((8, 9), None, None, "float8_e4m3fn"),    # L4, L40S, RTX 40xx
    ((9, 0), None, None, "float8_e4m3fn"),    # H100, H200
    ((10, 0), None, None, "float8_e4m3fn"),   # B200
    ((12, 0), None, None, "float8_e4m3fn"),   # RTX 50xx
    (None, "gfx90a:sramecc+:xnack-", "6.2", None),                # MI250
    (None, "gfx942:sramecc+:xnack-", "6.2.41133", "float8_e4m3fnuz"),  # MI300X / MI325X
    (None, "gfx950", "6.4", None),            # MI350 needs ROCm 6.5
    (None, "gfx950", "7.0", "float8_e4m3fn"),
    (None, "gfx1201", "6.3", "float8_e4m3fn"),  # RDNA4
    (None, "gfx1100", "6.3", None),           # RDNA3
    (None, None, None, None),                 # nothing known: no FP8
])
def test_the_capability_rule(capability, arch, hip, want):
    assert fp8_gemm_dtype(capability, arch, hip) == want


def fp8_layers(n: int = 2, shape: tuple[int, int] = (64, 32)) -> list[LowPrecisionLinear]:
    torch.manual_seed(0)
    return [LowPrecisionLinear(torch.nn.Linear(shape[1], shape[0], bias=False), "fp8", f"l{i}")
            for i in range(n)]


def test_choose_says_in_one_line_which_path_runs(monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger=fp8_gemm.__name__)

    def lines():
        out = [r.getMessage() for r in caplog.records]
        caplog.clear()
        return out

    # a CPU (the real check): the cast path
    layers = fp8_layers()
    assert fp8_gemm.choose(torch.device("cpu"), layers) is None
    [line] = lines()
    assert "cast to the compute dtype" in line and "cpu has no FP8 tensor cores" in line
    assert all(m.fp8_gemm is None for m in layers)
    # an A100, an MI250: the cast path, the device named
    for name in ("NVIDIA A100-SXM4-80GB (sm80)", "AMD Instinct MI250X (gfx90a, ROCm 6.2)"):
        monkeypatch.setattr(fp8_gemm, "device_fp8_gemm", lambda d, n=name: (None, n))
        assert fp8_gemm.choose(torch.device("cuda", 0), layers) is None
        [line] = lines()
        assert f"{name} has no FP8 tensor cores" in line
    # an H100 whose torch runs row-wise _scaled_mm: FP8 GEMMs, on every layer that fits
    monkeypatch.setattr(fp8_gemm, "device_fp8_gemm",
                        lambda d: ("float8_e4m3fn", "NVIDIA H100 80GB HBM3 (sm90)"))
    monkeypatch.setattr(fp8_gemm, "probe", lambda device, dtype: None)
    monkeypatch.setattr(fp8_gemm, "kernel_check", lambda device, dtype: None)
    odd = fp8_layers(1, (64, 40))  # 40 input features: not a multiple of 16
    assert fp8_gemm.choose(torch.device("cuda", 0), layers + odd) is E4M3
    [line] = lines()
    assert "NVIDIA H100 80GB HBM3 (sm90)" in line and "2 of 3 layers" in line
    assert [m.fp8_gemm for m in layers + odd] == [E4M3, E4M3, None]
    # a torch or ROCm without row-wise scaling: the probe's reason, the cast path
    monkeypatch.setattr(fp8_gemm, "probe", lambda device, dtype: "torch 2.x cannot (...)")
    assert fp8_gemm.choose(torch.device("cuda", 0), layers) is None
    assert "torch 2.x cannot" in lines()[0]
    # tensor parallelism, the switch: the cast path, said so; another storage: nothing said
    assert fp8_gemm.choose(torch.device("cuda", 0), layers, tp=2) is None
    assert "tensor parallelism (tp 2)" in lines()[0]
    assert fp8_gemm.choose(torch.device("cuda", 0), layers, gemm="cast") is None
    assert lines()[0].endswith("per layer (forward and backward): frozen_base.fp8_gemm: cast")
    int8 = [LowPrecisionLinear(torch.nn.Linear(32, 64), "int8", "w")]
    assert fp8_gemm.choose(torch.device("cuda", 0), int8) is None and lines() == []


# -- the formulation --------------------------------------------------------------------

def test_rows_quantize_within_e4m3s_step_and_zero_rows_stay_zero():
    torch.manual_seed(0)
    x = torch.randn(32, 256) * torch.logspace(-6, 3, 32)[:, None]  # rows of every magnitude
    x[3] = 0.0
    for dtype in (E4M3, FNUZ):
        q, s = fp8_gemm.quantize(x, dtype)
        assert q.dtype == dtype and s.dtype == torch.float32
        back = q.float() * s[:, None]
        assert torch.isfinite(back).all() and torch.equal(back[3], torch.zeros(256))
        fmax = torch.finfo(dtype).max
        assert q.float().abs().amax(1)[torch.arange(32) != 3].eq(fmax).all()  # each row's max
        # a normal e4m3 value is within 2^-4 of x; a subnormal within half the smallest step
        step = 2.0 ** (-9 if dtype == E4M3 else -10) * s[:, None]
        assert ((back - x).abs() <= torch.maximum(x.abs() / 16, step / 2) * (1 + 1e-6)).all()


@pytest.mark.skipif(FNUZ is None, reason="this torch has no float8_e4m3fnuz")
def test_an_e4m3fn_weight_reads_as_e4m3fnuz_exactly():
    codes = torch.arange(256, dtype=torch.uint8).view(E4M3)
    finite = torch.isfinite(codes.float())
    scale = torch.full((256,), 0.75)
    q, s = fp8_gemm.weight_operand(codes[:, None], scale, FNUZ)
    assert q.dtype == FNUZ and torch.isfinite(q.float()[finite]).all()  # -0 is not NaN
    assert torch.equal((q.float()[:, 0] * s)[finite], (codes.float() * scale)[finite])


def reference_fp64(x: torch.Tensor, dy: torch.Tensor, rs: RowScaledTensor):
    """The module doc's formulas in float64 from the same quantized operands: ``(y, the sum
    of |terms| of each y), (dx, the same)``."""
    xq, sx = fp8_gemm.quantize(x, E4M3)
    wq, sw = rs.qdata.double(), rs.scale.double()
    rows_y = sx.double()[:, None] * sw[None, :]
    gq, sg = fp8_gemm.quantize(dy.double().mul(sw).float(), E4M3)
    return ((rows_y * (xq.double() @ wq.t()), rows_y * (xq.double().abs() @ wq.abs().t())),
            (sg.double()[:, None] * (gq.double() @ wq),
             sg.double()[:, None] * (gq.double().abs() @ wq.abs())))


def test_the_gemms_compute_the_documented_formulas_and_stay_near_the_cast_path():
    torch.manual_seed(0)
    for m, k, n in ((64, 64, 192), (512, 512, 1536)):
        w, x, dy = torch.randn(n, k) * 0.02, torch.randn(m, k), torch.randn(m, n)
        rs = RowScaledTensor.from_weight(w, "fp8")
        y = fp8_gemm.linear(x, rs.qdata, rs.scale, E4M3, torch.float32)
        dx = fp8_gemm.input_grad(dy, rs.qdata, rs.scale, E4M3, torch.float32)
        # one bf16 rounding of the exact value, and float32's accumulation (and scaling)
        # error, at most a few float32 steps per term
        for got, (want, terms) in zip((y, dx), reference_fp64(x, dy, rs)):
            bound = want.abs() * 2.0**-8 + terms * (want.shape[1] + 4) * 2.0**-24
            assert ((got.double() - want).abs() <= bound).all()
        dense = rs.dequantize(torch.float32)
        for got, want in ((y, x @ dense.t()), (dx, dy @ dense)):
            assert ((got - want).norm() / want.norm()).item() < LAYER_TOL


@pytest.mark.skipif(not fp8_gemm._scaled_mm_runs_on("cpu"),
                    reason="this torch has no CPU _scaled_mm (torch 2.7: CUDA only)")
def test_the_emulation_is_torchs_cpu_scaled_mm_to_one_bf16_step():
    torch.manual_seed(0)
    a = (torch.randn(256, 512) * 50).clamp(-448, 448).to(E4M3)
    b = (torch.randn(384, 512) * 50).clamp(-448, 448).to(E4M3).t()
    sa, sb = torch.rand(256, 1) + 0.1, torch.rand(1, 384) + 0.1
    real = torch._scaled_mm(a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16)
    emulated = fp8_gemm.emulated_scaled_mm(a, b, sa, sb)
    # the emulation: one bf16 rounding of the exact value, plus float32's accumulation error
    exact = (a.double() @ b.double()) * sa.double() * sb.double()
    terms = (a.double().abs() @ b.double().abs()) * sa.double() * sb.double()
    bound = exact.abs() * 2.0**-8 + terms * (a.shape[1] + 4) * 2.0**-24
    assert ((emulated.double() - exact).abs() <= bound).all()
    # torch's CPU kernel within the same bound nearly everywhere (so within two of the
    # emulation): on a CPU with AMX (oneDNN's bf16 path) it was 2.3% off at 1 element of
    # 98,304, where the emulation was 0.39% (the exact value's bf16 rounding)
    close = (real.double() - exact).abs() <= bound
    assert close.double().mean() > 0.999


@pytest.mark.parametrize("dtype", [E4M3, FNUZ])
def test_the_gpu_call_passes_torchs_scaled_mm_checks_on_fake_cuda_tensors(dtype):
    """The real ``torch._scaled_mm`` call, forward and input gradient, on fake CUDA tensors:
    torch's meta function checks layouts (row-major A, column-major B), multiples of 16, the
    scales' shapes, dtypes and contiguity, exactly as on a GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        qdata = torch.empty(192, 64, device="cuda", dtype=E4M3)  # a stored FP8 weight
        scale = torch.empty(192, device="cuda")
        for lead in ((6, 10), (7,)):  # [batch, seq, features] and [tokens, features]
            x = torch.empty(*lead, 64, device="cuda", dtype=torch.bfloat16)
            y = fp8_gemm.linear(x, qdata, scale, dtype, torch.bfloat16)
            assert (y.shape, y.dtype, y.device.type) == ((*lead, 192), torch.bfloat16, "cuda")
            dy = torch.empty(*lead, 192, device="cuda", dtype=torch.bfloat16)
            dx = fp8_gemm.input_grad(dy, qdata, scale, dtype, torch.float32)
            assert (dx.shape, dx.dtype) == ((*lead, 64), torch.float32)


# -- a few LoRA steps, the FP8 path forced on the CPU --------------------------------------

SIZES = {**MPT_TINY, "d_model": 64, **LLAMA_STYLE}


def lora_fp8_model(gemm: str) -> torch.nn.Module:
    from foundryx.models.mpt.composer import ComposerMPTCausalLM

    torch.manual_seed(0)
    model = ComposerMPTCausalLM(**SIZES)
    apply_lora(model, LoraOptions(target_modules="all-linear", r=4, lora_alpha=8))
    apply_frozen_storage(model, FrozenBaseOptions(dtype="fp8", fp8_gemm=gemm), device="cpu")
    with torch.no_grad():  # B != 0, so that gradients flow through every frozen layer's dx
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.02, generator=torch.Generator().manual_seed(len(name)))
    return model


def test_lora_steps_on_the_fp8_path_track_the_cast_path(monkeypatch):
    cast, fp8 = lora_fp8_model("auto"), lora_fp8_model("tensor_cores")
    layers = [m for m in fp8.modules() if isinstance(m, LowPrecisionLinear)]
    assert layers and all(m.fp8_gemm is E4M3 for m in layers)
    assert all(m.fp8_gemm is None for m in cast.modules() if isinstance(m, LowPrecisionLinear))
    calls = []
    real = fp8_gemm.scaled_mm
    monkeypatch.setattr(fp8_gemm, "scaled_mm", lambda *a, **k: calls.append(1) or real(*a, **k))
    batch = token_batch()
    opts = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2)
            for m in (cast, fp8)]
    for step in range(4):
        losses, grads = [], []
        for model, opt in zip((cast, fp8), opts):
            loss = model.loss(model(batch), batch)
            loss.backward()
            losses.append(loss.item())
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()
                                    if p.requires_grad]))
            opt.step()
            opt.zero_grad()
        assert abs(losses[1] - losses[0]) <= LOSS_TOL * losses[0], (step, losses)
        err = ((grads[1] - grads[0]).norm() / grads[0].norm()).item()
        cos = torch.nn.functional.cosine_similarity(grads[0], grads[1], dim=0).item()
        assert err <= GRAD_TOL and cos >= GRAD_COS, (step, err, cos)
        assert losses[1] != losses[0], (step, losses)  # the FP8 path is another computation
    # every frozen layer's forward, and the input gradient of all but the first (its input,
    # the frozen embedding's, needs none), in FP8
    assert len(calls) == 4 * (2 * len(layers) - 1), len(calls)


def test_the_fp8_path_returns_autocasts_dtype_and_the_inputs_gradient_dtype(monkeypatch):
    [layer] = fp8_layers(1)
    fp8_gemm.choose(torch.device("cpu"), [layer], gemm="tensor_cores")
    x = torch.randn(3, 5, 32, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert x.grad.dtype == torch.float32 and x.grad.shape == x.shape
    assert layer(x).dtype == torch.float32  # no autocast: the input's dtype


def test_the_lines_docs_quote_are_the_lines_choose_logs(monkeypatch, caplog):
    from pathlib import Path

    caplog.set_level(logging.INFO, logger=fp8_gemm.__name__)
    docs = " ".join((Path(__file__).parents[1] / "docs/finetuning.md").read_text().split())
    layers = fp8_layers(224, (16, 16))  # the 8B model's 32 x 7 frozen layers
    monkeypatch.setattr(fp8_gemm, "probe", lambda device, dtype: None)
    monkeypatch.setattr(fp8_gemm, "kernel_check", lambda device, dtype: None)
    for answer in (("float8_e4m3fn", "NVIDIA H100 80GB HBM3 (sm90)"),
                   (None, "NVIDIA A100-SXM4-80GB (sm80)")):
        monkeypatch.setattr(fp8_gemm, "device_fp8_gemm", lambda d, a=answer: a)
        caplog.clear()
        fp8_gemm.choose(torch.device("cuda", 0), layers)
        [line] = [r.getMessage() for r in caplog.records]
        assert f"`{line}`" in docs, line
