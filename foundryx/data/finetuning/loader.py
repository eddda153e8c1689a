"""The ``finetuning`` dataloader: prompt/response or chat examples, masked, optionally packed.

Config section (``train_loader`` / ``eval_loader``)::

    name: finetuning
    dataset:
      path: data/chat.jsonl     # .jsonl, .parquet, save_to_disk folder, MDS folder, hf://owner/name
      # remote: s3://bucket/chat-mds  # or an MDS dataset in object storage, instead of path
      # local: /tmp/chat-mds          # its cache (default: a folder under the cache root)
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
memory); an MDS dataset in object storage (``remote``) is downloaded whole into ``local``
first (its index is read up front: a bad remote is one message, see
:mod:`foundryx.data.remote`). Batches: ``input_ids``, ``labels`` (-100 where no loss is taken), ``attention_mask``
(0 on padding), all ``LongTensor (B, S)`` padded to the longest row, and ``sequence_id``
when packed (see :mod:`foundryx.data.packing`; padding gets an id of its own).
"""

from __future__ import annotations

import itertools
import logging
import math
import random
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from foundryx.config.components import ModelFacts
from foundryx.config.types import coerce, option
from foundryx.data import packing
from foundryx.data import remote as remotes
from foundryx.data.finetuning.examples import IGNORE, chat_renderer, encode
from foundryx.data.options import LoaderOptions
from foundryx.data.sources import HUB_PREFIX, read_records
from foundryx.errors import DataError

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class FinetuningDatasetOptions:
    """The ``dataset`` of a ``finetuning`` loader."""

    path: str | None = option(".jsonl or .parquet file, save_to_disk or MDS folder, or "
                              "hf://owner/name (or remote: instead)", default=None)
    remote: str | None = option("an MDS dataset in object storage, e.g. s3://bucket/path, "
                                "instead of path", default=None)
    local: str | None = option("with remote: the cache folder (default: under the cache root)",
                               default=None)
    max_seq_len: int = option("longest example in tokens; longer ones are bad examples", gt=0)
    split: str | None = option("split of a Hugging Face dataset, or subfolder of an MDS folder",
                               default=None)
    target_prompts: Literal["none", "all"] = option("take the loss on prompts", default="none")
    target_responses: Literal["last", "all"] = option("take the loss on the last response or "
                                                      "all of them", default="last")
    packing_ratio: float | Literal["auto"] | None = option(
        "null: one example per row; auto; or a number >= 1 (examples considered per row)",
        default=None, ge=1)
    shuffle: bool = option("shuffle the examples", default=True)
    shuffle_seed: int = option("seed of the shuffle", default=0)
    skip_bad_examples: bool = option("skip malformed examples and log how many", default=False)

    def problems(self) -> list[str]:
        if self.remote is not None:
            if self.path is not None:
                return ["path: give either path or remote (an MDS dataset in object storage), "
                        "not both"]
            problem = remotes.scheme_problem(self.remote, "remote")
            return [problem] if problem else []
        if self.local is not None:
            return ["local: is the cache of remote:; for a local dataset use path:"]
        if self.path is None:
            return ["path: expected a .jsonl or .parquet file, a save_to_disk or MDS folder, "
                    "hf://owner/name, or remote: s3://bucket/path (an MDS dataset)"]
        if remotes.is_remote(self.path) and not self.path.startswith(HUB_PREFIX):
            return [f"path: {self.path!r} is object storage; write it as remote: {self.path} "
                    "(an MDS dataset)"]
        if not self.path.startswith(HUB_PREFIX) and not Path(self.path).expanduser().exists():
            return [f"path: {self.path} does not exist; give a .jsonl or .parquet file, a "
                    "save_to_disk or MDS folder, or hf://owner/name"]
        return []

    def location(self) -> tuple[str, str | None]:
        """(input, split for read_records): an MDS split is a subfolder; a remote MDS dataset
        is downloaded into its cache first."""
        if self.remote is not None:
            local = self.local or remotes.default_local(self.remote, "dataset.remote")
            return str(remotes.fetch_dataset(self.remote, local, self.split, "dataset.remote")), None
        path, split = self.path, self.split
        if split and not path.startswith(HUB_PREFIX) and (Path(path) / split / "index.json").is_file():
            return str(Path(path) / split), None
        return path, split


