"""``decoupled_adamw`` (foundryx.optim.decoupled_adamw): Composer's DecoupledAdamW on torch's
multi-tensor kernels. The same numbers as Composer's over a warmup + cosine schedule with weight
decay, whichever implementation; auto's choice by device; the options checked as data."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from composer.optim import DecoupledAdamW as ComposerDecoupledAdamW
from torch.utils._python_dispatch import TorchDispatchMode

from foundryx import registry
from foundryx.config.components import component_problems
from foundryx.errors import ConfigError
from foundryx.optim.decoupled_adamw import DecoupledAdamW, torch_weight_decay

SHAPES = [(8, 16), (16,), (4, 3, 5), (1,), (33, 7)]
IMPLEMENTATIONS = ("for-loop", "foreach", "fused")
STEPS, WARMUP, LR, WD = 10, 3, 1e-2, 5e-4


def warmup_cosine(step: int) -> float:
    """Composer's cosine-with-warmup multiplier (alpha_f 0) after ``step`` steps."""
    if step < WARMUP:
        return (step + 1) / WARMUP
    return 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / (STEPS - WARMUP)))


def train(make, dtype: torch.dtype) -> tuple[list[torch.nn.Parameter], torch.optim.Optimizer]:
    """``STEPS`` steps of ``make(params)`` on fixed random gradients with a warmup + cosine
    schedule: the trained parameters, then a frozen one and one that never gets a gradient."""
    g = torch.Generator().manual_seed(0)
    trained = [torch.nn.Parameter(torch.randn(s, generator=g).to(dtype)) for s in SHAPES]
    frozen = torch.nn.Parameter(torch.randn(3, 3, generator=g).to(dtype), requires_grad=False)
    unused = torch.nn.Parameter(torch.randn(5, generator=g).to(dtype))
    opt = make([trained[0], frozen, *trained[1:], unused])
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
    for _ in range(STEPS):
        for p in trained:
            p.grad = torch.randn(p.shape, generator=g).to(dtype)
        opt.step()
        schedule.step()
    return [*trained, frozen, unused], opt


def composer(params):
    return ComposerDecoupledAdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=WD)


def ours(implementation: str):
    return lambda params: DecoupledAdamW(params, lr=LR, betas=(0.9, 0.95), weight_decay=WD,
                                         implementation=implementation)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_float32_is_composers_to_rounding(implementation):
    want, want_opt = train(composer, torch.float32)
    got, got_opt = train(ours(implementation), torch.float32)
    initial, _ = train(lambda params: ComposerDecoupledAdamW(params, lr=0.0, weight_decay=0.0),
                       torch.float32)
    if implementation == "for-loop":  # Composer's own loop
        assert all(torch.equal(a, b) for a, b in zip(got, want))
    # a few float32 ulps apart (torch's moment update is a lerp, Composer's a multiply-add)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=4e-7, atol=1e-7)
    # the decay and the updates happened (a decay factor not scaled by 1 / initial_lr would
    # leave each weight ~1e-3 of itself away from Composer's)
    assert all((a - b).abs().max() > 1e-4 for a, b in zip(got[:len(SHAPES)], initial))
    # the frozen parameter and the one without a gradient: untouched, and no state
    assert torch.equal(got[-2], initial[-2]) and torch.equal(got[-1], initial[-1])
    assert set(map(id, got_opt.state)) == set(map(id, got[:len(SHAPES)]))
    for p, q in zip(got[:len(SHAPES)], want[:len(SHAPES)]):
        s, t = got_opt.state[p], want_opt.state[q]
        assert s.keys() == t.keys() and float(s["step"]) == float(t["step"]) == STEPS
        torch.testing.assert_close(s["exp_avg"], t["exp_avg"], rtol=4e-7, atol=1e-7)
        torch.testing.assert_close(s["exp_avg_sq"], t["exp_avg_sq"], rtol=4e-7, atol=1e-9)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_bfloat16_is_as_close_to_the_math_as_composers(implementation):
    """bf16 weights round at each op (Composer, foreach) or once (fused): against the float64
    run of Composer's, each implementation is within 1.25x Composer's own bf16 error."""
    exact, _ = train(composer, torch.float64)
    base, _ = train(composer, torch.bfloat16)
    got, _ = train(ours(implementation), torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in got)

    def error(ps):
        return max(float((p.double() - e).abs().max()) for p, e in zip(ps, exact))

    assert 0 < error(base) < 0.2  # bf16 rounding, a few ulps of weights near 1..4
    assert error(got) <= 1.25 * error(base)


