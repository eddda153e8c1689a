"""cpu_matmul: fp32 products through oneDNN on a CPU match a float64 reference (values and
gradients, transposed and sliced operands), the fused loss and a training run agree with
torch's BLAS to fp32 rounding, ``auto`` picks oneDNN on x86-64 and says so in one line, and the
config rejects what it cannot do."""

from __future__ import annotations

import importlib
import logging

import pytest
import torch
from torch import nn

from foundryx.config.load import load_config
from foundryx.errors import ConfigError
from foundryx.kernels import cpu_matmul
from foundryx.models.layers.loss import linear_cross_entropy

pytestmark = pytest.mark.skipif(not cpu_matmul.onednn_available(), reason="this torch has no oneDNN")
CPU = torch.device("cpu")
# the module (foundryx.parallel re-exports its function parallelize under the same name)
par = importlib.import_module("foundryx.parallel.parallelize")


@pytest.fixture(autouse=True)
def blas_after():
    yield
    cpu_matmul.set_backend("blas")


def _close_to_float64(got: torch.Tensor, ref: torch.Tensor) -> None:
    # fp32 rounding of a sum of k products: well under 1e-5 of the largest entry
    assert got.dtype == torch.float32
    err = (got.double() - ref).abs().max() / ref.abs().max()
    assert err < 1e-5, f"relative error {err:.2e}"


@pytest.mark.parametrize("layout", ["contiguous", "a transposed", "b transposed", "row slice"])
def test_onednn_product_and_gradients_match_float64(layout):
    cpu_matmul.set_backend("onednn")
    g = torch.Generator().manual_seed(0)
    a64, b64 = torch.randn(96, 72, generator=g, dtype=torch.float64), torch.randn(72, 40, generator=g, dtype=torch.float64)
    a, b = a64.float(), b64.float()
    if layout == "a transposed":
        a = a.t().contiguous().t()
    elif layout == "b transposed":
        b = b.t().contiguous().t()
    elif layout == "row slice":
        a = torch.cat([a, a]).narrow(0, 96, 96)
    assert cpu_matmul.uses_onednn(a, b)
    a.requires_grad_(), b.requires_grad_()
    y = cpu_matmul.mm(a, b)
    _close_to_float64(y.detach(), a64 @ b64)
    up = torch.randn(96, 40, generator=g, dtype=torch.float64)
    y.backward(up.float())
    _close_to_float64(a.grad, up @ b64.t())
    _close_to_float64(b.grad, a64.t() @ up)


def test_blas_backend_is_torch_mm_and_onednn_differs_only_by_rounding():
    a, b = torch.randn(64, 256), torch.randn(256, 128)
    assert torch.equal(cpu_matmul.mm(a, b), torch.mm(a, b))  # the default backend
    cpu_matmul.set_backend("onednn")
    torch.testing.assert_close(cpu_matmul.mm(a, b), torch.mm(a, b), rtol=1e-5, atol=1e-4)
    # not fp32 CPU tensors: torch.mm, whatever the backend
    assert not cpu_matmul.uses_onednn(a.double(), b.double())
    assert torch.equal(cpu_matmul.mm(a.double(), b.double()), torch.mm(a.double(), b.double()))
    # a routed layer given what oneDNN does not take is F.linear itself
    x, w = torch.randn(4, 8, 64, dtype=torch.bfloat16), torch.randn(32, 64, dtype=torch.bfloat16)
    assert torch.equal(cpu_matmul.linear(x, w), nn.functional.linear(x, w))
    with pytest.raises(ValueError, match="one of onednn, blas"):
        cpu_matmul.set_backend("mkl")


def test_custom_op_registration_is_sound():
    # fake tensor shape, autograd registration and schema, as torch.compile relies on them
    torch.library.opcheck(cpu_matmul.onednn_mm, (torch.randn(30, 20), torch.randn(20, 10)))
    torch.library.opcheck(cpu_matmul.onednn_mm, (torch.randn(30, 20, requires_grad=True),
                                                 torch.randn(20, 10, requires_grad=True)))


