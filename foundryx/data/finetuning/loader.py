"""The ``finetuning`` dataloader: prompt/response or chat examples, masked, optionally packed.

Config section (``train_loader`` / ``eval_loader``)::

    name: finetuning
    dataset:
      path: data/chat.jsonl     # .jsonl, .parquet, save_to_disk folder, MDS folder, hf://owner/name
      split: train              # split of a Hugging Face dataset, or subfolder of an MDS folder
      max_seq_len: 512          # longer examples are bad examples
      target_prompts: none      # none | all   (see foundryx.data.finetuning.examples)
      target_responses: last    # last | all
      packing_ratio: null       # null: one example per row; auto; or a number >= 1
      shuffle: true             # default true
      shuffle_seed: 0
      skip_bad_examples: false  # true: skip malformed examples, log how many at the end
    drop_last: true
    num_workers: 0

The examples are read and tokenized once, when the loader is built (fine-tuning sets fit in
memory). Batches: ``input_ids``, ``labels`` (-100 where no loss is taken), ``attention_mask``
(0 on padding), all ``LongTensor (B, S)`` padded to the longest row, and ``sequence_id``
when packed (see :mod:`foundryx.data.packing`; padding gets an id of its own).
"""

from __future__ import annotations

import logging
import math
import random
from pathlib import Path
from typing import Any

from foundryx.data import packing
from foundryx.data.finetuning.examples import (
    IGNORE,
    TARGET_PROMPTS,
    TARGET_RESPONSES,
    chat_renderer,
    encode,
)
from foundryx.data.options import (
    LOADER_DEFAULTS,
    check,
    is_int,
    is_number,
    raise_problems,
    section_problems,
)
from foundryx.data.sources import HUB_PREFIX, read_records
from foundryx.errors import DataError

log = logging.getLogger(__name__)

_DATASET_DEFAULTS: dict[str, Any] = {
    "split": None, "target_prompts": "none", "target_responses": "last", "packing_ratio": None,
    "shuffle": True, "shuffle_seed": 0, "skip_bad_examples": False,
}
_DATASET_KEYS = {"path", "max_seq_len", *_DATASET_DEFAULTS}


def _location(ds: dict[str, Any]) -> tuple[str, str | None]:
    """(input, split for read_records): an MDS split is a subfolder."""
    path, split = str(ds["path"]), ds.get("split")
    if split and not path.startswith(HUB_PREFIX) and (Path(path) / split / "index.json").is_file():
        return str(Path(path) / split), None
    return path, split


def validate_finetuning_cfg(cfg: dict[str, Any]) -> list[str]:
    """Problems of a ``finetuning`` loader section (paths relative to it), without reading data."""
    ds = cfg.get("dataset")
    if not isinstance(ds, dict):
        return [f"dataset: expected {{path: <examples>, max_seq_len: ...}}, got {ds!r}"]
    problems = section_problems(cfg, _DATASET_KEYS, "finetuning")
    d = {**_DATASET_DEFAULTS, **ds}
    ratio, seq = d["packing_ratio"], d.get("max_seq_len")
    problems += check([
        ("dataset.max_seq_len", seq, is_int(seq) and seq > 0, "a positive integer"),
        ("dataset.target_prompts", d["target_prompts"], d["target_prompts"] in TARGET_PROMPTS,
         " or ".join(TARGET_PROMPTS)),
        ("dataset.target_responses", d["target_responses"],
         d["target_responses"] in TARGET_RESPONSES, " or ".join(TARGET_RESPONSES)),
        ("dataset.packing_ratio", ratio, ratio is None or ratio == "auto"
         or is_number(ratio) and ratio >= 1, "null, auto or a number >= 1"),
        ("dataset.shuffle", d["shuffle"], isinstance(d["shuffle"], bool), "true or false"),
        ("dataset.shuffle_seed", d["shuffle_seed"], is_int(d["shuffle_seed"]), "an integer"),
        ("dataset.skip_bad_examples", d["skip_bad_examples"],
         isinstance(d["skip_bad_examples"], bool), "true or false"),
    ])
    path = ds.get("path")
    if not isinstance(path, str) or not path:
        problems.append(f"dataset.path: expected a .jsonl or .parquet file, a dataset folder or "
                        f"hf://owner/name, got {path!r}")
    elif not path.startswith(HUB_PREFIX) and not Path(path).expanduser().exists():
        problems.append(f"dataset.path: {path} does not exist; give a .jsonl or .parquet file, a "
                        f"save_to_disk or MDS folder, or hf://owner/name")
    return problems


