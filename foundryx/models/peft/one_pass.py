"""LoRA's adapter path in one pass (issue 51): PEFT's ``lora.Linear`` with its forward's
adapter half replaced, registered through PEFT's own custom-module mapping (``lora.py``'s
``plain_linear_dispatch``), so the state-dict keys, ``merge``/``unmerge`` and every
``isinstance(m, LoraLayer)`` stay PEFT's.

PEFT's forward, per adapted layer: ``base(x)``; ``x.to(float32)`` (the adapters' dtype: an
activation-sized float32 copy); dropout on that copy (float32 again, and a mask); autocast's
cast back to bf16 for ``lora_A``; ``lora_B``; ``* scaling``; ``result + ...``: five
activation-sized passes besides the GEMMs, each again in the checkpointed recompute and
mirrored in backward. Here (:class:`_AdapterAdd`): dropout in the compute dtype (the base
output's: bf16 under autocast), ``t = h Aᵀ`` (rank r), and ``result += scaling · t Bᵀ`` in
place as one ``addmm_``; backward goes through rank r first (``g B``, then ``A``), with the
dropout's own backward. Numerically the same product (the float32 copy was rounded back to
bf16 before ``lora_A``); the adapters' gradients come out in their own dtype.

A layer takes PEFT's own forward where the one pass does not apply (merged, adapters off,
several active adapters, a LoRA variant such as DoRA, extra forward arguments), and where the
parallelism applied from outside made its adapters tensor-parallel (``parallel/tp_lora.py``
sets ``one_pass = False``, saying so).
"""

from __future__ import annotations

from typing import Any

import torch
from peft.tuners.lora.layer import Linear as PeftLinear  # this module is imported only with peft


class _AdapterAdd(torch.autograd.Function):
    """``result + scaling · dropout(x) Aᵀ Bᵀ``, written into ``result``."""

    @staticmethod
    def forward(ctx, result, x, a, b, scaling, p, training):  # noqa: ANN001, ANN205, D102
        dtype = result.dtype
        h = x.reshape(-1, x.shape[-1]).to(dtype)
        mask = None
        if p > 0 and training:
            h, mask = torch.native_dropout(h, p, True)
        a_c, b_c = a.to(dtype), b.to(dtype)
        t = h @ a_c.t()
        # B's output added into the base output in place, unless that output is a view (of a
        # custom op's output: autograd refuses to change those in place) or not contiguous
        if result.is_contiguous() and not result._is_view():
            result.view(-1, result.shape[-1]).addmm_(t, b_c.t(), alpha=scaling)
            ctx.mark_dirty(result)
        else:
            result = torch.addmm(result.reshape(-1, result.shape[-1]), t, b_c.t(),
                                 alpha=scaling).view(result.shape)
        ctx.save_for_backward(h, mask, a_c, b_c, t)
        ctx.scaling, ctx.p, ctx.x_meta, ctx.dtypes = scaling, p, (x.shape, x.dtype), (a.dtype, b.dtype)
        return result

    @staticmethod
    def backward(ctx, grad):  # noqa: ANN001, ANN205, D102
        h, mask, a_c, b_c, t = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1]).to(h.dtype)
        dt = (g @ b_c).mul_(ctx.scaling)  # rank r first: (tokens, r)
        da = db = dx = None
        if ctx.needs_input_grad[2]:
            da = (dt.t() @ h).to(ctx.dtypes[0])
        if ctx.needs_input_grad[3]:
            db = (g.t() @ t).mul_(ctx.scaling).to(ctx.dtypes[1])
        if ctx.needs_input_grad[1]:
            dh = dt @ a_c
            if mask is not None:
                dh = torch.ops.aten.native_dropout_backward(dh, mask, 1.0 / (1.0 - ctx.p))
            shape, dtype = ctx.x_meta
            dx = dh.view(shape).to(dtype)
        return grad, dx, da, db, None, None, None


def adapter_add(result: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                scaling: float, p: float, training: bool) -> torch.Tensor:
    """``result + scaling · B(A(dropout_p(x)))``, in place in ``result`` (see the module doc)."""
    return _AdapterAdd.apply(result, x, a, b, scaling, p, training)


class OnePassLoraLinear(PeftLinear):
    """PEFT's ``lora.Linear`` whose forward runs the adapter path in one pass."""

    one_pass = True  # an instance sets it False where the one pass does not apply

    def applies(self, args: tuple, kwargs: dict[str, Any]) -> bool:
        """Whether this call can take the one pass (else PEFT's own forward)."""
        active = self.active_adapters
        return (self.one_pass and not args and not kwargs and not self.disable_adapters
                and not self.merged and len(active) == 1 and active[0] in self.lora_A
                and active[0] not in getattr(self, "lora_variant", {})
                and not getattr(self, "use_dora", {}).get(active[0], False))

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not self.applies(args, kwargs):
            return super().forward(x, *args, **kwargs)
        key = self.active_adapters[0]
        dropout = self.lora_dropout[key]
        return adapter_add(self.base_layer(x), x, self.lora_A[key].weight,
                           self.lora_B[key].weight, self.scaling[key],
                           float(getattr(dropout, "p", 0.0)), self.training)
