"""The paths a run config names, checked before anything is built (``foundryx train`` calls
:func:`path_problems` with the fast checks, before it imports torch): ``load_path``, the
folders of the text loaders' MDS data, a tokenizer folder and a model folder. A path given as
a folder (absolute, starting with ``.`` or ``~``, or with two slashes) must be one; a bare name
that is no folder is a Hugging Face hub id, and must be reachable on the hub (a probe of a few
seconds) or in its cache: else one line says so, with the nearest existing folder
(``models/tiny-qwen`` typed for ``./models/tiny-qwen3``), instead of a minute of the hub
client's retries. A dry run leaves data folders to its second stage (a cluster's data may not
be on the login node) and reports them after its plan.

An entry shell's helper: it may import anything (here, the data layer's folder checks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from foundryx.data import remote as remotes
from foundryx.data.options import mds_folder_problems
from foundryx.runtime.hub import hub_problem, looks_like_path, nearest_folder


def _looks_like_folder(value: Any) -> bool:
    return isinstance(value, str) and value.startswith(("/", ".", "~"))


def path_problems(data: dict[str, Any]) -> list[str]:
    """One line per path of the resolved config ``data`` that is not on this machine."""
    problems = []
    load = data.get("load_path")
    if isinstance(load, str) and load and not remotes.is_remote(load) and not Path(load).expanduser().exists():
        problems.append(f"load_path: {load} does not exist; give a checkpoint folder (a run's "
                        "checkpoints/ folder or one of its ep*-ba* folders), or leave load_path "
                        "out to start from scratch")
    for section in ("train_loader", "eval_loader"):
        loader = data.get(section)
        dataset = loader.get("dataset") if isinstance(loader, dict) else None
        if loader is None or loader.get("name") != "text" or not isinstance(dataset, dict) \
                or "local" not in dataset or "streams" in dataset:
            continue
        problems += mds_folder_problems(dataset["local"], dataset.get("split"), f"{section}.dataset.",
                                        dataset.get("max_seq_len"), f"{section}.dataset.max_seq_len",
                                        dataset.get("remote"))
    hub_names: dict[str, list[str]] = {}  # a hub name -> the YAML paths that give it
    for section, key in (("tokenizer", "path"), ("model", "pretrained_model_name_or_path")):
        part = data.get(section)
        value = part.get(key) if isinstance(part, dict) else None
        if section == "model" and isinstance(part, dict) and part.get("pretrained") is False:
            continue
        if (_looks_like_folder(value) or isinstance(value, str) and looks_like_path(value)) \
                and not Path(value).expanduser().is_dir():
            near = nearest_folder(value)
            problems.append(f"{section}.{key}: folder {value} does not exist"
                            + (f" (did you mean {near}?)" if near else "") + "; give the folder "
                            "of a Hugging Face model (config.json, tokenizer and safetensors) or "
                            "a hub name")
        elif isinstance(value, str) and value and not Path(value).expanduser().is_dir() \
                and (section != "tokenizer" or part.get("name") == "hf"):
            hub_names.setdefault(value, []).append(f"{section}.{key}")
    for name, keys in hub_names.items():  # one line for the model and tokenizer of one name
        problem = hub_problem(name, " and ".join(keys),
                              "tokenizer_config.json" if keys == ["tokenizer.path"] else "config.json")
        problems += [problem] if problem else []
    return problems
