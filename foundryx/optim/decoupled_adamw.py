"""``decoupled_adamw``: Composer's DecoupledAdamW, whose step runs torch's multi-tensor AdamW
kernels on a GPU instead of a Python loop of per-parameter ops.

YAML::

    optimizer:
      name: decoupled_adamw
      lr: 2.0e-4
      betas: [0.9, 0.95]
      eps: 1.0e-8
      weight_decay: 1.0e-5      # decoupled: each step multiplies the weights by 1 - wd * lr / initial lr
      implementation: auto      # auto (default) | fused | foreach | for-loop

The math is Composer's ``composer.optim.DecoupledAdamW``: before the Adam update each weight
is multiplied by ``1 - weight_decay * lr / initial_lr`` (``initial_lr``: the group's learning
rate when the optimizer was built, which the warmup schedulers scale), so the decay follows
the schedule but is not scaled by the learning rate itself. torch's AdamW multiplies by
``1 - lr * weight_decay``, so Composer's step is torch's AdamW with ``weight_decay`` set to
``weight_decay / initial_lr`` at every step; everything else (the moments, the bias corrections,
``eps`` added after the square root, amsgrad) is the same algorithm. Hence the
implementations, all torch's or Composer's own code:

- ``for-loop``: Composer's per-parameter loop, as it is (about 9 kernels a parameter);
- ``foreach``: torch's multi-tensor AdamW (``torch._foreach_*`` ops over all the parameters of
  a device and dtype: about 10 launches in all, whatever the number of parameters);
- ``fused``: torch's fused AdamW kernel (``torch._fused_adamw_``: one multi-tensor kernel, the
  update computed in float32 and rounded once, also for bf16 weights);
- ``auto``: ``fused`` for parameters on a GPU (CUDA, ROCm, XPU), as Hugging Face's Trainer
  and torchtitan default to; ``for-loop`` elsewhere (on a CPU: Composer's numbers, bit for bit).
  The choice is logged once.

The implementations differ only in floating-point rounding (torch's moment update is a
``lerp``, Composer's a multiply and add; fused rounds a bf16 update once), tested against
Composer's over a warmup + cosine schedule. The optimizer state is Composer's (``step``,
``exp_avg``, ``exp_avg_sq``, ``max_exp_avg_sq`` per parameter; the groups' ``initial_lr``), so
a checkpoint written with Composer's DecoupledAdamW resumes here and the other way round;
Composer's OptimizerMonitor reads the same per-parameter metrics (it is a subclass). Only the
``step`` counter moves: to the host for ``foreach`` (torch reads it there without a device
sync), to the parameter's device otherwise.

Parameters are stepped in groups of one device and one device mesh (DTensors of the shard and
tensor-parallel meshes side by side: torch's multi-tensor ops take one mesh at a time).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

import torch
from composer.optim import DecoupledAdamW as _ComposerDecoupledAdamW
from torch.optim.adamw import adamw as _torch_adamw

from foundryx.config.types import option, options_or_fields

log = logging.getLogger(__name__)

IMPLEMENTATIONS = ("auto", "fused", "foreach", "for-loop")
GPU_DEVICE_TYPES = ("cuda", "xpu")  # ROCm's torch names its GPUs cuda too


def _two_betas(value: Any) -> bool:
    return (len(value) == 2 and all(isinstance(b, (int, float)) and not isinstance(b, bool)
                                    and 0 <= b < 1 for b in value))


@dataclass
class DecoupledAdamWOptions:
    """``optimizer`` with ``name: decoupled_adamw``: Adam with weight decay decoupled from the
    learning rate (Composer's DecoupledAdamW), on torch's multi-tensor kernels on a GPU."""

    lr: float = option("learning rate (the schedulers scale it)", default=1e-3, ge=0)
    betas: list[float] | tuple = option(
        "the moments' decay rates [beta1, beta2]", default_factory=lambda: [0.9, 0.95],
        check=(_two_betas, "two numbers in [0, 1)"))
    eps: float = option("added to the square root of the second moment", default=1e-8, ge=0)
    weight_decay: float = option(
        "decoupled weight decay: each step multiplies the weights by 1 - weight_decay * lr / "
        "initial lr (not scaled by the learning rate itself)", default=1e-5, ge=0)
    amsgrad: bool = option("the AMSGrad variant (the running maximum of the second moment)",
                           default=False)
    implementation: Literal["auto", "fused", "foreach", "for-loop"] = option(
        "auto: fused on a GPU, for-loop elsewhere; fused: torch's fused AdamW kernel; foreach: "
        "torch's multi-tensor ops; for-loop: Composer's per-parameter loop. The same math, "
        "rounded differently", default="auto")


def torch_weight_decay(weight_decay: float, lr: float, initial_lr: float) -> float | None:
    """torch AdamW's ``weight_decay`` that multiplies the weights by Composer's factor
    ``1 - weight_decay * (lr / initial_lr if initial_lr else 1)``; None when no torch value
    does (``lr`` and ``initial_lr`` both 0 and a decay: the caller multiplies)."""
    if weight_decay == 0:
        return 0.0
    if initial_lr:
        return weight_decay / initial_lr
    if lr:
        return weight_decay / lr
    return None


class DecoupledAdamW(_ComposerDecoupledAdamW):
    """See the module docstring. ``DecoupledAdamW(params, lr=2e-4, implementation="fused")``
    or ``DecoupledAdamW(params, options=DecoupledAdamWOptions(...))``."""

    def __init__(self, params: Iterable[torch.Tensor] | Iterable[dict],
                 options: DecoupledAdamWOptions | None = None, **fields: Any):
        o = options_or_fields(DecoupledAdamWOptions, options, fields,
                              "the 'decoupled_adamw' optimizer")
        super().__init__(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                         weight_decay=o.weight_decay, amsgrad=o.amsgrad)
        self.implementation = o.implementation
        self._said: set[tuple[str, str]] = set()

    def __getstate__(self) -> dict[str, Any]:
        return {**super().__getstate__(), "implementation": self.implementation}

    def chosen(self, device: torch.device) -> str:
        """The implementation that steps parameters on ``device``."""
        if self.implementation != "auto":
            return self.implementation
        choice = "fused" if device.type in GPU_DEVICE_TYPES else "for-loop"
        said = getattr(self, "_said", set())
        if (choice, device.type) not in said:
            said.add((choice, device.type))
            self._said = said
            log.info("optimizer.implementation: auto: %s for the parameters on %s (%s)", choice,
                     device.type, "torch's fused AdamW kernel" if choice == "fused" else
                     "Composer's per-parameter loop; fused and foreach are for GPUs")
        return choice

    @torch.no_grad()
    def step(self, closure: Any = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            group.setdefault("initial_lr", group["lr"])
            params = [p for p in group["params"] if p.grad is not None and p.requires_grad]
            for part in kernel_groups(params):
                self._step_part(group, part, self.chosen(part[0].device))
        return loss

    def _step_part(self, group: dict, params: list[torch.Tensor], how: str) -> None:
        amsgrad = group["amsgrad"]
        grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps = [], [], [], [], []
        for p in params:
            if p.grad.is_sparse:
                raise RuntimeError("AdamW does not support sparse gradients")
            # torch reads a foreach step count on the host without a sync; the fused kernel
            # and Composer's loop keep it beside the parameter (Composer's layout)
            where = torch.device("cpu") if how == "foreach" else p.device
            state = self.state[p]
            if "step" not in state:
                state["step"] = torch.zeros((), dtype=torch.float, device=where)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if amsgrad:
                    state["max_exp_avg_sq"] = torch.zeros_like(
                        p, memory_format=torch.preserve_format)
            elif state["step"].device != where:  # resumed, or another implementation before
                state["step"] = state["step"].to(where)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            if amsgrad:
                max_exp_avg_sqs.append(state["max_exp_avg_sq"])
            steps.append(state["step"])
        beta1, beta2 = group["betas"]
        lr, initial_lr, wd = group["lr"], group["initial_lr"], group["weight_decay"]
        if how == "for-loop":
            for s in steps:
                s += 1
            self.adamw(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                       amsgrad=amsgrad, beta1=beta1, beta2=beta2, lr=lr, initial_lr=initial_lr,
                       weight_decay=wd, eps=group["eps"])
            return
        coupled = torch_weight_decay(wd, lr, initial_lr)
        if coupled is None:  # lr and initial lr 0: Composer multiplies by 1 - weight_decay
            torch._foreach_mul_(params, 1 - wd)
            coupled = 0.0
        _torch_adamw(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, steps,
                     foreach=how == "foreach", fused=how == "fused",
                     has_complex=any(torch.is_complex(p) for p in params),
                     amsgrad=amsgrad, beta1=beta1, beta2=beta2, lr=lr, weight_decay=coupled,
                     eps=group["eps"], maximize=False)


def kernel_groups(params: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``params`` in the groups one multi-tensor call can take: one device and one device mesh
    each (plain tensors: no mesh), in their order."""
    from torch.distributed.tensor import DTensor

    groups: dict[tuple, list[torch.Tensor]] = {}
    for p in params:
        mesh = p.device_mesh if isinstance(p, DTensor) else None
        groups.setdefault((p.device, mesh), []).append(p)
    return list(groups.values())


