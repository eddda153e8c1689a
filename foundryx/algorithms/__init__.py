"""Composer's algorithms that apply to LLMs, as ``algorithms`` registry entries (pyproject.toml).

EMA (``ema``) and sequence-length warmup (``seq_length_warmup``) are Composer's classes as they
are. The ones here wrap Composer's where it would otherwise do nothing without saying so, or do
the wrong thing to our models: they say so (one log line) or refuse (a ConfigError naming the
model and the reason, before the run writes anything: see :func:`check_algorithms`).
"""

from __future__ import annotations

from typing import Any

from foundryx.errors import ConfigError


def check_algorithms(algorithms: list[Any], model: Any) -> None:
    """Ask each algorithm that can (a ``problems_with_model(model) -> list[str]`` method) whether
    it applies to ``model``; one ConfigError with every problem. ``foundryx train`` calls it
    after building the model and before the Trainer."""
    problems = [p for a in algorithms if callable(getattr(a, "problems_with_model", None))
                for p in a.problems_with_model(model)]
    if problems:
        raise ConfigError(problems)
