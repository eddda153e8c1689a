"""Sharded, atomically committed checkpoints with autoresume (see docs/checkpoints.md).

``load_model_weights(path)`` reads the full model state dict of a checkpoint in one process;
``rebuild_model(path)`` rebuilds the checkpoint's model through the registries, with its weights.

Both are imported on first use, so that a process which needs only part of this package (each
rank's checkpoint upload process, see ``upload_process``) does not load torch and the model
registries.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RebuiltModel", "load_model_weights", "rebuild_model"]


def __getattr__(name: str) -> Any:
    if name in ("RebuiltModel", "rebuild_model"):
        from foundryx.checkpoint import rebuild  # lazy: torch and the registries

        return getattr(rebuild, name)
    if name == "load_model_weights":
        from foundryx.checkpoint import weights  # lazy: torch

        return weights.load_model_weights
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
