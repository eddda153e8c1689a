"""The machine a plan is for when no flag names one: the recipe's own ``node`` section (GPU
kind and count, nodes, host memory), and, for a recipe whose model folder is not on this
machine (a login node, a laptop), the shape of the same release in ``yamls/shapes/`` (its
config.json: all a plan reads of a model).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foundryx.errors import ConfigError
from foundryx.plan.gpus import GPUS, find_gpu


@dataclass
class Machine:
    """What a plan is made for: each field from a flag, else from the recipe's ``node``."""

    gpu: str | None
    gpus: int | None
    nodes: int
    host_memory: str | None
    note: str | None = None  # one line when the recipe's node was used
    host_source: str = "--host-memory"  # where host_memory came from, for the plan's table


def machine(node: Any, gpu: str | None, gpus: int | None, nodes: int | None,
            host_memory: str | None) -> Machine:
    """The flags (``--gpu``, ``--gpus``, ``--nodes``, ``--host-memory``; None: not given) with
    the recipe's ``node`` section (a mapping, or None) filling what they leave out."""
    node = node if isinstance(node, dict) else {}
    used = {k: node[k] for k, flag in (("gpu", gpu), ("gpus", gpus), ("nodes", nodes),
                                       ("host_memory", host_memory)) if flag is None and node.get(k)}
    if "gpu" in used and str(used["gpu"]).lower() != "cpu":
        try:
            find_gpu(str(used["gpu"]))
        except ConfigError:
            raise ConfigError([f"node.gpu: unknown GPU {used['gpu']!r}; known: {', '.join(GPUS)}"]) from None
    note = None
    if used:
        said = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in used.items())
        note = f"the recipe's node: {said} (node: in the config; the flags override it)"
    return Machine(gpu if gpu is not None else used.get("gpu"),
                   gpus if gpus is not None else used.get("gpus"),
                   nodes if nodes is not None else int(used.get("nodes", 1)),
                   host_memory if host_memory is not None else used.get("host_memory"), note,
                   "node.host_memory" if "host_memory" in used else "--host-memory")


def processes_per_node(gpus: int | None) -> int:
    """The processes a node runs: ``gpus`` (a flag or the recipe's ``node.gpus``), else this
    launch's ``LOCAL_WORLD_SIZE``, else 1."""
    return gpus or int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def shape_override(config: str | Path, model: Any) -> tuple[list[str], str | None]:
    """For a model whose ``pretrained_model_name_or_path`` is not a folder here: the override
    that plans it from the matching shape in ``yamls/shapes/`` (a folder named as the model's
    last path part, lower case, beside the config's folder or above it), and a note saying so;
    ``([], None)`` when the folder exists or no shape matches."""
    source = (model or {}).get("pretrained_model_name_or_path") if isinstance(model, dict) else None
    if not source or Path(str(source)).expanduser().is_dir():
        return [], None
    name = Path(str(source)).name.lower()
    for folder in Path(config).resolve().parents[:3]:
        shape = folder / "shapes" / name
        if (shape / "config.json").is_file():
            shape = Path(os.path.relpath(shape)) if shape.is_relative_to(Path.cwd()) else shape
            return ([f"model.pretrained_model_name_or_path={shape}"],
                    f"model: {source} is not a folder on this machine: planned with the shape of "
                    f"that release, {shape} (its config.json)")
    return [], None
