"""Config sections that name registry entries: check them against what each entry declares,
and build them.

A registered component declares its options as a dataclass: one parameter of the registered
callable (a function, or a class's ``__init__``) is annotated with the dataclass (alone or in
a union, e.g. ``options: TextLoaderOptions | Mapping[str, Any]``). The section's keys, minus
``name``, are that dataclass's fields, checked by the one validator
(:func:`foundryx.config.types.dataclass_problems`) and passed to the component as an instance.
The other parameters are supplied by the builder (``SUPPLIED_ARGS``). A component without
such a parameter gets its keyword arguments checked against its signature.

An options dataclass may also define ``problems_with(self, model: ModelFacts) -> list[str]``
to check itself against the run's model (paths relative to its own section), so no check
here names a component.
"""

from __future__ import annotations

import dataclasses
import inspect
import typing
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from foundryx import registry
from foundryx.config.schema import COMPONENT_SECTIONS, NAMED_SECTIONS, SUPPLIED_ARGS
from foundryx.config.types import (
    RULE_ERRORS,
    build,
    dataclass_problems,
    is_int,
    join,
    lenient_build,
)
from foundryx.errors import RegistryError, did_you_mean


@dataclass(frozen=True)
class ModelFacts:
    """What other sections may check against the model: read from the model's options
    (attributes ``max_seq_len`` and ``uses_sequence_id``, when it has them)."""

    max_seq_len: int | None = None
    uses_sequence_id: bool = False


def options_parameter(obj: Any) -> tuple[str, type] | None:
    """``(parameter name, options dataclass)`` of a registered callable, or None."""
    target = obj.__init__ if inspect.isclass(obj) else obj
    try:
        params = inspect.signature(target).parameters
    except (TypeError, ValueError):
        return None
    scope = getattr(inspect.unwrap(target), "__globals__", {})
    for name, param in params.items():
        tp = param.annotation
        if isinstance(tp, str):  # ``from __future__ import annotations``
            try:
                tp = eval(tp, scope)  # noqa: S307  (the component's own annotation)
            except Exception:  # noqa: BLE001  (a name only imported for type checking)
                continue
        args = typing.get_args(tp) if typing.get_origin(tp) else (tp,)
        found = [a for a in args if isinstance(a, type) and dataclasses.is_dataclass(a)]
        if found:
            return name, found[0]
    return None


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


def _entry(reg_name: str, name: Any, name_path: str) -> tuple[Any, list[str]]:
    if not isinstance(name, str):
        return None, [f"{name_path}: expected the name of an entry in registry {reg_name!r}, got {name!r}"]
    try:
        return registry.get_registry(reg_name).get(name), []
    except RegistryError as e:
        return None, [f"{name_path}: {e}"]


def entry_problems(reg_name: str, name: Any, kwargs: dict[str, Any], path: str, name_path: str) -> list[str]:
    """Problems of the options ``kwargs`` of registry entry ``name`` (YAML path ``path``)."""
    obj, problems = _entry(reg_name, name, name_path)
    if obj is None:
        return problems
    found = options_parameter(obj)
    if found is not None:
        return dataclass_problems(found[1], kwargs, path, owner=f"the {name!r} {reg_name[:-1]}")
    return signature_problems(obj, kwargs, SUPPLIED_ARGS.get(reg_name, set()), path, name)


def component_options(reg_name: str, section: Any) -> Any:
    """The options instance of a component section as far as it goes (see
    :func:`~foundryx.config.types.lenient_build`), or None (no dataclass, or no instance)."""
    if not isinstance(section, dict) or not isinstance(section.get("name"), str):
        return None
    obj, _ = _entry(reg_name, section["name"], "name")
    found = options_parameter(obj) if obj is not None else None
    if found is None:
        return None
    try:
        return lenient_build(found[1], {k: v for k, v in section.items() if k != "name"})
    except RULE_ERRORS:
        return None


def model_facts(model_section: Any) -> ModelFacts:
    """What the model section says other sections must fit (see :class:`ModelFacts`)."""
    opts = component_options("models", model_section)
    source = opts if opts is not None else (model_section if isinstance(model_section, dict) else {})
    get = (lambda k: getattr(source, k, None)) if opts is not None else source.get
    seq = get("max_seq_len")
    return ModelFacts(max_seq_len=seq if is_int(seq) else None,
                      uses_sequence_id=get("uses_sequence_id") is True)


def component_name_problems(data: dict[str, Any], sections: Collection[str] | None = None) -> list[str]:
    """The registry names of every registry-backed section (or only of ``sections``) that no
    entry has, found without loading any entry's code (:func:`component_problems` checks the
    options too, and loads each entry)."""
    named: list[tuple[str, str, Any]] = []  # (registry, YAML path of the name, the name)
    for section, reg_name in COMPONENT_SECTIONS.items():
        value = data.get(section) if sections is None or section in sections else None
        if isinstance(value, dict):  # missing or mistyped sections: the schema check's
            named.append((reg_name, f"{section}.name", value.get("name", _MISSING)))
    for section, reg_name in NAMED_SECTIONS.items():
        value = data.get(section) if sections is None or section in sections else None
        if isinstance(value, dict):
            named += [(reg_name, join(section, name), name) for name in value]
    problems = []
    for reg_name, path, name in named:
        reg = registry.get_registry(reg_name)
        if name is _MISSING:
            problems.append(f"{path}: missing; choose one of: {', '.join(reg.names())}")
        elif not isinstance(name, str):
            problems.append(f"{path}: expected the name of an entry in registry {reg_name!r}, "
                            f"got {name!r}")
        else:
            try:
                reg.entry(name)
            except RegistryError as e:
                problems.append(f"{path}: {e}")
    return problems


_MISSING = object()


def component_problems(data: dict[str, Any], sections: Collection[str] | None = None) -> list[str]:
    """Problems of every registry-backed section of a resolved config (or only of
    ``sections``), each alone and then against the model (``problems_with``)."""
    problems: list[str] = []
    if sections is not None:
        data = {k: v for k, v in data.items() if k in sections}
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
    facts = model_facts(data.get("model"))
    for section, reg_name in COMPONENT_SECTIONS.items():
        opts = component_options(reg_name, data.get(section)) if section != "model" else None
        if callable(getattr(opts, "problems_with", None)):
            try:
                problems += [join(section, p) for p in opts.problems_with(facts)]
            except RULE_ERRORS:  # values already reported as bad
                pass
    return problems


def split_name(section: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``{name: x, a: 1}`` → ``("x", {"a": 1})``."""
    return section["name"], {k: v for k, v in section.items() if k != "name"}


def build_component(reg_name: str, section: dict[str, Any], **supplied: Any) -> Any:
    """Call the registered object named by ``section['name']`` with the section's options
    (as its options dataclass, when it declares one) and the arguments the caller supplies
    (e.g. ``tokenizer``)."""
    name, kwargs = split_name(section)
    obj = registry.get_registry(reg_name).get(name)
    found = options_parameter(obj)
    if found is not None:
        return obj(**supplied, **{found[0]: build(found[1], kwargs)})
    return obj(**supplied, **kwargs)
