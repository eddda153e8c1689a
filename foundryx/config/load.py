"""Load a run config: YAML + dotlist overrides + ``${variables.x}`` → validated TrainConfig.

Two stages, so that a mistake is reported in a fraction of a second: :func:`precheck` needs no
component's code (no torch, Composer or transformers: the YAML, the overrides, the variables,
the schema, the registry names, the derived numbers); :func:`load_config` also checks each
component's options against its code, and is what a run uses. The command line runs the first
before it imports anything heavy, and the second after.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from foundryx.config.components import component_name_problems, component_problems
from foundryx.config.deprecations import upgrade as upgrade_deprecated
from foundryx.config.derived import Derived, derive, world_size_from_env
from foundryx.config.hardware import MachineFacts, combination_problems, machine_problems
from foundryx.config.schema import TrainConfig
from foundryx.config.types import dataclass_problems, join
from foundryx.config.yaml_errors import describe as describe_yaml_error
from foundryx.errors import ConfigError


@dataclass
class LoadedConfig:
    cfg: TrainConfig
    derived: Derived
    resolved: dict[str, Any]  # the plain data, after overrides and interpolation
    source: str

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.resolved, sort_keys=False)


def read_yaml(path: Path) -> DictConfig:
    """The YAML mapping at ``path``; ConfigError when it is missing, malformed or not a mapping."""
    if not path.is_file():
        hint = "" if path.suffix in (".yaml", ".yml") else " (run configs are .yaml files)"
        raise ConfigError([f"{path}: no such config file{hint}; see yamls/ for examples"])
    try:
        node = OmegaConf.load(path)
    except yaml.YAMLError as e:
        raise ConfigError([describe_yaml_error(e, path)]) from None
    except OmegaConfBaseException as e:
        raise ConfigError([f"{path}: not valid YAML: {str(e).strip()}"]) from None
    except OSError:  # OmegaConf's word for "the document is a scalar"
        node = None
    if not isinstance(node, DictConfig):
        raise ConfigError([f"{path}: the top level must be a mapping of keys to values"])
    return node


OVERRIDE = re.compile(r"^[A-Za-z_][\w-]*(\.[\w-]+|\[\d+\])*=")


def is_override(word: str) -> bool:
    """Whether a command-line word is a ``key=value`` override (``a.b[0]=x``), not a path."""
    return OVERRIDE.match(word) is not None


def parse_overrides(overrides: list[str]) -> tuple[DictConfig, list[str]]:
    """``key=value`` command-line overrides as a config, and a problem per malformed one."""
    good, problems = [], []
    for o in overrides:
        if "=" not in o or o.startswith("="):
            problems.append(f"override {o!r}: expected key=value, e.g. max_duration=20ba")
        else:
            good.append(o)
    try:
        return OmegaConf.from_dotlist(good), problems
    except OmegaConfBaseException as e:
        return OmegaConf.create(), problems + [f"overrides: {e}"]


def resolve(node: Any, path: str, problems: list[str]) -> Any:
    """Resolve interpolations key by key, so every broken one is reported."""
    if isinstance(node, (DictConfig, ListConfig)):
        keys = list(node.keys()) if isinstance(node, DictConfig) else list(range(len(node)))
        out = {}
        for key in keys:
            try:
                child = node[key]
            except OmegaConfBaseException as e:
                problems.append(f"{join(path, key)}: {_interp_message(e)}")
                continue
            out[key] = resolve(child, join(path, key), problems)
        return out if isinstance(node, DictConfig) else list(out.values())
    return node


def _interp_message(e: Exception) -> str:
    msg = str(e).splitlines()[0]
    return f"cannot resolve interpolation ({msg}); define it under variables:"


def read_merged(path: str | Path, overrides: list[str] | None) -> tuple[DictConfig, list[str]]:
    """The YAML at ``path`` with ``overrides`` merged in (still unresolved), and the problems
    found so far; an override that cannot merge at all is a ConfigError."""
    node = read_yaml(Path(path))
    dot, problems = parse_overrides(list(overrides or []))
    try:
        return OmegaConf.merge(node, dot), problems
    except (OmegaConfBaseException, TypeError, ValueError) as e:  # e.g. a list indexed by a key
        raise ConfigError(problems + [
            f"overrides: cannot apply them to {path} ({e}); a list is replaced whole, "
            "e.g. 'num_fewshot=[0,5]', not by index"], source=str(path)) from None


SWITCH_SECTIONS = ("compile", "activation_checkpointing")  # `compile: false` = {enabled: false}


def expand_switches(data: dict[str, Any]) -> dict[str, Any]:
    """``data`` with each section of ``SWITCH_SECTIONS`` given as a bare true/false written as
    ``{enabled: ...}``."""
    return {k: {"enabled": v} if k in SWITCH_SECTIONS and isinstance(v, bool) else v
            for k, v in data.items()}


Check = Callable[[dict[str, Any]], list[str]]


def read_resolved(path: Path, overrides: list[str] | None) -> tuple[dict[str, Any], list[str]]:
    """The run config's plain data (merged, resolved, old forms upgraded) and its problems."""
    merged, problems = read_merged(path, overrides)
    data = resolve(merged, "", problems)
    data, old_forms = upgrade_deprecated(data)  # e.g. fsdp_config -> parallelism, ...
    return expand_switches(data), problems + old_forms


