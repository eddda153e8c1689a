"""The one validator: plain data against a dataclass schema, every problem with its path.

A schema is a dataclass whose fields are declared with :func:`option` (a doc string and,
optionally, bounds, a registry the value must name, a check of its own, or values that other
tools accept and foundryx refuses, each with its reason). Nested
dataclasses are nested sections. A dataclass may define ``problems(self) -> list[str]``
for rules between its fields (paths relative to it); it is called only when every field
is valid. :func:`build` turns checked data into the dataclass, nested sections included.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Literal, Union

from foundryx import registry
from foundryx.errors import ConfigError, RegistryError, did_you_mean

TIME_RE = re.compile(r"^\d+(\.\d+)?(ba|ep|tok|sp|dur)$")
TIME_FIELDS = {"max_duration", "eval_interval", "console_log_interval", "save_interval"}


Check = tuple[Callable[[Any], bool], str]  # (test, what a valid value is)


def option(text: str, *, gt: float | None = None, ge: float | None = None,
           lt: float | None = None, le: float | None = None, registry: str | None = None,
           check: Check | None = None, unsupported: Mapping[Any, str] | None = None,
           **kw: Any) -> Any:
    """A dataclass field with a doc string (shown by ``--help-config``) and constraints on
    its value beyond the type: bounds (``gt``/``ge``/``lt``/``le``), the name of a registry
    whose key it must be, or ``check=(test, "what a valid value is")``. ``None`` (where the
    type allows it) passes every constraint. ``unsupported`` maps values that other tools
    accept here (e.g. LLM Foundry's ``auto``) to why foundryx does not and what to write
    instead: such a value is reported with that reason alone, not as a wrong type.
    ``kw`` are ``dataclasses.field`` arguments."""
    meta = {"doc": text, "bounds": {k: v for k, v in
                                    (("gt", gt), ("ge", ge), ("lt", lt), ("le", le)) if v is not None},
            "registry": registry, "check": check, "unsupported": dict(unsupported or {})}
    return dataclasses.field(metadata=meta, **kw)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


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
    if dataclasses.is_dataclass(tp):  # a typed section, e.g. parallelism
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


_BOUND_WORDS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
_BOUND_TESTS = {"gt": lambda v, b: v > b, "ge": lambda v, b: v >= b,
                "lt": lambda v, b: v < b, "le": lambda v, b: v <= b}


def constraint_problems(value: Any, meta: Mapping[str, Any], tp: Any, path: str) -> list[str]:
    """Problems of a well-typed ``value`` against the field's ``option`` constraints."""
    if value is None:
        return []
    bounds = meta.get("bounds") or {}
    if bounds and isinstance(value, (int, float)) and not isinstance(value, bool):
        if not all(_BOUND_TESTS[k](value, b) for k, b in bounds.items()):
            what = " and ".join(f"{_BOUND_WORDS[k]} {b}" for k, b in bounds.items())
            numeric = {a for a in _options_of(tp) if a in (int, float)}
            base = "an integer" if numeric == {int} else "a number"
            return [f"{path}: expected {base} {what}, got {value!r}"]
    reg_name = meta.get("registry")
    if reg_name and isinstance(value, str):
        reg = registry.get_registry(reg_name)
        try:
            reg.get(value)
        except RegistryError:
            return [f"{path}: unknown name {value!r} in registry {reg_name!r}"
                    f"{did_you_mean(value, reg.names())}; use one of {', '.join(reg.names())}"]
    check = meta.get("check")
    if check and not check[0](value):
        return [f"{path}: expected {check[1]}, got {value!r}"]
    return []


def unsupported_problem(value: Any, meta: Mapping[str, Any], path: str) -> str | None:
    """The one problem of a value the field's ``option(unsupported=...)`` names, else None."""
    reasons = meta.get("unsupported") or {}
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        return None  # only plain scalars (and True is not 1 here)
    reason = reasons.get(value)
    return None if reason is None else f"{path}: {value!r} is not supported: {reason}"


def shown_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of the dataclass ``cls`` in the order a person reads them: its own, then
    those it inherits (e.g. a model section's shared LoRA fields after its own options)."""
    own = vars(cls).get("__annotations__", {})
    every = dataclasses.fields(cls)
    return [f for f in every if f.name in own] + [f for f in every if f.name not in own]


def dataclass_problems(cls: type, data: Mapping[str, Any], path: str = "",
                       owner: str | None = None) -> list[str]:
    """Every problem of ``data`` against the dataclass ``cls``: unknown, missing, mistyped
    and out-of-range keys, then the rules of ``cls.problems()`` when the fields are valid.
    ``owner`` names the component in unknown-key messages (e.g. ``the 'text' dataloader``)."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in shown_fields(cls)}
    problems: list[str] = []
    for key, value in data.items():
        where = join(path, key)
        if key not in fields:
            if owner:
                hint = did_you_mean(key, fields) or f"; it accepts: {', '.join(fields)}"
                problems.append(f"{where}: unknown option of {owner}{hint}")
            else:
                hint = did_you_mean(key, fields) or "; see `foundryx train --help-config`"
                problems.append(f"{where}: unknown key{hint}")
            continue
        tp = hints[key]
        refused = unsupported_problem(value, fields[key].metadata, where)
        if refused:
            problems.append(refused)
            continue
        found = _section_problems(value, tp, where, owner)
        if found is None:
            found = type_problems(value, tp, where)
            if not found:
                found = constraint_problems(value, fields[key].metadata, tp, where)
        problems += found
        if key in TIME_FIELDS and isinstance(value, str) and not TIME_RE.match(value):
            problems.append(
                f"{where}: expected a duration such as 100ba, 1ep, 50000tok or 0.5dur, got {value!r}"
            )
    for name, f in fields.items():
        required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        if required and name not in data:
            problems.append(f"{join(path, name)}: missing; {f.metadata.get('doc', 'required')}")
    return problems + _rule_problems(cls, data, path)


RULE_ERRORS = (TypeError, ValueError, AttributeError, ArithmeticError)


def _rule_problems(cls: type, data: Mapping[str, Any], path: str) -> list[str]:
    """``cls.problems()`` on the data as far as it goes (unknown keys left out, bad values
    kept), so rules between fields are reported with the other problems; a rule that cannot
    be evaluated on bad values is skipped (those values are already reported)."""
    if not callable(getattr(cls, "problems", None)):
        return []
    try:
        return [join(path, p) if path else p for p in lenient_build(cls, data).problems()]
    except RULE_ERRORS:
        return []


def lenient_build(cls: type, data: Mapping[str, Any]) -> Any:
    """The dataclass ``cls`` from data that may have problems: unknown keys are left out and
    bad values kept, for rules that look past them (TypeError when a required key is missing)."""
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key in known:
            try:
                kwargs[key] = _build_value(value, hints[key], lenient_build)
            except RULE_ERRORS:
                kwargs[key] = value
    return cls(**kwargs)


def _section_problems(value: Any, tp: Any, path: str, owner: str | None) -> list[str] | None:
    """Problems of a nested section (a dataclass, or a mapping of names to dataclasses; alone
    or in a union) with the same ``owner``; None when ``value`` is not such a section."""
    if not isinstance(value, Mapping):
        return None
    for arg in _options_of(tp):
        if dataclasses.is_dataclass(arg):
            return dataclass_problems(arg, value, path, owner)
        item = _mapped_section(arg)
        if item is not None:
            return [p for k, v in value.items() for p in
                    (_section_problems(v, item, join(path, k), owner)
                     or ([] if isinstance(v, Mapping) else
                         [f"{join(path, k)}: expected a mapping (key: value lines), got {v!r}"]))]
    return None


def _mapped_section(tp: Any) -> type | None:
    """``D`` for ``dict[str, D]`` where D is a dataclass, else None."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) is dict and len(args) == 2 and dataclasses.is_dataclass(args[1]):
        return args[1]
    return None


def _options_of(tp: Any) -> tuple[Any, ...]:
    if typing.get_origin(tp) in (Union, types.UnionType):
        return typing.get_args(tp)
    return (tp,)


def build(cls: type, data: Mapping[str, Any]) -> Any:
    """The dataclass ``cls`` from checked plain data, nested sections built too."""
    hints = typing.get_type_hints(cls)
    return cls(**{key: _build_value(value, hints[key]) for key, value in data.items()})


def _build_value(value: Any, tp: Any, make: Callable[[type, Mapping[str, Any]], Any] = build) -> Any:
    if isinstance(value, Mapping):
        for arg in _options_of(tp):
            if dataclasses.is_dataclass(arg):
                return make(arg, value)
            item = _mapped_section(arg)
            if item is not None:
                return {k: make(item, v) for k, v in value.items()}
    return value


def coerce(cls: type, value: Any, owner: str | None = None) -> Any:
    """``value`` as the dataclass ``cls``: an instance is returned as it is; a mapping is
    checked (a ConfigError lists every problem) and built. For Python callers of a component."""
    if isinstance(value, cls):
        return value
    if not isinstance(value, Mapping):
        raise ConfigError([f"expected {cls.__name__} or a mapping of its options, got {value!r}"],
                          source=owner)
    problems = dataclass_problems(cls, value, "", owner)
    if problems:
        raise ConfigError(problems, source=owner)
    return build(cls, value)


def to_data(obj: Any) -> Any:
    """A dataclass (nested ones too) as plain data, e.g. to store in a Hugging Face config."""
    return dataclasses.asdict(obj) if dataclasses.is_dataclass(obj) else obj


def options_or_fields(cls: type, options: Any, fields: Mapping[str, Any], owner: str) -> Any:
    """A component's options from Python: an instance (or mapping) of ``cls``, or its fields
    as keyword arguments; not both."""
    if options is not None and fields:
        raise ConfigError([f"give {owner} its options or keyword fields, not both "
                           f"(got options and {', '.join(fields)})"], source=owner)
    return coerce(cls, fields if options is None else options, owner)
