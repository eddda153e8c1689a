"""Deprecated config forms, translated to today's on load, each with one warning line.

:func:`upgrade` runs on the resolved plain data, before validation, so a deprecated form gives
exactly the settings its replacement gives, and its problems are reported with the others
under the keys the user wrote.

- ``fsdp_config``, once one section for FSDP2 sharding and the per-block policies, is now three
  sections: ``parallelism`` (FSDP2 sharding), ``activation_checkpointing`` and ``compile``
  (the last two apply without FSDP too). Giving both forms is an error.
"""

from __future__ import annotations

import dataclasses
import logging
import typing
from collections.abc import Mapping
from typing import Any

import yaml

from foundryx.config.schema import ActivationCheckpointingConfig, CompileConfig, ParallelismConfig
from foundryx.config.types import constraint_problems, join, type_problems
from foundryx.errors import did_you_mean

log = logging.getLogger(__name__)

# fsdp_config key -> (new section, its key, the section's dataclass)
FSDP_CONFIG_KEYS: dict[str, tuple[str, str, type]] = {
    **{k: ("parallelism", k, ParallelismConfig) for k in (
        "sharding_strategy", "data_parallel_shard_degree", "reshard_after_forward",
        "mixed_precision", "cpu_offload", "verbose")},
    "activation_checkpointing": ("activation_checkpointing", "enabled", ActivationCheckpointingConfig),
    "activation_checkpointing_every": ("activation_checkpointing", "every", ActivationCheckpointingConfig),
    "activation_checkpointing_modules": ("activation_checkpointing", "modules", ActivationCheckpointingConfig),
    "activation_cpu_offload": ("activation_checkpointing", "cpu_offload", ActivationCheckpointingConfig),
    "compile": ("compile", "enabled", CompileConfig),
    "compile_options": ("compile", "options", CompileConfig),
}
FSDP_REPLACEMENTS = ("parallelism", "activation_checkpointing", "compile")


def upgrade(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """``data`` with every deprecated section rewritten in today's form, and the problems
    found in the deprecated sections (paths as written). Logs one warning per deprecated
    section present, naming what to write instead."""
    problems: list[str] = []
    if "fsdp_config" in data:
        data, problems = _upgrade_fsdp_config(data)
    return data, problems


def _upgrade_fsdp_config(data: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    old = data["fsdp_config"]
    rest = {k: v for k, v in data.items() if k != "fsdp_config"}
    given = [k for k in FSDP_REPLACEMENTS if k in data]
    if old is not None and not isinstance(old, Mapping):
        return rest, [f"fsdp_config: expected a mapping (key: value lines) or null, got {old!r}; "
                      "fsdp_config is deprecated: write parallelism, activation_checkpointing "
                      "and compile instead (see docs/distributed.md)"]
    sections, problems = translate_fsdp_config(old)
    written = ", ".join(f"{name}: {flow(value)}" for name, value in sections.items())
    if given:
        return rest, [f"fsdp_config: given together with {' and '.join(given)}, which replace "
                      "it (fsdp_config is deprecated); drop fsdp_config and write its settings in "
                      f"the new sections: {written}"] + problems
    log.warning("fsdp_config is deprecated: write %s instead", written)
    upgraded: dict[str, Any] = {}
    for key, value in data.items():  # the new sections where fsdp_config was
        if key == "fsdp_config":
            upgraded.update(sections)
        else:
            upgraded[key] = value
    return upgraded, problems


def translate_fsdp_config(old: Mapping[str, Any] | None) -> tuple[dict[str, Any], list[str]]:
    """The ``parallelism``, ``activation_checkpointing`` and ``compile`` sections that the
    ``fsdp_config`` mapping ``old`` means (``null``: ``parallelism: null``; sections with
    nothing to say left out), and the problems of ``old``: unknown keys, wrong types and
    values, each under ``fsdp_config.<key>``; a bad value is left out of the sections."""
    if old is None:
        return {"parallelism": None}, []
    sections: dict[str, Any] = {"parallelism": {}}
    problems: list[str] = []
    for key, value in old.items():
        where = join("fsdp_config", key)
        if key not in FSDP_CONFIG_KEYS:
            problems.append(f"{where}: unknown key{did_you_mean(key, FSDP_CONFIG_KEYS)}")
            continue
        section, new_key, cls = FSDP_CONFIG_KEYS[key]
        tp = typing.get_type_hints(cls)[new_key]
        meta = {f.name: f.metadata for f in dataclasses.fields(cls)}[new_key]
        found = type_problems(value, tp, where) or constraint_problems(value, meta, tp, where)
        if found:
            problems += found
        else:
            sections.setdefault(section, {})[new_key] = value
    return sections, problems


def flow(value: Any) -> str:
    """``value`` as one line of YAML, e.g. ``{enabled: true, every: 2}``."""
    return yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10**6).strip().removesuffix("\n...")