@dataclass(kw_only=True)
class FinetuningLoaderOptions(LoaderOptions):
    """The ``finetuning`` loader section (see the module docstring)."""

    dataset: FinetuningDatasetOptions = option("the examples: {path, max_seq_len, ...}")

    def first_rows_problems(self, tokenizer: Any, rows: int) -> tuple[list[str], str]:
        """A dry run's look at the data: ``(problems, what was read)``, the first ``rows``
        examples tokenized and checked as the run checks them (a bad one: the run's message,
        file:line). A dataset in object storage or on the hub is not downloaded for it."""
        ds = self.dataset
        if ds.remote is not None or ds.path.startswith(HUB_PREFIX):
            return [], f"not read ({ds.remote or ds.path} is remote; the run reads it)"
        read = f"the first {rows} examples of {ds.path} (all, when fewer) read and checked"
        try:
            load_examples(ds, tokenizer, first=rows)
        except DataError as e:
            return [f"dataset.path: {e}"], read
        return [], read

    def problems_with(self, model: ModelFacts) -> list[str]:
        problems = super().problems_with(model)
        if model.uses_sequence_id and self.dataset.packing_ratio is None:
            problems.append("dataset.packing_ratio: model.attn_config.attn_uses_sequence_id is "
                            "true, but unpacked fine-tuning batches have no sequence_id; set "
                            "packing_ratio (e.g. auto) or attn_uses_sequence_id: false")
        return problems


def load_examples(ds: FinetuningDatasetOptions, tokenizer: Any, first: int | None = None
                  ) -> list[tuple[list[int], list[int]]]:
    """Every good example (of the ``first`` ones, when given) as ``(input_ids, labels)``; bad
    ones raise, or are skipped and counted when ``skip_bad_examples``."""
    render = chat_renderer(tokenizer)
    if not getattr(tokenizer, "chat_template", None):
        log.info("tokenizer %s has no chat template; chat examples use the ChatML-style default",
                 tokenizer.name_or_path)
    path, split = ds.location()
    examples, bad = [], []
    for where, record in itertools.islice(read_records(path, split), first):
        try:
            examples.append(encode(record, where, tokenizer, render, ds.max_seq_len,
                                   ds.target_prompts, ds.target_responses))
        except DataError as e:
            if not ds.skip_bad_examples:
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


def build_rows(examples: list, ds: FinetuningDatasetOptions, device_batch_size: int) -> list[dict]:
    """Rows of the dataset: one example each, or packed (with ``sequence_id``)."""
    order = list(range(len(examples)))
    if ds.shuffle:
        random.Random(ds.shuffle_seed).shuffle(order)
    ratio = ds.packing_ratio
    if ratio is None:
        return [{"input_ids": examples[i][0], "labels": examples[i][1]} for i in order]
    lengths = [len(examples[i][0]) for i in order]
    if ratio == "auto":
        ratio, why = packing.auto_packing_ratio(lengths, ds.max_seq_len)
        log.info("packing_ratio auto -> %.1f: %s", ratio, why)
    window = max(1, math.ceil(ratio * device_batch_size))
    rows = []
    for members in packing.pack(lengths, ds.max_seq_len, window):
        row: dict[str, list[int]] = {"input_ids": [], "labels": [], "sequence_id": []}
        for k, m in enumerate(members):
            ids, labels = examples[order[m]]
            row["input_ids"] += ids
            # no loss on the first token: it is not predicted from the example before it
            row["labels"] += [IGNORE] + labels[1:]
            row["sequence_id"] += [k] * len(ids)
        rows.append(row)
    used = sum(lengths)
    log.info("packed %d examples into %d rows of %d tokens (%.1f%% padding)", len(examples),
             len(rows), ds.max_seq_len, 100 * (1 - used / (len(rows) * ds.max_seq_len)))
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


def build_finetuning_dataloader(options: FinetuningLoaderOptions | Mapping[str, Any],
                                tokenizer: Any, device_batch_size: int):
    """A ``composer.core.DataSpec`` of fine-tuning batches (see the module docstring)."""
    import functools

    from composer.core import DataSpec
    from composer.utils import dist
    from torch.utils.data import DataLoader

    options = coerce(FinetuningLoaderOptions, options, owner="the 'finetuning' dataloader")
    ds = options.dataset
    rows = build_rows(load_examples(ds, tokenizer), ds, device_batch_size)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    sampler = dist.get_sampler(rows, drop_last=options.drop_last, shuffle=ds.shuffle,
                               seed=ds.shuffle_seed)
    loader = DataLoader(rows, batch_size=device_batch_size, sampler=sampler,
                        collate_fn=functools.partial(collate, pad_id=pad_id),
                        drop_last=options.drop_last, num_workers=options.num_workers)
    return DataSpec(loader, get_num_tokens_in_batch=_num_tokens)
