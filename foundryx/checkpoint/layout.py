"""The on-disk layout of foundryx checkpoints, the manifest, and finding complete checkpoints.

::

    save_folder/
      ep0-ba8/                  a committed checkpoint (renamed into place when complete)
        manifest.json           written last: format, timestamp, world size, model signature,
                                size and sha256 of every other file
        trainer_state.json      timestamp, schedulers, dataset position, grad scaler
        rng/rank0.json ...      each rank's RNG states
        components.json         the run's model and tokenizer sections (see metadata.py)
        hf/                     the model's Hugging Face config.json and tokenizer files
        dcp/.metadata           torch.distributed.checkpoint: model + optimizer, sharded
        dcp/__0_0.distcp ...
      latest -> ep0-ba8         convenience link; discovery never relies on it
      .tmp-ep0-ba12/            a save in progress (or one killed half-way): never loaded

A checkpoint is complete when its folder has the final name and holds ``manifest.json``.
"""

from __future__ import annotations

import json
import os
import re
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from foundryx.errors import CheckpointError
from foundryx.runtime.atomic_writes import write_text_atomically

FORMAT = "foundryx-checkpoint"
VERSION = 1
MANIFEST = "manifest.json"
TRAINER_STATE = "trainer_state.json"
DCP_DIR = "dcp"
RNG_DIR = "rng"
LATEST = "latest"
TMP_PREFIX = ".tmp-"
CORRUPT_SUFFIX = ".corrupt"


_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")


def file_and_rank(path: str | Path) -> str:
    """``path`` with the rank that wrote it, e.g. ``ckpt/dcp/__1_0.distcp (written by rank 1)``:
    DCP names each rank's data file ``__<rank>_<n>.distcp``."""
    m = _RANK_FILE.match(Path(path).name)
    return f"{path} (written by rank {m[1]})" if m else str(path)


@dataclass
class Manifest:
    """What a committed checkpoint holds; ``files`` maps relative paths to size and sha256."""

    batch: int
    epoch: int
    world_size: int
    run_name: str | None
    model_class: str
    model_signature: str
    num_params: int
    files: dict[str, dict[str, Any]] = field(default_factory=dict)
    format: str = FORMAT
    version: int = VERSION

    def write(self, folder: Path) -> None:
        """Write ``manifest.json`` atomically (temp file, fsync, rename)."""
        write_json_atomic(folder / MANIFEST, asdict(self))

    @classmethod
    def read(cls, folder: Path) -> Manifest:
        path = Path(folder) / MANIFEST
        if not path.is_file():
            raise CheckpointError(
                f"{path}: missing; {folder} is not a complete foundryx checkpoint "
                "(a save that was interrupted, or another format)"
            )
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{path}: unreadable manifest ({e}); the checkpoint is corrupt") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise CheckpointError(f"{path}: not a foundryx checkpoint manifest")
        if data.get("version") != VERSION:
            raise CheckpointError(
                f"{path}: manifest version {data.get('version')!r}; this foundryx reads version {VERSION}"
            )
        known = {f for f in cls.__dataclass_fields__}
        try:
            manifest = cls(**{k: v for k, v in data.items() if k in known})
        except TypeError as e:
            raise CheckpointError(f"{path}: incomplete manifest ({e})") from None
        escaping = [rel for rel in manifest.files if outside(folder, rel)]
        if escaping:
            raise CheckpointError(f"{path}: lists {escaping[0]!r}, outside the checkpoint folder; "
                                  "the manifest is damaged or crafted: use another checkpoint")
        return manifest


def checkpoint_name(epoch: int, batch: int) -> str:
    return f"ep{epoch}-ba{batch}"


def read_json(path: Path) -> Any:
    """The JSON in ``path``, or CheckpointError naming the file (missing, unreadable, invalid)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing; the checkpoint is incomplete: use an earlier "
                              "one") from None
    except (OSError, ValueError) as e:  # ValueError: JSONDecodeError and UnicodeDecodeError
        raise CheckpointError(f"{path}: not valid JSON ({e}); the checkpoint is damaged: use an "
                              "earlier one") from None


def outside(folder: Path, rel: str) -> bool:
    """Whether the manifest entry ``rel`` names a file outside ``folder`` (absolute, ``..``,
    or through a symlink)."""
    root = Path(folder).resolve()
    return Path(rel).is_absolute() or not (root / rel).resolve().is_relative_to(root)


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to ``path`` through a temporary file and an atomic rename."""
    write_text_atomically(path, json.dumps(data, indent=1, sort_keys=True))