def load_examples(ds: dict[str, Any], tokenizer: Any) -> list[tuple[list[int], list[int]]]:
    """Every good example as ``(input_ids, labels)``; bad ones raise, or are skipped and
    counted when ``skip_bad_examples``."""
    render = chat_renderer(tokenizer)
    if not getattr(tokenizer, "chat_template", None):
        log.info("tokenizer %s has no chat template; chat examples use the ChatML-style default",
                 tokenizer.name_or_path)
    path, split = _location(ds)
    examples, bad = [], []
    for where, record in read_records(path, split):
        try:
            examples.append(encode(record, where, tokenizer, render, ds["max_seq_len"],
                                   ds["target_prompts"], ds["target_responses"]))
        except DataError as e:
            if not ds["skip_bad_examples"]:
                raise DataError(f"{e} (or set skip_bad_examples: true to skip bad examples)") \
                    from None
            bad.append(str(e))
    if bad:
        log.warning("skipped %d bad example(s) of %d in %s; the first: %s", len(bad),
                    len(bad) + len(examples), path, bad[0])
    if not examples:
        raise DataError(f"{path} holds no usable fine-tuning examples")
    log.info("fine-tuning data: %d examples from %s", len(examples), path)
    return examples


def build_rows(examples: list, ds: dict[str, Any], device_batch_size: int) -> list[dict]:
    """Rows of the dataset: one example each, or packed (with ``sequence_id``)."""
    order = list(range(len(examples)))
    if ds["shuffle"]:
        random.Random(ds["shuffle_seed"]).shuffle(order)
    ratio = ds["packing_ratio"]
    if ratio is None:
        return [{"input_ids": examples[i][0], "labels": examples[i][1]} for i in order]
    lengths = [len(examples[i][0]) for i in order]
    if ratio == "auto":
        ratio, why = packing.auto_packing_ratio(lengths, ds["max_seq_len"])
        log.info("packing_ratio auto -> %.1f: %s", ratio, why)
    window = max(1, math.ceil(ratio * device_batch_size))
    rows = []
    for members in packing.pack(lengths, ds["max_seq_len"], window):
        row: dict[str, list[int]] = {"input_ids": [], "labels": [], "sequence_id": []}
        for k, m in enumerate(members):
            ids, labels = examples[order[m]]
            row["input_ids"] += ids
            row["labels"] += labels
            row["sequence_id"] += [k] * len(ids)
        rows.append(row)
    used = sum(lengths)
    log.info("packed %d examples into %d rows of %d tokens (%.1f%% padding)", len(examples),
             len(rows), ds["max_seq_len"], 100 * (1 - used / (len(rows) * ds["max_seq_len"])))
    return rows


def collate(rows: list[dict[str, list[int]]], pad_id: int) -> dict[str, Any]:
    """Right-pad rows to the longest; padding: pad_id, label -100, mask 0, a new sequence_id."""
    import torch

    width = max(len(r["input_ids"]) for r in rows)
    batch: dict[str, list[list[int]]] = {"input_ids": [], "labels": [], "attention_mask": []}
    packed = "sequence_id" in rows[0]
    if packed:
        batch["sequence_id"] = []
    for r in rows:
        pad = width - len(r["input_ids"])
        batch["input_ids"].append(r["input_ids"] + [pad_id] * pad)
        batch["labels"].append(r["labels"] + [IGNORE] * pad)
        batch["attention_mask"].append([1] * len(r["input_ids"]) + [0] * pad)
        if packed:
            batch["sequence_id"].append(r["sequence_id"] + [r["sequence_id"][-1] + 1] * pad)
    return {k: torch.tensor(v, dtype=torch.long) for k, v in batch.items()}


def _num_tokens(batch: dict[str, Any]) -> int:
    return int(batch["attention_mask"].sum())


def build_finetuning_dataloader(cfg: dict[str, Any], tokenizer: Any, device_batch_size: int):
    """A ``composer.core.DataSpec`` of fine-tuning batches (see the module docstring)."""
    import functools

    from composer.core import DataSpec
    from composer.utils import dist
    from torch.utils.data import DataLoader

    raise_problems("finetuning", validate_finetuning_cfg(cfg))
    cfg = {**LOADER_DEFAULTS, **cfg}
    ds = {**_DATASET_DEFAULTS, **cfg["dataset"]}
    rows = build_rows(load_examples(ds, tokenizer), ds, device_batch_size)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    sampler = dist.get_sampler(rows, drop_last=cfg["drop_last"], shuffle=ds["shuffle"],
                               seed=ds["shuffle_seed"])
    loader = DataLoader(rows, batch_size=device_batch_size, sampler=sampler,
                        collate_fn=functools.partial(collate, pad_id=pad_id),
                        drop_last=cfg["drop_last"], num_workers=cfg["num_workers"])
    return DataSpec(loader, get_num_tokens_in_batch=_num_tokens)


build_finetuning_dataloader.config_problems = validate_finetuning_cfg
