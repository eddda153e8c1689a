"""``foundryx train --help-config``: every top-level key with its type, default and doc, the
keys of the sections that have their own (``parallelism``, ``activation_checkpointing``,
``compile``), and where the rest is documented; ``--help-config SECTION`` (or
``SECTION.KEY``): one section of the run config; ``--help-config REGISTRY.NAME``: the options
of one registered component."""

from __future__ import annotations

import dataclasses
import inspect
import typing
from typing import Any

from foundryx import registry
from foundryx.config.components import options_parameter
from foundryx.config.schema import COMPONENT_SECTIONS, NAMED_SECTIONS, TrainConfig
from foundryx.config.types import describe, shown_fields
from foundryx.errors import RegistryError


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return repr(f.default)
    if f.default_factory is not dataclasses.MISSING:
        return repr(f.default_factory())
    return "required"


def _nested(tp: Any) -> type | None:
    """The dataclass a field holds (``X`` or ``X | None``), or None."""
    return next((a for a in (typing.get_args(tp) or (tp,))
                 if isinstance(a, type) and dataclasses.is_dataclass(a)), None)


def _sections() -> dict[str, type]:
    """Top-level keys whose value is a section with its own keys: name -> its dataclass."""
    hints = typing.get_type_hints(TrainConfig)
    return {f.name: cls for f in dataclasses.fields(TrainConfig)
            if (cls := _nested(hints[f.name])) is not None}


def config_help() -> str:
    hints = typing.get_type_hints(TrainConfig)
    lines = []
    for f in dataclasses.fields(TrainConfig):
        lines.append(f"{f.name}: {describe(hints[f.name])} [{_default(f)}]\n    "
                     f"{f.metadata.get('doc', '')}")
        nested = _nested(hints[f.name])
        if nested is not None:
            lines += _dataclass_lines(nested, f"{f.name}.")
    components: dict[str, list[str]] = {}
    for section, reg in {**COMPONENT_SECTIONS, **NAMED_SECTIONS}.items():
        components.setdefault(reg, []).append(section)
    lines += [
        "",
        "sections with their own keys (above; `--help-config SECTION` shows one): "
        + ", ".join(_sections()),
        "sections that name registry entries (their keys are the entry's options: "
        "`--help-config REGISTRY.NAME`, e.g. models.hf_causal_lm; `foundryx registry list`): "
        + ", ".join(f"{'/'.join(s)} ({reg})" for reg, s in components.items()),
        "LoRA and a low-precision frozen base are options of the model: "
        "`--help-config peft_config`, `--help-config frozen_base`",
    ]
    return "\n".join(lines)


def _dataclass_lines(cls: type, prefix: str) -> list[str]:
    hints = typing.get_type_hints(cls)
    lines = []
    for f in shown_fields(cls):
        tp = hints[f.name]
        nested = _nested(tp)
        doc = f.metadata.get("doc", "")
        lines.append(f"{prefix}{f.name}: {describe(tp)} [{_default(f)}]\n    {doc}".rstrip())
        if nested is not None:
            lines += _dataclass_lines(nested, f"{prefix}{f.name}.")
    return lines


def _class_doc(cls: type) -> str:
    return " ".join(inspect.cleandoc(cls.__doc__ or "").split()).replace("``", "`")


def section_help(spec: str) -> str | None:
    """``--help-config SECTION`` or ``SECTION.KEY`` for a top-level key of the run config (not
    a registry): its keys with their types, defaults and docs; None when ``spec`` is none."""
    head, _, rest = spec.partition(".")
    fields = {f.name: f for f in dataclasses.fields(TrainConfig)}
    if head not in fields or (rest and head in registry.REGISTRIES):  # algorithms.ema: an entry
        return None
    hints = typing.get_type_hints(TrainConfig)
    f, tp = fields[head], hints[head]
    cls = _nested(tp)
    if cls is not None:
        if not rest:
            return "\n".join([f"# {head}: {describe(tp)} [{_default(f)}]; {_class_doc(cls)}",
                              *_dataclass_lines(cls, f"{head}.")])
        lines = [ln for ln in _dataclass_lines(cls, f"{head}.")
                 if ln.split(":", 1)[0] == spec or ln.startswith(f"{spec}.")
                 or ln.split(":", 1)[0].startswith(f"{spec}.")]
        return "\n".join(lines) if lines else None
    reg = {**COMPONENT_SECTIONS, **NAMED_SECTIONS}.get(head)
    if reg is not None and rest:
        return _options_field_help(rest, registry.get_registry(reg), f"{head}.")
    if rest:
        return None
    line = f"{head}: {describe(tp)} [{_default(f)}]\n    {f.metadata.get('doc', '')}"
    if reg is None:
        return line
    names = registry.get_registry(reg).names()
    what = f"{head} names an entry" if head in COMPONENT_SECTIONS else f"the keys of {head} are entries"
    return (f"{line}\n{what} of the registry {reg!r}: {', '.join(names)}; "
            f"`--help-config {reg}.NAME` shows one's options, e.g. {reg}.{names[0]}"
            if names else line)


def _options_field_help(name: str, reg: registry.Registry, prefix: str = "") -> str | None:
    """A field ``name`` of the options dataclasses of ``reg``'s entries (e.g. ``frozen_base``
    of the models' options), with its keys; None when no entry has it."""
    found_in: dict[tuple[str, ...], list[str]] = {}  # the same lines: one block, every entry
    for entry_name in reg.names():
        found = options_parameter(reg.entry(entry_name).load())
        if found is None:
            continue
        lines = tuple(ln for ln in _dataclass_lines(found[1], prefix)
                      if (key := ln.split(":", 1)[0]) == f"{prefix}{name}"
                      or key.startswith(f"{prefix}{name}."))
        if lines:
            found_in.setdefault(lines, []).append(f"{reg.name}.{entry_name}")
    out = []
    for lines, entries in found_in.items():
        out += [f"# an option of {', '.join(entries)}", *lines]
    return "\n".join(out) if out else None


def component_help(spec: str) -> str:
    """``--help-config REGISTRY.NAME`` (or a bare NAME, looked up in every registry), a top-level
    section (``parallelism``, ``parallelism.tp``, ``model``, ...) or an option of the models
    (``frozen_base``, ``peft_config``): its options, from its dataclass (or its signature)."""
    section = section_help(spec)
    if section is not None:
        return section
    reg_name, _, name = spec.rpartition(".")
    regs = [registry.get_registry(reg_name)] if reg_name else [
        r for r in registry.REGISTRIES.values() if spec in r]
    if not regs:
        model_option = _options_field_help(spec, registry.get_registry("models"), "model.")
        if model_option is not None:
            return model_option
        raise RegistryError(f"--help-config {spec}: no config section, model option or "
                            f"registry entry is called {spec!r}; `foundryx train "
                            "--help-config` lists the sections, `foundryx registry list` the "
                            "entries")
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
