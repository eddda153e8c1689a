"""Which modules are transformer blocks, which to checkpoint, and how to initialise them.

The model provides the policy, with Composer's hook names, on the ComposerModel or on one of
its direct children (e.g. the wrapped Hugging Face model):

- ``fsdp_wrap_fn(module) -> bool``: the transformer blocks (FSDP units, compile units);
- ``activation_checkpointing_fn(module) -> bool``: modules to checkpoint (default: blocks);
- ``param_init_fn(module)``: initialise the parameters ``module`` itself owns after
  ``to_empty`` (inherited down the tree; else the module's ``reset_parameters``).

Without ``fsdp_wrap_fn`` the classes named in a Hugging Face model's ``_no_split_modules``
are the blocks.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from torch import nn

from foundryx.errors import ConfigError, did_you_mean

log = logging.getLogger(__name__)


def _owners(model: nn.Module) -> list[nn.Module]:
    """The model and its direct children: where Composer looks for policy hooks."""
    return [model, *model.children()]


def find_hook(model: nn.Module, name: str) -> Callable[[nn.Module], Any] | None:
    for owner in _owners(model):
        fn = getattr(owner, name, None)
        if callable(fn):
            return fn
    return None


def blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The transformer blocks of ``model`` in forward order, as ``(qualified name, module)``."""
    wrap = find_hook(model, "fsdp_wrap_fn")
    if wrap is None:
        names = {n for m in model.modules() for n in (getattr(m, "_no_split_modules", None) or [])}
        if not names:
            return []
        log.info("transformer blocks: classes %s (the model's _no_split_modules; it defines no "
                 "fsdp_wrap_fn)", sorted(names))
        return [(n, m) for n, m in model.named_modules() if type(m).__name__ in names]
    return [(n, m) for n, m in model.named_modules() if m is not model and wrap(m)]


def checkpoint_targets(model: nn.Module, class_names: list[str] | None, every: int) -> list[tuple[str, nn.Module]]:
    """Modules whose activations are recomputed: the chosen classes (or the model's
    ``activation_checkpointing_fn``, or its blocks), then every ``every``-th of them."""
    if every < 1:
        raise ConfigError([f"activation_checkpointing.every: must be >= 1, got {every}"])
    if class_names:
        present = {type(m).__name__ for m in model.modules()}
        missing = [c for c in class_names if c not in present]
        if missing:
            raise ConfigError([
                f"activation_checkpointing.modules: no module of class {c!r} in the "
                f"model{did_you_mean(c, present)}" for c in missing
            ])
        chosen = [(n, m) for n, m in model.named_modules() if type(m).__name__ in class_names]
    else:
        fn = find_hook(model, "activation_checkpointing_fn")
        chosen = ([(n, m) for n, m in model.named_modules() if m is not model and fn(m)]
                  if fn is not None else blocks(model))
    return [nm for i, nm in enumerate(chosen) if (i + 1) % every == 0]


def init_function(module: nn.Module, inherited: Callable | None) -> Callable | None:
    """The ``param_init_fn`` that applies to ``module`` (its own, else its parent's)."""
    own = getattr(module, "param_init_fn", None)
    return own if callable(own) else inherited
