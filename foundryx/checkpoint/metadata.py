"""What a checkpoint records about its model besides the weights, so that ``foundryx export``,
``foundryx eval`` and :func:`foundryx.checkpoint.rebuild.rebuild_model` need no run config:

- ``components.json``: the run's resolved ``model`` and ``tokenizer`` sections (registry name
  and options), written by the Checkpointer; the model is rebuilt from it through the
  ``models`` registry, so a plugin's model round-trips like a built-in one;
- ``hf/``: the Hugging Face config of the model (when it has one) and the tokenizer's files
  (when it can ``save_pretrained``); checkpoints of older foundryx versions have only this.

Both are covered by the manifest's hashes like every other file of the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

from foundryx.checkpoint.layout import MANIFEST, resolve_checkpoint, write_json_atomic
from foundryx.checkpoint.remote import fetch, is_remote
from foundryx.errors import CheckpointError
from foundryx.runtime.hf_compat import portable_tokenizer_config

METADATA_DIR = "hf"  # inside a checkpoint folder: config.json and tokenizer files
COMPONENTS = "components.json"  # inside a checkpoint folder: the model and tokenizer sections
COMPONENTS_VERSION = 1
TOKENIZER_CONFIG = "tokenizer_config.json"
# what a tokenizer may return that no model foundryx trains takes (its batches carry input_ids
# and attention_mask): `model.generate(**tok(text, return_tensors="pt"))` refuses it
UNUSED_INPUTS = ("token_type_ids",)


def record_of(model: Any, tokenizer: Any) -> dict[str, Any]:
    """The content of ``components.json`` for a ``model`` and a ``tokenizer`` section (each a
    mapping with ``name``, an options dataclass instance, or None); CheckpointError when one
    cannot be stored as JSON (checked before training starts, not at the first save)."""
    record: dict[str, Any] = {"version": COMPONENTS_VERSION}
    for key, section in (("model", model), ("tokenizer", tokenizer)):
        if dataclasses.is_dataclass(section) and not isinstance(section, type):
            section = dataclasses.asdict(section)
        if section is not None:
            try:
                record[key] = json.loads(json.dumps(section))
            except (TypeError, ValueError) as e:
                raise CheckpointError(f"{key}: the section cannot be recorded in checkpoints as "
                                      f"JSON ({e}); use plain values (strings, numbers, lists, "
                                      "mappings)") from None
    return record


def write_components(folder: str | Path, record: dict[str, Any]) -> Path:
    """Write ``folder/components.json`` (see :func:`record_of`)."""
    path = Path(folder) / COMPONENTS
    write_json_atomic(path, record)
    return path


def record_folder(checkpoint: str | Path) -> Path | None:
    """The folder holding a checkpoint's records: the checkpoint folder (or the newest of a
    save_folder), or the folder of a weights file; None when there is no checkpoint. An
    ``s3://`` checkpoint is downloaded (verified) into the local cache first."""
    if is_remote(checkpoint):
        return fetch(str(checkpoint))
    path = Path(checkpoint)
    if path.is_dir() or path.name == MANIFEST:
        try:
            return resolve_checkpoint(path)
        except CheckpointError:
            return None
    return path.parent if path.is_file() else None


def read_components(checkpoint: str | Path) -> tuple[dict[str, Any], Path] | None:
    """``(record, path of components.json)`` of a checkpoint, or None when it has none."""
    folder = record_folder(checkpoint)
    path = folder / COMPONENTS if folder is not None else None
    if path is None or not path.is_file():
        return None
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{path}: unreadable ({e}); the checkpoint is corrupt") from None
    if not isinstance(record, dict) or not isinstance(record.get("model"), dict):
        raise CheckpointError(f"{path}: holds no model section; the checkpoint is corrupt")
    if record.get("version") != COMPONENTS_VERSION:
        raise CheckpointError(f"{path}: version {record.get('version')!r}; this foundryx reads "
                              f"version {COMPONENTS_VERSION}")
    return record, path


def write_model_metadata(folder: str | Path, composer_model: Any) -> Path | None:
    """Write ``folder/hf/``: the model's config.json and its tokenizer files. Returns the
    ``hf`` folder, or None for a model without a Hugging Face config (a plugin's own
    ComposerModel); a tokenizer without ``save_pretrained`` is left out."""
    config = getattr(getattr(composer_model, "model", None), "config", None)
    if not hasattr(config, "save_pretrained"):
        return None
    out = Path(folder) / METADATA_DIR
    config.save_pretrained(out)
    tokenizer = getattr(composer_model, "tokenizer", None)
    if hasattr(tokenizer, "save_pretrained"):
        save_tokenizer(tokenizer, out)
    return out


def save_tokenizer(tokenizer: Any, folder: str | Path) -> None:
    """``tokenizer.save_pretrained(folder)``, its ``tokenizer_config.json`` then naming the
    inputs the model takes (``model_input_names``: ``input_ids``, ``attention_mask``) without
    :data:`UNUSED_INPUTS`: a tokenizer made with ``PreTrainedTokenizerFast`` (the quickstart's)
    returns ``token_type_ids`` by default, which ``model.generate(**tok(text,
    return_tensors="pt"))`` refuses; and a tokenizer class that transformers 4 and 5 both load
    (:func:`foundryx.runtime.hf_compat.portable_tokenizer_config`). The tokenizer object itself is left
    as it is."""
    tokenizer.save_pretrained(folder)
    path = Path(folder) / TOKENIZER_CONFIG
    if not path.is_file():
        return
    names = list(getattr(tokenizer, "model_input_names", None) or [])
    kept = [name for name in names if name not in UNUSED_INPUTS]
    before = json.loads(path.read_text(encoding="utf-8"))
    config = dict(portable_tokenizer_config(before))  # a class transformers 4 and 5 both load
    if kept:
        config["model_input_names"] = kept  # what AutoTokenizer.from_pretrained passes to __init__
    if config != before:
        path.write_text(json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
                        encoding="utf-8")


def metadata_folder(checkpoint: str | Path) -> Path | None:
    """The ``hf/`` folder of a checkpoint folder, of the newest checkpoint of a save_folder,
    or beside a weights file; None when there is none (or no checkpoint at all)."""
    folder = record_folder(checkpoint)
    meta = folder / METADATA_DIR if folder is not None else None
    return meta if meta is not None and (meta / "config.json").is_file() else None


def has_model_record(checkpoint: str | Path) -> bool:
    """Whether a checkpoint says what model it holds (``components.json`` or ``hf/``)."""
    folder = record_folder(checkpoint)
    return (folder is not None and (folder / COMPONENTS).is_file()) or metadata_folder(checkpoint) is not None
