"""The ``text`` dataloader: batches of token sequences from local MDS shards.

Config section (``train_loader`` / ``eval_loader``)::

    name: text
    dataset:
      local: data/quickstart/mds   # folder written by `foundryx data convert`
      split: train                 # subfolder of local, or null
      shuffle: true                # default false
      shuffle_seed: 17             # default 0
      max_seq_len: 128             # <= the stored sequence length; longer ones are truncated
    drop_last: true                # default true
    num_workers: 0                 # default 0

Batches are ``{"input_ids", "labels", "attention_mask"}``, each a ``LongTensor (B, S)``;
``labels`` equals ``input_ids`` (the model shifts). Under ``torch.distributed`` each rank
reads its own part of the samples (``StreamingDataset`` partitions by rank).
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

from foundryx.data.convert import INDEX, read_manifest, vocab_hash
from foundryx.errors import DataError, did_you_mean

log = logging.getLogger(__name__)

_LOADER_DEFAULTS: dict[str, Any] = {"drop_last": True, "num_workers": 0}
_DATASET_DEFAULTS: dict[str, Any] = {"split": None, "shuffle": False, "shuffle_seed": 0}
_FIX = (
    "run `foundryx data convert --input ... --out <folder> ...`, or `make data` for the quickstart"
)


def _key_problems(section: dict, allowed: set[str], prefix: str) -> list[str]:
    return [
        f"{prefix}{key}: unknown option of the text loader"
        f"{did_you_mean(key, allowed) or '; accepts: ' + ', '.join(sorted(allowed))}"
        for key in section
        if key not in allowed
    ]


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _type_problems(cfg: dict, ds: dict) -> list[str]:
    """Type problems of ``cfg`` and its ``dataset`` (both with defaults filled in)."""
    checks = [
        ("dataset.shuffle", ds["shuffle"], isinstance(ds["shuffle"], bool), "true or false"),
        ("dataset.shuffle_seed", ds["shuffle_seed"], _is_int(ds["shuffle_seed"]), "an integer"),
        ("dataset.split", ds["split"], ds["split"] is None or isinstance(ds["split"], str),
         "a subfolder name or null"),
        ("drop_last", cfg["drop_last"], isinstance(cfg["drop_last"], bool), "true or false"),
        ("num_workers", cfg["num_workers"], _is_int(cfg["num_workers"]) and cfg["num_workers"] >= 0,
         "an integer >= 0"),
    ]
    problems = [f"{path}: expected {want}, got {value!r}" for path, value, ok, want in checks
                if not ok]
    max_seq_len = ds.get("max_seq_len")
    if max_seq_len is None:
        problems.append("dataset.max_seq_len: missing; the number of tokens per sample")
    elif not _is_int(max_seq_len) or max_seq_len < 1:
        problems.append(f"dataset.max_seq_len: expected a positive integer, got {max_seq_len!r}")
    return problems


def _folder_problems(ds: dict) -> list[str]:
    local, split = ds.get("local"), ds.get("split")
    if not isinstance(local, str) or not local:
        return [f"dataset.local: expected the folder of MDS shards, got {local!r}; {_FIX}"]
    root = Path(local).expanduser()
    folder = root / split if isinstance(split, str) and split else root
    key = "dataset.split" if folder != root else "dataset.local"
    if not root.is_dir():
        return [f"dataset.local: folder {root} does not exist; {_FIX}"]
    if not folder.is_dir():
        splits = sorted(p.name for p in root.iterdir() if p.is_dir())
        return [f"dataset.split: folder {folder} does not exist (subfolders of {root}: "
                f"{', '.join(splits) or 'none'}); {_FIX}"]
    if not (folder / INDEX).is_file():
        return [f"{key}: {folder} has no {INDEX}, so it is not an MDS dataset; {_FIX}"]
    manifest = read_manifest(folder)
    max_seq_len = ds.get("max_seq_len")
    if manifest and _is_int(max_seq_len) and max_seq_len > manifest["max_seq_len"]:
        return [f"dataset.max_seq_len: {max_seq_len} is longer than the sequences stored in "
                f"{folder} ({manifest['max_seq_len']} tokens); lower it, or re-convert with "
                f"--max-seq-len {max_seq_len}"]
    return []


def validate_text_loader_cfg(cfg: dict[str, Any]) -> list[str]:
    """Problems of a ``text`` loader section (paths relative to it); reads only small files."""
    ds = cfg.get("dataset")
    if not isinstance(ds, dict):
        return [f"dataset: expected {{local: <folder>, split: ..., max_seq_len: ...}}, got {ds!r}"]
    problems = _key_problems(cfg, {"name", "dataset", *_LOADER_DEFAULTS}, "")
    problems += _key_problems(ds, {"local", "max_seq_len", *_DATASET_DEFAULTS}, "dataset.")
    problems += _type_problems({**_LOADER_DEFAULTS, **cfg}, {**_DATASET_DEFAULTS, **ds})
    return problems + _folder_problems(ds)


@functools.cache
def _clean_stale_shared_memory() -> None:
    """Free shared memory leaked by crashed runs, once per process (later calls would free the
    memory of this process's own live datasets)."""
    try:
        from streaming.base.util import clean_stale_shared_memory
    except ImportError:
        log.info("this mosaicml-streaming has no clean_stale_shared_memory; not cleaning up")
        return
    clean_stale_shared_memory()


def _collate(samples: list[dict[str, Any]], max_seq_len: int) -> dict[str, Any]:
    import numpy as np
    import torch

    ids = torch.from_numpy(np.stack([s["tokens"][:max_seq_len] for s in samples]).astype(np.int64))
    return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def _num_tokens(batch: dict[str, Any]) -> int:
    return int(batch["attention_mask"].sum())


def _check_tokenizer(manifest: dict[str, Any] | None, tokenizer: Any, folder: Path) -> None:
    if manifest is None or tokenizer is None:
        return
    stored = manifest["tokenizer"]
    if stored["vocab_sha256"] != vocab_hash(tokenizer):
        raise DataError(
            f"{folder} was tokenized with {stored['name_or_path']!r} "
            f"(vocab {stored['vocab_size']}), whose vocabulary differs from the run's tokenizer "
            f"{tokenizer.name_or_path!r} (vocab {len(tokenizer)}); use that tokenizer, or "
            f"re-convert the data with this one"
        )


def build_text_dataloader(cfg: dict[str, Any], tokenizer: Any, device_batch_size: int):
    """A ``composer.core.DataSpec`` over the MDS shards named by ``cfg`` (see module doc)."""
    from composer.core import DataSpec
    from streaming import StreamingDataset
    from torch.utils.data import DataLoader

    problems = validate_text_loader_cfg(cfg)
    if problems:
        raise DataError("text dataloader:\n" + "\n".join(f"  - {p}" for p in problems))
    cfg = {**_LOADER_DEFAULTS, **cfg}
    ds = {**_DATASET_DEFAULTS, **cfg["dataset"]}
    folder = Path(ds["local"]).expanduser() / (ds["split"] or "")
    _check_tokenizer(read_manifest(folder), tokenizer, folder)

    _clean_stale_shared_memory()
    dataset = StreamingDataset(
        local=str(Path(ds["local"]).expanduser()),
        remote=None,
        split=ds["split"],
        shuffle=ds["shuffle"],
        shuffle_seed=ds["shuffle_seed"],
        batch_size=device_batch_size,
    )
    stored = len(dataset[0]["tokens"])
    if ds["max_seq_len"] > stored:  # datasets without a manifest are only checked here
        raise DataError(
            f"dataset.max_seq_len: {ds['max_seq_len']} is longer than the sequences stored in "
            f"{folder} ({stored} tokens); lower it, or re-convert with --max-seq-len "
            f"{ds['max_seq_len']}"
        )
    loader = DataLoader(
        dataset,
        batch_size=device_batch_size,
        collate_fn=functools.partial(_collate, max_seq_len=ds["max_seq_len"]),
        drop_last=cfg["drop_last"],
        num_workers=cfg["num_workers"],
    )
    return DataSpec(loader, get_num_tokens_in_batch=_num_tokens)


build_text_dataloader.config_problems = validate_text_loader_cfg
