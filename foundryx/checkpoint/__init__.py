"""Sharded, atomically committed checkpoints with autoresume (see docs/checkpoints.md).

``load_model_weights(path)`` reads the full model state dict of a checkpoint in one process.
"""

from foundryx.checkpoint.weights import load_model_weights

__all__ = ["load_model_weights"]
