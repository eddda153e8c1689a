"""foundryx: a plugin-based LLM training framework on Composer."""

from foundryx.runtime import known_warnings, preempt

__version__ = "0.1.0"

# Before anything imports transformers (and through it torchao): see known_warnings.
known_warnings.install_import_filters()
# A rank foundryx's launcher started with the preemption signals held: note them from here.
preempt.release_held()