def precheck(path: str | Path, overrides: list[str] | None = None,
             world_size: int | None = None, checks: Sequence[Check] = (),
             component_sections: Collection[str] | None = None,
             machine: MachineFacts | None = None) -> dict[str, Any]:
    """The checks of :func:`load_config` that need no component's code: the YAML, overrides,
    variables, schema, registry names (not the components' options), derived numbers and the
    hardware settings' combinations, then ``checks`` (e.g. the data folders) and, with a
    ``machine`` (:class:`foundryx.runtime.devices.Machine`), whether it can run the config's
    ``device``, ``precision`` and ``float8`` (:mod:`foundryx.config.hardware`). Raise
    ConfigError with every problem found; return the resolved data. A config that passes
    imports nothing heavy, so it answers in a fraction of a second, and can still fail
    :func:`load_config`.

    A config with mistakes of its own (keys, types, values, names) is also checked against
    each component's options (:func:`component_problems`, which loads the components' code:
    seconds), so every mistake arrives in one message, not one round per stage; mistakes
    only of ``checks`` (a missing folder, a device this machine lacks) answer at once."""
    path = Path(path)
    data, problems = read_resolved(path, overrides)
    problems += dataclass_problems(TrainConfig, data)
    problems += component_name_problems(data, component_sections)
    cannot: list[str] = []  # what the machine cannot run: said without loading components
    if not problems:
        cfg = TrainConfig(**{k: v for k, v in data.items() if k != "variables"})
        problems += derive(cfg, world_size or world_size_from_env())[1]
        problems += combination_problems(cfg)
        if machine is not None:
            cannot = machine_problems(machine, cfg.device, cfg.precision, cfg.float8.enabled)
    if problems:  # the components' options too (the names found unknown are said once)
        problems += [p for p in component_problems(data, component_sections)
                     if p not in problems]
    said = {p.split(":", 1)[0] for p in problems}
    for check in checks:  # a key the options check found wrong already is said once
        problems += [p for p in check(data) if p.split(":", 1)[0] not in said and p not in problems]
    problems += [p for p in cannot if p not in problems]
    if problems:
        raise ConfigError(problems, source=str(path))
    return data


def precheck_sections(path: str | Path, overrides: list[str] | None,
                      names: Sequence[str]) -> dict[str, Any]:
    """:func:`precheck` of only the sections ``names`` of a run config (e.g. the model and
    tokenizer that an export rebuilds; data folders may live on another machine): each must be
    there, resolve and name registry entries that exist. Return them."""
    merged, problems = read_merged(path, overrides)
    sections = {name: resolve(merged.get(name), name, problems) for name in names}
    problems += [f"{name}: missing; rebuilding the model needs it" for name in names
                 if not isinstance(sections[name], dict)]
    problems += component_name_problems(sections, names)
    if problems:
        raise ConfigError(problems, source=str(path))
    return sections


def load_config(
    path: str | Path, overrides: list[str] | None = None, world_size: int | None = None,
    checks: Sequence[Check] = (),
    component_sections: Collection[str] | None = None,
) -> LoadedConfig:
    """Read, merge, resolve and validate a run config; raise ConfigError with every problem.

    ``checks``: more checks of the resolved data (each returns its problems), reported with
    the others; the entry points pass those of higher layers, e.g. the ICL tasks
    (``foundryx.train.RUN_CONFIG_CHECKS``). ``component_sections``: check only these
    registry-backed sections' options (the planner checks the model, not the data paths)."""
    path = Path(path)
    data, problems = read_resolved(path, overrides)
    problems += dataclass_problems(TrainConfig, data)
    problems += component_problems(data, component_sections)
    for check in checks:  # e.g. the ICL tasks and gauntlet, which foundryx.eval checks
        problems += check(data)
    if problems:
        raise ConfigError(problems, source=str(path))
    data.pop("variables", None)
    cfg = TrainConfig(**data)
    derived, more = derive(cfg, world_size or world_size_from_env())
    more += combination_problems(cfg)
    if more:
        raise ConfigError(more, source=str(path))
    return LoadedConfig(cfg=cfg, derived=derived, resolved=data, source=str(path))
