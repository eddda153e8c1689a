"""The ``head_norm`` tensor-parallel style: a norm over each attention head's features that
runs on a rank's own heads (Qwen3's and Gemma 3's ``q_norm`` and ``k_norm``, between a
column-split q/k projection and attention).

Its weight is replicated, but each rank's forward sees only its heads, so each rank's gradient
is a partial sum: left alone, the ranks' copies of the weight would drift apart. Here the weight
is a ``Replicate`` DTensor and the input is taken as a shard of the whole (over dim 0: the norm
reduces over the last dim only, so which other dim is named does not change its result), which
makes DTensor sum the weight's gradient over the TP ranks, as it does for the sequence-parallel
norms. The output goes back as a plain tensor.
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle


class HeadNorm(ParallelStyle):
    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
        from torch.distributed.tensor.parallel.style import distribute_module

        def replicate(name: str, mod: nn.Module, mesh: DeviceMesh) -> None:
            for pname, p in list(mod.named_parameters(recurse=False)):
                mod.register_parameter(pname, nn.Parameter(
                    distribute_tensor(p, mesh, [Replicate()]), requires_grad=p.requires_grad))

        def as_shard(mod: nn.Module, inputs: tuple[Any, ...], mesh: DeviceMesh) -> tuple[Any, ...]:
            x, *rest = inputs
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, [Shard(0)], run_check=False)
            return (x, *rest)

        def local(mod: nn.Module, output: Any, mesh: DeviceMesh) -> Any:
            return output.to_local() if isinstance(output, DTensor) else output

        return distribute_module(module, device_mesh, replicate, as_shard, local)
