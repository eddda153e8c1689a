"""Hugging Face export: checkpoints and live models → safetensors, config and tokenizer.

``export_checkpoint`` is ``foundryx export``; the ``hf_export`` callback uses
``export_weights``. See docs/hf.md.
"""

from foundryx.export.core import FORMATS, export_checkpoint, export_weights
from foundryx.export.source import ModelSpec, write_model_metadata

__all__ = ["FORMATS", "ModelSpec", "export_checkpoint", "export_weights", "write_model_metadata"]
