"""``foundryx train --help-config``: every top-level key with its type, default and doc."""

from __future__ import annotations

import dataclasses
import typing

from foundryx.config.schema import TrainConfig
from foundryx.config.types import describe


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