def test_torch_weight_decay_is_composers_factor():
    # Composer: 1 - wd * lr / initial_lr (1 - wd when initial_lr is 0); torch: 1 - lr * wd'
    for wd, lr, initial in ((1e-5, 2e-4, 4e-4), (0.1, 0.5, 1.0), (1e-3, 3e-4, 0.0), (0.0, 1.0, 1.0)):
        wd_torch = torch_weight_decay(wd, lr, initial)
        composer_factor = 1 - wd * (lr / initial if initial else 1.0)
        assert math.isclose(1 - lr * wd_torch, composer_factor, rel_tol=1e-15)
    assert torch_weight_decay(1e-3, 0.0, 0.0) is None  # no torch value: the caller multiplies


@pytest.mark.parametrize("implementation", ("foreach", "fused"))
def test_zero_lr_and_initial_lr_still_decay_as_composer(implementation):
    def make(cls, **kw):
        return lambda params: cls(params, lr=0.0, weight_decay=WD, **kw)

    want, _ = train(make(ComposerDecoupledAdamW), torch.float32)
    got, _ = train(make(DecoupledAdamW, implementation=implementation), torch.float32)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=4e-7, atol=1e-7)


def test_state_dicts_are_interchangeable_with_composers():
    """Composer's state resumes here (and ours in Composer's): the same keys and the same
    continuation as Composer's uninterrupted run."""
    want, _ = train(composer, torch.float32)
    half = STEPS // 2
    for first, second in ((composer, ours("foreach")), (ours("fused"), composer)):
        g = torch.Generator().manual_seed(0)
        ps = [torch.nn.Parameter(torch.randn(s, generator=g)) for s in SHAPES]
        frozen = torch.nn.Parameter(torch.randn(3, 3, generator=g), requires_grad=False)
        torch.randn(5, generator=g)  # the unused parameter's draw, as train() makes it
        opt = first([ps[0], frozen, *ps[1:]])
        schedule = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
        for i in range(STEPS):
            if i == half:  # checkpoint and resume into the other optimizer
                saved_opt, saved_sched = opt.state_dict(), schedule.state_dict()
                opt = second([ps[0], frozen, *ps[1:]])
                schedule = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine)
                opt.load_state_dict(saved_opt)
                schedule.load_state_dict(saved_sched)
                assert opt.state_dict()["param_groups"] == saved_opt["param_groups"]
            for p in ps:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
            schedule.step()
        for a, b in zip(ps, want):
            torch.testing.assert_close(a, b, rtol=4e-7, atol=1e-7)


@pytest.mark.parametrize("implementation", ("foreach", "fused"))
def test_optimizer_monitor_reads_the_same_metrics(implementation):
    """Composer's OptimizerMonitor asks the optimizer for each parameter's norms (moment,
    weight, update, gradient): the same names and values as Composer's DecoupledAdamW."""
    want, want_opt = train(composer, torch.float32)
    got, got_opt = train(ours(implementation), torch.float32)
    for i, (p, q) in enumerate(zip(got[:len(SHAPES)], want[:len(SHAPES)])):
        mine = got_opt.report_per_parameter_metrics(p, f"w{i}", {})
        theirs = want_opt.report_per_parameter_metrics(q, f"w{i}", {})
        assert mine.keys() == theirs.keys() and len(mine) == 4
        for k in mine:
            torch.testing.assert_close(mine[k], theirs[k], rtol=1e-5, atol=1e-7)


class Ops(TorchDispatchMode):
    """The ops dispatched; a fake step count read on the host (``.item()``) reads 1."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func._overloadpacket.__name__)
        if func is torch.ops.aten._local_scalar_dense.default:
            return 1
        return func(*args, **(kwargs or {}))


def test_auto_is_composers_loop_on_a_cpu_and_says_so(caplog):
    caplog.set_level(logging.INFO, logger="foundryx")
    want, _ = train(composer, torch.float32)
    got, _ = train(ours("auto"), torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    said = [r.getMessage() for r in caplog.records if "optimizer.implementation" in r.getMessage()]
    assert len(said) == 1 and "for-loop for the parameters on cpu" in said[0]


def test_auto_is_fused_on_a_gpu(caplog):
    """On (fake) CUDA parameters, auto takes torch's fused kernel: one _fused_adamw_ for all
    of them and no per-parameter ops, with the step counts beside the parameters."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    caplog.set_level(logging.INFO, logger="foundryx")
    with FakeTensorMode():
        ps = [torch.nn.Parameter(torch.empty(s, device="cuda")) for s in SHAPES]
        opt = DecoupledAdamW(ps, lr=LR, weight_decay=WD)
        for p in ps:
            p.grad = torch.empty_like(p)
        opt.step()  # the state
        with Ops() as ops:
            opt.step()
    assert ops.names.count("_fused_adamw_") == 1
    assert not {"addcdiv_", "mul_", "lerp_", "sqrt"} & set(ops.names)
    assert all(opt.state[p]["step"].device.type == "cuda" for p in ps)
    assert any("auto: fused for the parameters on cuda" in r.getMessage() for r in caplog.records)