def fsync_dir(path: Path) -> None:
    """Make a rename inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def is_checkpoint(folder: Path) -> bool:
    """True for a folder that holds a manifest (complete, though not yet verified)."""
    return (Path(folder) / MANIFEST).is_file()


def complete_checkpoints(save_folder: str | Path) -> list[tuple[Path, Manifest | None]]:
    """Committed checkpoints in ``save_folder``, newest first (by batch, then epoch).

    An entry whose manifest cannot be read comes first, with ``None``, so the caller reports
    it; temp folders of unfinished saves and folders set aside as corrupt are skipped.
    """
    root = Path(save_folder)
    if not root.is_dir():
        return []
    found: list[tuple[tuple[int, int], Path, Manifest | None]] = []
    for child in root.iterdir():
        if (child.name.startswith(TMP_PREFIX) or child.name == LATEST or child.is_symlink()
                or CORRUPT_SUFFIX in child.name or not is_checkpoint(child)):
            continue
        try:
            m = Manifest.read(child)
            found.append(((m.batch, m.epoch), child, m))
        except CheckpointError:
            found.append(((sys.maxsize, 0), child, None))  # unreadable: check it first
    found.sort(key=lambda t: (t[0], t[1].name), reverse=True)
    return [(p, m) for _, p, m in found]


def unfinished_saves(save_folder: str | Path) -> list[Path]:
    """Temp folders left by saves that never committed (a crash or kill during a save)."""
    root = Path(save_folder)
    return sorted(p for p in root.glob(TMP_PREFIX + "*") if p.is_dir()) if root.is_dir() else []


def point_latest(save_folder: Path, name: str) -> None:
    """Atomically repoint ``save_folder/latest`` at ``name``."""
    link = save_folder / LATEST
    tmp = save_folder / f".{LATEST}.tmp"  # a dot name: a kill here leaves nothing that looks final
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(name, tmp)
    os.replace(tmp, link)


# A run folder (runs/<name>/) holds the save_folder and, by default, what follows a run:
#   runs/<name>/checkpoints/   save_folder          runs/<name>/metrics.jsonl, run.json, report/
#   runs/<name>/export/hf      foundryx export      runs/<name>/export/adapter, export/merged (LoRA)
#   runs/<name>/eval/          foundryx eval        (foundryx report finds results.json there)
EXPORT_DIR = "export"
EVAL_DIR = "eval"


def run_folder(path: str | Path) -> Path | None:
    """The run folder ``path`` belongs to: the save_folder's parent for a checkpoint folder,
    its manifest or a save_folder (``runs/x`` for ``runs/x/checkpoints/ep0-ba8``), the export
    folder's parent for an export (``runs/x`` for ``runs/x/export/adapter``); None for anything
    else (a weights file, a folder of another layout, an ``s3://`` URL)."""
    p = Path(path)
    if "://" in str(path):
        return None
    if p.name == MANIFEST:
        p = p.parent
    if is_checkpoint(p):
        return p.parent.parent
    if p.is_dir() and complete_checkpoints(p):
        return p.parent
    if p.parent.name == EXPORT_DIR:
        return p.parent.parent
    return None


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder from a checkpoint folder, its manifest, or a save_folder (newest)."""
    p = Path(path)
    if p.is_file() and p.name == MANIFEST:
        return p.parent
    if is_checkpoint(p):
        return p
    if p.is_dir():
        done = complete_checkpoints(p)
        if done:
            return done[0][0]
        raise CheckpointError(
            f"{p}: no complete checkpoint here (no folder with a {MANIFEST}); "
            "give a checkpoint folder or a save_folder that has one"
        )
    raise CheckpointError(f"{p}: no such checkpoint folder or file")