def test_fused_loss_on_onednn_matches_blas():
    g = torch.Generator().manual_seed(1)
    h, w = torch.randn(2, 200, 64, generator=g), torch.randn(512, 64, generator=g) * 0.1
    labels = torch.randint(0, 512, (2, 200), generator=g)
    labels[0, :7] = -100
    results = {}
    for backend in ("blas", "onednn"):
        cpu_matmul.set_backend(backend)
        hh, ww = h.clone().requires_grad_(), w.clone().requires_grad_()
        loss = linear_cross_entropy(hh, ww, labels, scale=0.5, chunk=48)  # several chunks
        loss.backward()
        results[backend] = (loss.detach(), hh.grad, ww.grad)
    for blas, dnn in zip(results["blas"], results["onednn"]):
        torch.testing.assert_close(dnn, blas, rtol=1e-5, atol=1e-6)


def _tiny_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64, bias=False), nn.GELU(),
                         nn.Linear(64, 8))


def _train(model: nn.Module, steps: int = 30) -> list[float]:
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(256, 32, generator=g), torch.randint(0, 8, (256,), generator=g)
    losses = []
    for _ in range(steps):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_routed_linears_train_as_plain_ones(monkeypatch, caplog):
    monkeypatch.setattr(cpu_matmul.platform, "machine", lambda: "x86_64")  # auto's oneDNN case
    plain = _train(_tiny_model())
    routed_model = _tiny_model()
    with caplog.at_level(logging.INFO):
        par.parallelize(routed_model, cpu_matmul="auto", device=CPU)
    routed = _train(routed_model)
    assert cpu_matmul.backend() == "onednn"
    assert "oneDNN matmuls in 3 linear layers" in caplog.text
    assert routed[-1] < 0.7 * routed[0]  # it learns
    assert max(abs(a - b) for a, b in zip(plain, routed)) < 1e-4  # as torch's BLAS, to rounding


def test_auto_is_onednn_on_x86_and_says_so(monkeypatch, caplog):
    monkeypatch.setattr(cpu_matmul.platform, "machine", lambda: "x86_64")
    with caplog.at_level(logging.INFO):
        assert par.resolve_cpu_matmul("auto", CPU) == "onednn"
    assert "cpu_matmul: oneDNN's GEMM" in caplog.text and "cpu_matmul: blas" in caplog.text
    assert cpu_matmul.backend() == "onednn"


def test_auto_elsewhere_keeps_blas_with_the_reason(monkeypatch, caplog):
    cpu_matmul.set_backend("onednn")
    monkeypatch.setattr(cpu_matmul.platform, "machine", lambda: "aarch64")
    with caplog.at_level(logging.INFO):
        assert par.resolve_cpu_matmul("auto", CPU) == "blas"
    assert "torch's BLAS for fp32 matmuls (not measured on aarch64)" in caplog.text
    assert cpu_matmul.backend() == "blas"


def test_off_the_cpu_nothing_changes():
    assert par.resolve_cpu_matmul("onednn", torch.device("cuda")) is None
    assert cpu_matmul.backend() == "blas"


def test_onednn_without_onednn_is_a_config_error(monkeypatch):
    monkeypatch.setattr(par, "onednn_available", lambda: False)
    with pytest.raises(ConfigError, match="cpu_matmul: onednn, but this torch has no oneDNN"):
        par.resolve_cpu_matmul("onednn", CPU)


def test_config_default_and_bad_value(quickstart_data):
    base = ["variables.data_root=" + str(quickstart_data)]
    assert load_config("yamls/quickstart.yaml", base).cfg.cpu_matmul == "auto"
    assert load_config("yamls/quickstart.yaml", [*base, "cpu_matmul=blas"]).cfg.cpu_matmul == "blas"
    with pytest.raises(ConfigError) as e:
        load_config("yamls/quickstart.yaml", [*base, "cpu_matmul=mkl"])
    assert "cpu_matmul" in str(e.value) and "onednn" in str(e.value)


@pytest.mark.slow
def test_compiled_routed_block_matches_eager():
    cpu_matmul.set_backend("onednn")
    model = _tiny_model()
    par.route_linears(model)
    x = torch.randn(16, 32)
    eager = model(x)
    compiled = torch.compile(model)(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)
