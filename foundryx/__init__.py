"""foundryx: a plugin-based LLM training framework on Composer."""

__version__ = "0.1.0"
