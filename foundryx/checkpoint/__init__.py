"""Sharded, atomically committed checkpoints with autoresume (see docs/checkpoints.md).

``load_model_weights(path)`` reads the full model state dict of a checkpoint in one process;
``rebuild_model(path)`` rebuilds the checkpoint's model through the registries, with its weights.
"""

from foundryx.checkpoint.rebuild import RebuiltModel, rebuild_model
from foundryx.checkpoint.weights import load_model_weights

__all__ = ["RebuiltModel", "load_model_weights", "rebuild_model"]
