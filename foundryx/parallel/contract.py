"""The contract that lets foundryx apply FSDP2 outside Composer, checked where it is relied on.

foundryx shards the model itself and gives Composer no ``parallelism_config``. Composer then
decides whether to wrap the model in DistributedDataParallel by ``State.fsdp_enabled``: true
when any module of ``state.model`` is an FSDP1 ``FullyShardedDataParallel`` or an FSDP2
``FSDPModule`` (composer/core/state.py); the trainer DDP-wraps only when it is false and the
world size is above 1 (composer/trainer/trainer.py). So after sharding, Composer's own test
must see the model as FSDP, and every parameter must belong to an FSDP unit: a parameter
outside every unit would be neither sharded nor all-reduced, since no DDP runs either.
"""

from __future__ import annotations

from types import SimpleNamespace

import composer
from composer.core.state import State
from torch import nn
from torch.distributed.tensor import DTensor

CONTRACT = (
    "foundryx applies FSDP2 outside Composer and relies on Composer's State.fsdp_enabled "
    "finding an FSDPModule in model.modules(), so that Composer does not also wrap the model "
    "in DistributedDataParallel (see docs/design.md)"
)


def composer_sees_fsdp(model: nn.Module) -> bool:
    """What Composer's ``State.fsdp_enabled`` says of a State holding ``model``, evaluated by
    Composer's own code (the property reads only ``state.model``)."""
    return bool(State.fsdp_enabled.fget(SimpleNamespace(model=model)))


def check_composer_contract(model: nn.Module) -> None:
    """RuntimeError unless Composer will treat the sharded ``model`` as FSDP (and skip DDP),
    and every parameter is managed by FSDP2 (a DTensor)."""
    try:
        seen = composer_sees_fsdp(model)
    except AttributeError as e:  # the property now reads more than state.model
        raise RuntimeError(
            f"cannot evaluate Composer's State.fsdp_enabled (composer {composer.__version__}) on "
            f"the sharded model ({e}); {CONTRACT}: check that contract against this Composer "
            "version and update foundryx/parallel/contract.py"
        ) from e
    if not seen:
        raise RuntimeError(
            f"Composer's State.fsdp_enabled (composer {composer.__version__}) is false for the "
            f"model foundryx sharded with FSDP2: Composer would wrap it in DDP as well. {CONTRACT}"
        )
    loose = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if loose:
        raise RuntimeError(
            f"parameters outside every FSDP2 unit: {', '.join(loose[:5])}"
            f"{' ...' if len(loose) > 5 else ''}; with FSDP applied Composer runs no DDP, so "
            f"their gradients would never be averaged across ranks. {CONTRACT}"
        )
