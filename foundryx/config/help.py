"""``foundryx train --help-config``: every top-level key with its type, default and doc;
``--help-config REGISTRY.NAME``: the options of one registered component."""

from __future__ import annotations

import dataclasses
import inspect
import typing

from foundryx import registry
from foundryx.config.components import options_parameter
from foundryx.config.schema import TrainConfig
from foundryx.config.types import describe
from foundryx.errors import RegistryError


def config_help() -> str:
    hints = typing.get_type_hints(TrainConfig)
    lines = []
    for f in dataclasses.fields(TrainConfig):
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = repr(f.default_factory())
        else:
            default = "required"
        lines.append(f"{f.name}: {describe(hints[f.name])} [{default}]\n    {f.metadata.get('doc', '')}")
    return "\n".join(lines)


def _dataclass_lines(cls: type, prefix: str) -> list[str]:
    hints = typing.get_type_hints(cls)
    lines = []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        nested = next((a for a in (typing.get_args(tp) or (tp,))
                       if isinstance(a, type) and dataclasses.is_dataclass(a)), None)
        if f.default is not dataclasses.MISSING:
            default = repr(f.default)
        elif f.default_factory is not dataclasses.MISSING:
            default = repr(f.default_factory())
        else:
            default = "required"
        doc = f.metadata.get("doc", "")
        lines.append(f"{prefix}{f.name}: {describe(tp)} [{default}]\n    {doc}".rstrip())
        if nested is not None:
            lines += _dataclass_lines(nested, f"{prefix}{f.name}.")
    return lines


def component_help(spec: str) -> str:
    """``--help-config REGISTRY.NAME`` (or a bare NAME, looked up in every registry): the
    options of one registered component, from its options dataclass (or its signature)."""
    reg_name, _, name = spec.rpartition(".")
    regs = [registry.get_registry(reg_name)] if reg_name else [
        r for r in registry.REGISTRIES.values() if spec in r]
    if not regs:
        raise RegistryError(f"--help-config {spec}: no registry has an entry {spec!r}; see "
                            "`foundryx registry list`")
    out = []
    for reg in regs:
        entry = reg.entry(name)
        obj = entry.load()
        found = options_parameter(obj)
        head = f"# {reg.name}.{name}: {entry.source}"
        if found is not None:
            out += [f"{head}, options {found[1].__name__}", *_dataclass_lines(found[1], "")]
        else:
            target = obj.__init__ if inspect.isclass(obj) else obj
            params = [p for p in inspect.signature(target).parameters.values()
                      if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
            out += [f"{head}, keyword arguments (no options dataclass: no docs)"]
            out += [f"{p.name} [{'required' if p.default is p.empty else repr(p.default)}]"
                    for p in params]
    return "\n".join(out)
