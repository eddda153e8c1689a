"""Check config sections that name registry entries, against what each entry accepts.

A registered object may define ``config_problems(section: dict) -> list[str]`` (paths
relative to the section) to check its own options; otherwise its call signature is used:
unknown keyword arguments and missing required ones are problems.
"""

from __future__ import annotations

import inspect
from typing import Any

from foundryx import registry
from foundryx.config.schema import COMPONENT_SECTIONS, NAMED_SECTIONS, SUPPLIED_ARGS
from foundryx.config.types import join
from foundryx.errors import RegistryError, did_you_mean


def signature_problems(obj: Any, kwargs: dict[str, Any], supplied: set[str], path: str, name: str) -> list[str]:
    """Unknown and missing keyword arguments of ``obj(**kwargs)``."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return []
    params = sig.parameters
    takes_any = any(p.kind is p.VAR_KEYWORD for p in params.values())
    named = [
        n for n, p in params.items()
        if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and n not in supplied
    ]
    problems = []
    if not takes_any:
        for key in kwargs:
            if key not in named:
                hint = did_you_mean(key, named) or f"; {name} accepts: {', '.join(named) or 'nothing'}"
                problems.append(f"{join(path, key)}: unknown option for {name!r}{hint}")
    for n, p in params.items():
        required = p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)
        if required and n not in supplied and n not in kwargs:
            problems.append(f"{join(path, n)}: missing; {name!r} requires it")
    return problems


def entry_problems(reg_name: str, name: Any, kwargs: dict[str, Any], path: str, name_path: str) -> list[str]:
    reg = registry.get_registry(reg_name)
    if not isinstance(name, str):
        return [f"{name_path}: expected the name of an entry in registry {reg_name!r}, got {name!r}"]
    try:
        obj = reg.get(name)
    except RegistryError as e:
        return [f"{name_path}: {e}"]
    check = getattr(obj, "config_problems", None)
    if callable(check):
        return [f"{path}.{p}" for p in check(kwargs)]
    return signature_problems(obj, kwargs, SUPPLIED_ARGS.get(reg_name, set()), path, name)


def component_problems(data: dict[str, Any]) -> list[str]:
    """Problems of every registry-backed section of a resolved config."""
    problems: list[str] = []
    for section, reg_name in COMPONENT_SECTIONS.items():
        value = data.get(section)
        if not isinstance(value, dict):
            continue  # missing or mistyped sections are reported by the schema check
        if "name" not in value:
            names = ", ".join(registry.get_registry(reg_name).names())
            problems.append(f"{section}.name: missing; choose one of: {names}")
            continue
        kwargs = {k: v for k, v in value.items() if k != "name"}
        problems += entry_problems(reg_name, value["name"], kwargs, section, f"{section}.name")
    for section, reg_name in NAMED_SECTIONS.items():
        value = data.get(section)
        if not isinstance(value, dict):
            continue
        for name, kwargs in value.items():
            kwargs = kwargs or {}
            if isinstance(kwargs, dict):
                problems += entry_problems(reg_name, name, kwargs, join(section, name), join(section, name))
    return problems