def test_foreach_keeps_its_step_counts_on_the_host():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        ps = [torch.nn.Parameter(torch.empty(s, device="cuda")) for s in SHAPES]
        opt = DecoupledAdamW(ps, lr=LR, implementation="foreach")
        for p in ps:
            p.grad = torch.empty_like(p)
        with Ops() as ops:
            opt.step()
    assert ops.names.count("_foreach_addcdiv_") == 1 and "addcdiv_" not in ops.names
    assert all(opt.state[p]["step"].device.type == "cpu" for p in ps)


def test_registered_and_options_checked_as_data():
    assert registry.optimizers.get("decoupled_adamw") is DecoupledAdamW
    problems = component_problems({"optimizer": {"name": "decoupled_adamw", "lr": 1e-4,
                                                 "implementation": "fuse", "betas": [0.9],
                                                 "weight_dacay": 0.1}})
    text = "\n".join(problems)
    assert "optimizer.implementation: expected one of" in text and "did you mean 'fused'" in text
    assert "optimizer.betas: expected two numbers in [0, 1)" in text
    assert "optimizer.weight_dacay: unknown option" in text and "'weight_decay'" in text
    with pytest.raises(ConfigError, match="implementation"):
        DecoupledAdamW([torch.nn.Parameter(torch.zeros(2))], implementation="cuda")


def _two_meshes(implementation: str) -> list[list[float]]:
    """One rank: a DTensor weight on a (shard, tp) mesh beside one on the shard mesh alone (as
    parallelism.tp leaves the split layers and LoRA's replicated halves), stepped together."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    mesh = init_device_mesh("cpu", (1, 1), mesh_dim_names=("shard", "tp"))
    g = torch.Generator().manual_seed(0)
    plain = [torch.randn(4, 3, generator=g), torch.randn(5, generator=g)]
    grads = [torch.randn(4, 3, generator=g), torch.randn(5, generator=g)]
    ps = [torch.nn.Parameter(distribute_tensor(plain[0], mesh, [Replicate(), Replicate()])),
          torch.nn.Parameter(distribute_tensor(plain[1], mesh["shard"], [Replicate()]))]
    opt = DecoupledAdamW(ps, lr=LR, weight_decay=WD, implementation=implementation)
    for _ in range(3):
        for p, gr, m in zip(ps, grads, (ps[0].device_mesh, ps[1].device_mesh)):
            p.grad = distribute_tensor(gr, m, p.placements)
        opt.step()
    return [p.full_tensor().flatten().tolist() for p in ps]


@pytest.mark.slow
@pytest.mark.parametrize("implementation", ["foreach", "fused"])
def test_dtensors_on_two_meshes_step_one_mesh_at_a_time(implementation):
    """torch's multi-tensor ops refuse DTensors of two meshes in one call; stepped one mesh at
    a time they get the plain tensors' numbers."""
    from distributed import run_distributed

    (got,) = run_distributed(_two_meshes, 1, args=(implementation,))
    g = torch.Generator().manual_seed(0)
    plain = [torch.nn.Parameter(torch.randn(4, 3, generator=g)),
             torch.nn.Parameter(torch.randn(5, generator=g))]
    grads = [torch.randn(4, 3, generator=g), torch.randn(5, generator=g)]
    opt = ComposerDecoupledAdamW(plain, lr=LR, weight_decay=WD)
    for _ in range(3):
        for p, gr in zip(plain, grads):
            p.grad = gr.clone()
        opt.step()
    for a, b in zip(got, plain):
        torch.testing.assert_close(torch.tensor(a), b.detach().flatten(), rtol=4e-7, atol=1e-7)
