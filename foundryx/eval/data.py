"""The dataloaders of prepared ICL tasks (one per task and few-shot count; the tasks
themselves: :mod:`foundryx.eval.prepare`).

Each rank evaluates every ``world_size``-th example, starting at its rank. Ranks with fewer
examples repeat one marked ``primary = 0``, so every rank runs as many batches (FSDP needs
that) and metrics count every example exactly once. Under tensor parallelism ``rank`` and
``world_size`` are the data-parallel ones (:func:`data_parallel_share`): the ranks of a
tensor-parallel group read the same examples, and only the first counts them. A batch holds
``batch_size`` examples, one row per choice, right-padded to its own longest row (generation:
left-padded prompts).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from foundryx.eval.prepare import (  # noqa: F401  (the names callers import from here)
    LM_EVAL_METRIC,
    ICLExample,
    PreparedTask,
    generation_length,
    prepare_task,
    read_task,
    read_tasks,
)


def rank_share(n: int, rank: int, world_size: int, counts: bool = True) -> list[tuple[int, bool]]:
    """(example index, primary) pairs of one rank; every rank gets ``ceil(n / world_size)``.
    ``counts=False``: none is primary (a tensor-parallel peer of the rank that counts them)."""
    own = list(range(rank, n, world_size))
    pad = math.ceil(n / world_size) - len(own)
    return [(i, counts) for i in own] + [(rank % n, False)] * pad


def data_parallel_share(rank: int, world_size: int, tp: int) -> tuple[int, int, bool]:
    """(data-parallel rank, data-parallel ranks, whether this rank counts its examples) of a
    global rank when ``tp`` consecutive ranks form a tensor-parallel group (foundryx's mesh is
    (replicate, shard, tp), tp innermost): they evaluate the same examples, the first counts."""
    return rank // tp, world_size // tp, rank % tp == 0


class ICLDataset(Dataset):
    """The examples one rank evaluates (see module doc), longest first: batches of similar
    lengths need little padding, and a batch too large for memory fails at once."""

    def __init__(self, task: PreparedTask, rank: int = 0, world_size: int = 1, counts: bool = True):
        self.task = task
        self.items = sorted(rank_share(len(task.examples), rank, world_size, counts),
                            key=lambda item: -max(len(r.ids) for r in task.examples[item[0]].rows))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> tuple[ICLExample, bool]:
        idx, primary = self.items[i]
        return self.task.examples[idx], primary


def _pad(rows: list[tuple[int, ...]], pad_id: int, left: bool,
         multiple: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    width = -(-max(len(r) for r in rows) // multiple) * multiple
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, r in enumerate(rows):
        sl = slice(width - len(r), width) if left else slice(0, len(r))
        ids[i, sl] = torch.tensor(r, dtype=torch.long)
        mask[i, sl] = 1
    return ids, mask


class ICLCollator:
    """Examples → one batch dict (keys documented in docs/eval.md). ``pad_multiple``: the
    padded length is a multiple of it (sequence parallelism splits the sequence over the
    tensor-parallel ranks)."""

    def __init__(self, task: PreparedTask, tokenizer: Any, pad_multiple: int = 1,
                 hf_stopping: bool = True):
        self.task = task
        self.tokenizer = tokenizer
        self.pad_multiple = pad_multiple
        self.hf_stopping = hf_stopping  # generation batches carry generate's stopping criteria
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
        self.pad_id = pad if pad is not None else 0

    def __call__(self, items: list[tuple[ICLExample, bool]]) -> dict[str, Any]:
        rows = [(ex, primary, choice, enc) for ex, primary in items for choice, enc in enumerate(ex.rows)]
        generate = self.task.task_type.mode == "generate"
        ids, mask = _pad([enc.ids for *_, enc in rows], self.pad_id, left=generate,
                         multiple=self.pad_multiple)
        batch: dict[str, Any] = {
            "input_ids": ids,
            "attention_mask": mask,
            "labels": ids.clone(),
            "mode": "generate" if generate else "icl_task",
            "example_id": torch.tensor([ex.rendered.index for ex, *_ in rows]),
            "category": torch.tensor([ex.category for ex, *_ in rows]),
            "primary": torch.tensor([p for _, p, *_ in rows]),
        }
        if generate:
            cfg = self.task.cfg
            batch["answers"] = [list(ex.rendered.answers) for ex, *_ in rows]
            batch["icl_options"] = {"stop_sequences": list(cfg.stop_sequences),
                                    "cot_delimiter": cfg.cot_delimiter,
                                    "do_normalization": cfg.do_normalization}
            batch["generation_kwargs"] = {
                "max_new_tokens": self.task.max_new_tokens, "do_sample": False,
                "eos_token_id": self.tokenizer.eos_token_id,
            }
            if self.hf_stopping:  # transformers: only for batches Hugging Face generate runs
                from foundryx.eval.hf_stopping import stopping_criteria

                batch["generation_kwargs"]["stopping_criteria"] = stopping_criteria(
                    self.tokenizer, list(cfg.stop_sequences), ids.shape[1])
        else:
            batch["cont_start"] = torch.tensor([enc.cont_start for *_, enc in rows])
            batch["cont_end"] = torch.tensor([enc.cont_end for *_, enc in rows])
            if self.task.cfg.scoring == "lm_eval":
                batch["norm_len"] = torch.tensor(
                    [ex.rendered.norm_lengths[c] for ex, _, c, _ in rows], dtype=torch.float64)
            batch["choice"] = torch.tensor([c for *_, c, _ in rows])
            batch["gold"] = torch.tensor([ex.rendered.gold for ex, *_ in rows])
        return batch


def split_batch(batch: dict[str, Any], rows_per_chunk: int) -> list[dict[str, Any]]:
    """Split per-row tensors and lists into chunks; other entries go to every chunk. Any split
    is safe: the metrics group rows by example id when they compute."""
    n = batch["input_ids"].shape[0]
    starts = range(0, n, max(1, int(rows_per_chunk)))
    chunks = []
    for s in starts:
        chunk = {}
        for k, v in batch.items():
            per_row = (isinstance(v, torch.Tensor) and v.ndim and v.shape[0] == n) or (
                isinstance(v, list) and len(v) == n)
            chunk[k] = v[s:s + rows_per_chunk] if per_row else v
        chunks.append(chunk)
    return chunks


def build_dataloader(task: PreparedTask, tokenizer: Any, batch_size: int, rank: int = 0,
                     world_size: int = 1, counts: bool = True, pad_multiple: int = 1,
                     hf_stopping: bool = True) -> DataLoader:
    """This rank's batches of ``task``; ``hf_stopping=False``: generation batches without
    Hugging Face ``generate``'s stopping criteria (for a loop that checks stop sequences
    itself)."""
    dataset = ICLDataset(task, rank, world_size, counts)
    # the dataset is this rank's share already; a one-replica DistributedSampler reads it in
    # order, and is what Composer's DataSpec asks of a map-style dataset on several processes
    sampler = DistributedSampler(dataset, num_replicas=1, rank=0, shuffle=False)
    return DataLoader(dataset, batch_size=batch_size, sampler=sampler,
                      collate_fn=ICLCollator(task, tokenizer, pad_multiple, hf_stopping),
                      num_workers=0)


def build_dataspec(task: PreparedTask, tokenizer: Any, batch_size: int, rank: int = 0,
                   world_size: int = 1, counts: bool = True, pad_multiple: int = 1) -> Any:
    """A Composer DataSpec for an Evaluator."""
    from composer.core import DataSpec

    loader = build_dataloader(task, tokenizer, batch_size, rank, world_size, counts, pad_multiple)
    return DataSpec(loader, split_batch=split_batch,
                    get_num_samples_in_batch=_num_examples)


def _num_examples(batch: dict[str, Any]) -> int:
    return int(batch["example_id"][batch["primary"].bool()].unique().numel())
