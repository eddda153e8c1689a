"""Check plain data against a dataclass schema, collecting every problem with its path."""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from typing import Any, Literal, Union

from foundryx.errors import did_you_mean

TIME_RE = re.compile(r"^\d+(\.\d+)?(ba|ep|tok|sp|dur)$")
TIME_FIELDS = {"max_duration", "eval_interval", "console_log_interval", "save_interval"}


def join(path: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


def describe(tp: Any) -> str:
    """A person's name for a type annotation."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return "anything"
    if tp is type(None):
        return "null"
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(describe(a) for a in typing.get_args(tp))
    if origin is dict:
        return "a mapping"
    if origin is list:
        return "a list"
    if isinstance(tp, type):
        return {"int": "an integer", "float": "a number", "str": "a string", "bool": "true/false"}.get(
            tp.__name__, tp.__name__
        )
    return str(tp)


def type_problems(value: Any, tp: Any, path: str) -> list[str]:
    """Problems of ``value`` against the annotation ``tp`` (empty when it fits)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return []
    if origin in (Union, types.UnionType):
        options = typing.get_args(tp)
        if any(not type_problems(value, a, path) for a in options):
            return []
        section = next((a for a in options if dataclasses.is_dataclass(a)), None)
        if section is not None and isinstance(value, dict):
            return dataclass_problems(section, value, path)
        return [f"{path}: expected {describe(tp)}, got {value!r}"]
    if origin is Literal:
        choices = typing.get_args(tp)
        if value in choices:
            return []
        return [f"{path}: expected {describe(tp)}, got {value!r}{did_you_mean(value, map(str, choices))}"]
    if tp is type(None):
        return [] if value is None else [f"{path}: expected null, got {value!r}"]
    if dataclasses.is_dataclass(tp):  # a typed section, e.g. fsdp_config
        if not isinstance(value, dict):
            return [f"{path}: expected a mapping (key: value lines), got {value!r}"]
        return dataclass_problems(tp, value, path)
    if origin is dict:
        if not isinstance(value, dict):
            return [f"{path}: expected a mapping (key: value lines), got {value!r}"]
        _, vt = typing.get_args(tp) or (Any, Any)
        return [p for k, v in value.items() for p in type_problems(v, vt, join(path, k))]
    if origin is list:
        if not isinstance(value, list):
            return [f"{path}: expected a list, got {value!r}"]
        (et,) = typing.get_args(tp) or (Any,)
        return [p for i, v in enumerate(value) for p in type_problems(v, et, join(path, i))]
    ok = {
        bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
        str: lambda v: isinstance(v, str),
    }.get(tp, lambda v: isinstance(v, tp))
    if ok(value):
        return []
    return [f"{path}: expected {describe(tp)}, got {value!r}"]


def dataclass_problems(cls: type, data: dict[str, Any], path: str = "") -> list[str]:
    """Every problem of ``data`` against the dataclass ``cls``: unknown, missing, mistyped keys."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    problems: list[str] = []
    for key, value in data.items():
        where = join(path, key)
        if key not in fields:
            hint = did_you_mean(key, fields) or "; see `foundryx train --help-config`"
            problems.append(f"{where}: unknown key{hint}")
            continue
        problems += type_problems(value, hints[key], where)
        if key in TIME_FIELDS and isinstance(value, str) and not TIME_RE.match(value):
            problems.append(
                f"{where}: expected a duration such as 100ba, 1ep, 50000tok or 0.5dur, got {value!r}"
            )
    for name, f in fields.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and name not in data:
            problems.append(f"{join(path, name)}: missing; {f.metadata.get('doc', 'required')}")
    return problems
