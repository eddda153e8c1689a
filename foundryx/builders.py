"""Config → objects, only through the registries."""

from __future__ import annotations

import logging
from typing import Any

from foundryx import registry
from foundryx.config import Derived, TrainConfig

log = logging.getLogger(__name__)


def split_name(section: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``{name: x, a: 1}`` → ``("x", {"a": 1})``."""
    return section["name"], {k: v for k, v in section.items() if k != "name"}


def build_component(reg_name: str, section: dict[str, Any], **supplied: Any) -> Any:
    """Call the registered object named by ``section['name']`` with the section's options."""
    name, kwargs = split_name(section)
    return registry.get_registry(reg_name).get(name)(**supplied, **kwargs)


def build_named(reg_name: str, mapping: dict[str, dict[str, Any] | None]) -> list[Any]:
    """``{key: kwargs}`` → one object per registry key (algorithms, callbacks, loggers)."""
    reg = registry.get_registry(reg_name)
    return [reg.get(name)(**(kwargs or {})) for name, kwargs in mapping.items()]


def build_tokenizer(cfg: TrainConfig) -> Any:
    return build_component("tokenizers", cfg.tokenizer)


def build_model(cfg: TrainConfig, tokenizer: Any) -> Any:
    return build_component("models", cfg.model, tokenizer=tokenizer)


def build_dataloader(section: dict[str, Any], tokenizer: Any, device_batch_size: int) -> Any:
    """Dataloader factories get the whole section: ``factory(cfg, tokenizer, batch_size)``."""
    factory = registry.dataloaders.get(section["name"])
    return factory(section, tokenizer, device_batch_size)


def build_optimizer(cfg: TrainConfig, model: Any) -> Any:
    section = dict(cfg.optimizer)
    if isinstance(section.get("betas"), list):
        section["betas"] = tuple(section["betas"])
    return build_component("optimizers", section, params=model.parameters())


def build_scheduler(cfg: TrainConfig) -> Any:
    return build_component("schedulers", cfg.scheduler)


def build_parallelism(cfg: TrainConfig, derived: Derived) -> dict[str, Any] | None:
    """The Composer parallelism config for ``fsdp_config`` (FSDP2), or None."""
    if cfg.fsdp_config is None:
        return None
    if derived.world_size == 1:
        log.info("fsdp_config is set but this is one process: training without FSDP sharding")
        return None
    from composer.utils.parallelism import FSDP2Config

    return {"fsdp": FSDP2Config(**cfg.fsdp_config)}
