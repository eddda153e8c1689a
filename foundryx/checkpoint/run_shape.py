"""What a resume must keep of the run that saved a checkpoint: the global batch, the sequence
length, the frozen base's storage and the training data's shards. Recorded in each checkpoint's
``components.json`` (``run``) and compared before a resume loads anything: a difference is one
message naming each and the fix, and nothing in the save_folder is touched."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from foundryx.errors import CheckpointError


def data_fingerprint(dataset: Mapping[str, Any] | None) -> dict[str, Any] | None:
    """``{folder, shards, samples, digest}`` of a local MDS training set (its ``index.json``:
    the shards' names and sample counts); None for remote data or data without an index."""
    if not isinstance(dataset, Mapping) or not dataset.get("local") or dataset.get("remote"):
        return None
    folder = Path(str(dataset["local"]))
    split = dataset.get("split")
    index = next((p for p in ((folder / split / "index.json") if split else None,
                              folder / "index.json") if p is not None and p.is_file()), None)
    if index is None:
        return None
    try:
        shards = json.loads(index.read_text()).get("shards", [])
        names = [(s["raw_data"]["basename"], int(s["samples"])) for s in shards]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    digest = hashlib.sha256(json.dumps(names).encode()).hexdigest()[:16]
    return {"folder": str(index.parent), "shards": len(names),
            "samples": sum(n for _, n in names), "digest": digest}


def run_shape(global_batch: int | None, max_seq_len: int | None, frozen_dtype: str | None,
              dataset: Mapping[str, Any] | None) -> dict[str, Any]:
    return {"global_train_batch_size": global_batch, "max_seq_len": max_seq_len,
            "frozen_base.dtype": frozen_dtype, "train_data": data_fingerprint(dataset)}


def _data(d: Mapping[str, Any]) -> str:
    return f"{d['shards']} shards, {d['samples']} samples in {d['folder']}"


def resume_problems(saved: Mapping[str, Any] | None, now: Mapping[str, Any] | None) -> list[str]:
    """What differs between the run that saved a checkpoint and this one (empty: nothing, or
    a checkpoint that records no run)."""
    if not saved or not now:
        return []
    out = []
    for key in ("global_train_batch_size", "max_seq_len", "frozen_base.dtype"):
        if key in saved and saved[key] != now.get(key):
            out.append(f"{key}: saved with {saved[key]!r}, this run has {now.get(key)!r}")
    was, is_ = saved.get("train_data"), now.get("train_data")
    if was and is_ and was["digest"] != is_["digest"]:
        out.append(f"the training data changed since the save: then {_data(was)}, now "
                   f"{_data(is_)} (shards added, removed or rewritten)")
    return out


def check_resume(folder: Path, saved: Mapping[str, Any] | None,
                 now: Mapping[str, Any] | None) -> None:
    """CheckpointError when this run cannot continue the one that saved ``folder``."""
    problems = resume_problems(saved, now)
    if problems:
        raise CheckpointError("\n".join(
            [f"{folder}: cannot resume it: this run differs from the one that saved it:"]
            + [f"  - {p}" for p in problems]
            + ["  resume with the saved values (and the data as it was), or start a new run "
               f"from its weights: load_path={folder} load_weights_only=true with another "
               "save_folder"]))
