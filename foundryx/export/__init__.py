"""Hugging Face export: checkpoints and live models → safetensors, config and tokenizer.

``export_checkpoint`` is ``foundryx export`` (the model rebuilt by
:func:`foundryx.checkpoint.rebuild.rebuild_model`); the ``hf_export`` callback uses
``export_weights``. See docs/hf.md.
"""

from foundryx.checkpoint.metadata import write_model_metadata  # where it lived before
from foundryx.export.core import FORMATS, ExportSpec, export_checkpoint, export_weights

__all__ = ["FORMATS", "ExportSpec", "export_checkpoint", "export_weights", "write_model_metadata"]
