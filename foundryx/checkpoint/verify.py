"""Integrity of a checkpoint: file sizes and hashes against the manifest, and model signature."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from foundryx.checkpoint.layout import MANIFEST, Manifest, file_and_rank
from foundryx.errors import CheckpointError

_CHUNK = 1 << 22


def file_digest(path: Path) -> dict[str, Any]:
    """``{"size": bytes, "sha256": hex}`` of one file."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            size += len(chunk)
    return {"size": size, "sha256": h.hexdigest()}


def file_problems(folder: Path, files: Mapping[str, Mapping[str, Any]], names: Iterable[str]) -> list[str]:
    """Problems of the files ``names`` of ``folder`` against their manifest entries."""
    problems = []
    for rel in names:
        want, path = files[rel], folder / rel
        named = file_and_rank(path)  # a data file: with the rank that wrote it
        if not path.is_file():
            problems.append(f"{named}: missing (listed in {MANIFEST})")
            continue
        size = path.stat().st_size
        if size != want["size"]:
            problems.append(f"{named}: {size} bytes, {MANIFEST} says {want['size']} (truncated or replaced)")
        elif file_digest(path)["sha256"] != want["sha256"]:
            problems.append(f"{named}: sha256 differs from {MANIFEST} (corrupt or replaced)")
    return problems


def verify_files(folder: Path, manifest: Manifest, rank: int = 0, world_size: int = 1) -> list[str]:
    """Check this rank's share of the listed files (every ``world_size``-th, from ``rank``)."""
    names = sorted(manifest.files)[rank::world_size]
    return file_problems(Path(folder), manifest.files, names)


def raise_problems(folder: Path, problems: list[str]) -> None:
    if problems:
        head = f"checkpoint {folder} failed verification:"
        raise CheckpointError("\n".join([head] + [f"  - {p}" for p in problems]))


def signature(shapes: Mapping[str, tuple[tuple[int, ...], Any]]) -> str:
    """A hash of parameter names, global shapes and dtypes (``{name: (shape, dtype)}``)."""
    h = hashlib.sha256()
    for name in sorted(shapes):
        shape, dtype = shapes[name]
        h.update(f"{name}:{tuple(shape)}:{str(dtype).removeprefix('torch.')}\n".encode())
    return h.hexdigest()[:32]


def shape_mismatches(
    want: Mapping[str, tuple[tuple[int, ...], Any]],
    have: Mapping[str, tuple[tuple[int, ...], Any]],
    limit: int = 5,
) -> list[str]:
    """Human-readable differences between a model's tensors and a checkpoint's (at most ``limit``)."""
    out = [f"{k}: missing from the checkpoint" for k in sorted(set(want) - set(have))]
    out += [f"{k}: in the checkpoint but not in the model" for k in sorted(set(have) - set(want))]
    out += [
        f"{k}: model has shape {tuple(want[k][0])}, checkpoint has {tuple(have[k][0])}"
        for k in sorted(set(want) & set(have))
        if tuple(want[k][0]) != tuple(have[k][0])
    ]
    more = len(out) - limit
    return out[:limit] + ([f"... and {more} more"] if more > 0 else [])
