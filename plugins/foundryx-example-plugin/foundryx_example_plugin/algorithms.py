"""An algorithm plugin: freeze the parameters whose names contain given words.

Registered under ``foundryx_algorithms`` as ``freeze_parameters``; a run YAML names it::

    algorithms:
      freeze_parameters:
        name_contains: [wte, wpe]     # GPT-2's token and position embeddings

Its options are a dataclass, so ``foundryx train --dry-run`` checks them (unknown keys with a
did-you-mean, types) and the builder passes an instance.
"""

from __future__ import annotations

from dataclasses import dataclass

from composer.core import Algorithm, Event, State
from composer.loggers import Logger

from foundryx.config.types import option


@dataclass
class FreezeOptions:
    """The ``freeze_parameters`` algorithm section."""

    name_contains: list[str] = option("freeze parameters whose names contain any of these",
                                      default_factory=lambda: ["wte"])

    def problems(self) -> list[str]:
        return [] if self.name_contains else ["name_contains: give at least one word"]


class FreezeParameters(Algorithm):
    """On ``FIT_START``, set ``requires_grad = False`` on the matching parameters (the
    optimizer then skips them) and log their count as ``freeze_parameters/frozen``."""

    def __init__(self, options: FreezeOptions | None = None):
        self.options = options or FreezeOptions()
        self.frozen: list[str] = []

    def match(self, event: Event, state: State) -> bool:
        return event == Event.FIT_START

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        for name, p in state.model.named_parameters():
            if any(word in name for word in self.options.name_contains):
                p.requires_grad_(False)
                self.frozen.append(name)
        logger.log_metrics({"freeze_parameters/frozen": len(self.frozen)})
