"""What the dataloaders' options share: the loader keys, and checks of MDS folders."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foundryx.config.components import ModelFacts
from foundryx.config.types import is_int, option
from foundryx.data import remote as remotes
from foundryx.data.chunk_writer import INDEX, SHARD_HASH
from foundryx.data.convert import read_manifest

CONVERT_FIX = (
    "run `foundryx data convert --input ... --out <folder> ...`, or `make data` for the quickstart"
)


@dataclass(kw_only=True)
class LoaderOptions:
    """What every foundryx loader section holds besides its ``dataset``."""

    drop_last: bool = option("drop the last incomplete batch", default=True)
    num_workers: int = option("dataloader worker processes", default=0, ge=0)

    def problems_with(self, model: ModelFacts) -> list[str]:
        """A ``dataset.max_seq_len`` the model cannot take."""
        seq = self.dataset.max_seq_len
        if model.max_seq_len is not None and seq > model.max_seq_len:
            return [f"dataset.max_seq_len: {seq} is longer than model.max_seq_len "
                    f"{model.max_seq_len}; lower it to {model.max_seq_len} or less, or raise "
                    "model.max_seq_len"]
        return []


def mds_folder_problems(local: Any, split: Any, prefix: str, max_seq_len: Any = None,
                        seq_path: str = "max_seq_len", remote: Any = None) -> list[str]:
    """Problems of the MDS folder ``local/split``; ``prefix`` is the path of their section
    relative to the loader's ``dataset`` (e.g. ``""`` or ``streams.web.``). With a ``remote``
    (object storage), ``local`` is its cache and is checked, with the remote, when the loader
    is built (:func:`foundryx.data.remote.fetch_index`)."""
    if remote is not None:
        problem = remotes.scheme_problem(remote, f"{prefix}remote")
        if problem is None and remotes.is_remote(local):
            problem = (f"{prefix}local: {local!r} is object storage; local: is the folder the "
                       f"shards of remote: are cached in (or leave it out for a default)")
        return [problem] if problem else []
    if remotes.is_remote(local):
        return [f"{prefix}local: {local!r} is object storage; write it as remote: {local} "
                f"(local: is then the cache folder, or leave it out for a default)"]
    if not isinstance(local, str) or not local:
        return [f"{prefix}local: expected the folder of MDS shards (or remote: s3://bucket/path "
                f"for a dataset in object storage), got {local!r}; {CONVERT_FIX}"]
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


REBUILD = "re-convert the data (`foundryx data convert ... --overwrite`)"


def shard_problems(folder: Path) -> list[str]:
    """Missing, cut-short or damaged shards of the MDS dataset in ``folder``: sizes, and the
    hashes the converter recorded (mosaicml-streaming's own hashing; every shard is read once,
    at several GB/s)."""
    from streaming.base.hashing import get_hash

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
            problems.append(f"shard {path} {state} (corrupt or cut short); {REBUILD}")
            continue
        hashes = info.get("hashes") or {}
        algo = SHARD_HASH if SHARD_HASH in hashes else next(iter(hashes), None)
        if algo is not None and get_hash(algo, path.read_bytes()) != hashes[algo]:
            problems.append(f"shard {path}: its {algo} differs from {INDEX} (damaged: the right "
                            f"size, other bytes); {REBUILD}")
    return problems
