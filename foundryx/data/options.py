"""Checks shared by the dataloaders' ``config_problems`` (paths relative to the section)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from foundryx.data.convert import INDEX, read_manifest
from foundryx.errors import DataError, did_you_mean

CONVERT_FIX = (
    "run `foundryx data convert --input ... --out <folder> ...`, or `make data` for the quickstart"
)


def key_problems(section: dict, allowed: set[str], prefix: str, loader: str) -> list[str]:
    """Unknown keys of ``section``, each with a did-you-mean or the accepted keys."""
    return [
        f"{prefix}{key}: unknown option of the {loader} loader"
        f"{did_you_mean(key, allowed) or '; accepts: ' + ', '.join(sorted(allowed))}"
        for key in section
        if key not in allowed
    ]


LOADER_DEFAULTS: dict[str, Any] = {"drop_last": True, "num_workers": 0}


def section_problems(cfg: dict, dataset_keys: set[str], loader: str) -> list[str]:
    """Unknown keys of a loader section and of its ``dataset``, and bad loader options."""
    c = {**LOADER_DEFAULTS, **cfg}
    return [
        *key_problems(cfg, {"name", "dataset", *LOADER_DEFAULTS}, "", loader),
        *key_problems(cfg["dataset"], dataset_keys, "dataset.", loader),
        *check([
            ("drop_last", c["drop_last"], isinstance(c["drop_last"], bool), "true or false"),
            ("num_workers", c["num_workers"], is_int(c["num_workers"]) and c["num_workers"] >= 0,
             "an integer >= 0"),
        ]),
    ]


def raise_problems(loader: str, problems: list[str]) -> None:
    """Raise one DataError listing ``problems`` of the ``loader`` section, if any."""
    if problems:
        raise DataError(f"{loader} dataloader:\n" + "\n".join(f"  - {p}" for p in problems))


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def check(rows: list[tuple[str, Any, bool, str]]) -> list[str]:
    """``path: expected <want>, got <value>`` for each ``(path, value, ok, want)`` not ok."""
    return [f"{path}: expected {want}, got {value!r}" for path, value, ok, want in rows if not ok]


def mds_folder_problems(local: Any, split: Any, prefix: str, max_seq_len: Any = None,
                        seq_path: str = "dataset.max_seq_len") -> list[str]:
    """Problems of the MDS folder ``local/split``; ``prefix`` is the YAML path of their section
    (e.g. ``dataset.`` or ``dataset.streams.web.``)."""
    if not isinstance(local, str) or not local:
        return [f"{prefix}local: expected the folder of MDS shards, got {local!r}; {CONVERT_FIX}"]
    root = Path(local).expanduser()
    folder = root / split if isinstance(split, str) and split else root
    key = f"{prefix}split" if folder != root else f"{prefix}local"
    if not root.is_dir():
        return [f"{prefix}local: folder {root} does not exist; {CONVERT_FIX}"]
    if not folder.is_dir():
        splits = sorted(p.name for p in root.iterdir() if p.is_dir())
        return [f"{prefix}split: folder {folder} does not exist (subfolders of {root}: "
                f"{', '.join(splits) or 'none'}); {CONVERT_FIX}"]
    if not (folder / INDEX).is_file():
        return [f"{key}: {folder} has no {INDEX}, so it is not an MDS dataset; {CONVERT_FIX}"]
    manifest = read_manifest(folder)
    if manifest and is_int(max_seq_len) and max_seq_len > manifest.get("max_seq_len", max_seq_len):
        return [f"{seq_path}: {max_seq_len} is longer than the sequences stored in "
                f"{folder} ({manifest['max_seq_len']} tokens); lower it, or re-convert with "
                f"--max-seq-len {max_seq_len}"]
    return []


def shard_problems(folder: Path) -> list[str]:
    """Missing or cut-short shards of the MDS dataset in ``folder`` (sizes from index.json)."""
    import json

    try:
        shards = json.loads((folder / INDEX).read_text())["shards"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{folder / INDEX}: unreadable ({type(e).__name__}: {e}); re-convert the data"]
    problems = []
    for shard in shards:
        info = shard.get("zip_data") or shard["raw_data"]
        path = folder / info["basename"]
        size = path.stat().st_size if path.is_file() else None
        if size != info["bytes"]:
            state = "is missing" if size is None else f"has {size} of {info['bytes']} bytes"
            problems.append(f"shard {path} {state} (corrupt or cut short); re-convert the data "
                            f"(`foundryx data convert ... --overwrite`)")
    return problems
