"""Prepared ICL tasks and their dataloaders (one per task and few-shot count).

Each rank evaluates every ``world_size``-th example, starting at its rank. Ranks with fewer
examples repeat one marked ``primary = 0``, so every rank runs as many batches (FSDP needs
that) and metrics count every example exactly once. Under tensor parallelism ``rank`` and
``world_size`` are the data-parallel ones (:func:`data_parallel_share`): the ranks of a
tensor-parallel group read the same examples, and only the first counts them. A batch holds
``batch_size`` examples, one row per choice, right-padded to its own longest row (generation:
left-padded prompts).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from foundryx import registry
from foundryx.errors import DataError
from foundryx.eval.encode import (
    Encoded,
    encode_prompts,
    encode_rows,
    encode_rows_lm_eval,
    max_answer_tokens,
)
from foundryx.eval.examples import Example, read_examples
from foundryx.eval.prompts import Rendered, render, render_lm_eval
from foundryx.eval.task_config import ICLTaskConfig
from foundryx.eval.task_types import GenerationWithAnswers, ICLTaskType

log = logging.getLogger(__name__)
LM_EVAL_METRIC = "icl_lm_eval_accuracy"  # the metrics registry key of scoring: lm_eval


@dataclass
class ICLExample:
    rendered: Rendered
    rows: list[Encoded]
    category: int  # index into PreparedTask.categories


@dataclass
class PreparedTask:
    """One task at one few-shot count, tokenized and ready to batch."""

    cfg: ICLTaskConfig
    num_fewshot: int
    task_type: ICLTaskType
    examples: list[ICLExample]
    categories: list[str]
    metric: str  # metrics registry key
    max_new_tokens: int = 0

    @property
    def key(self) -> str:
        return self.cfg.key(self.num_fewshot)


def _encode(task_type: ICLTaskType, rendered: list[Rendered], tokenizer: Any, max_len: int,
            max_new_tokens: int, path: str) -> list[list[Encoded]]:
    flat = [q for r in rendered for q in r.queries]
    if task_type.mode == "generate":
        budget = max_len - max_new_tokens
        if budget < 1:
            raise DataError(f"{path}: max_new_tokens {max_new_tokens} leaves no room for the prompt "
                            f"in max_seq_len {max_len}; lower max_new_tokens or raise max_seq_len")
        encoded: list[Encoded | str] = list(encode_prompts(tokenizer, [c for c, _ in flat], budget))
    elif task_type.cfg.scoring == "lm_eval":
        encoded = encode_rows_lm_eval(tokenizer, flat, max_len)
    else:
        encoded = encode_rows(tokenizer, flat, max_len)
    out, pos = [], 0
    for r in rendered:
        rows = encoded[pos:pos + len(r.queries)]
        pos += len(r.queries)
        bad = next((e for e in rows if isinstance(e, str)), None)
        if bad is not None:
            raise DataError(f"{path}:{r.line}: {bad} (task {task_type.cfg.label!r})")
        out.append(rows)  # type: ignore[arg-type]
    return out


def read_task(cfg: ICLTaskConfig) -> list[Example]:
    """The task's examples, checked: every row has the fields its type needs, and every
    few-shot count leaves the example itself out of its draw (DataError otherwise)."""
    task_type = registry.icl_tasks.get(cfg.icl_task_type)(cfg)
    examples = read_examples(cfg.dataset_uri, task_type)
    groups: dict[str, int] = {}
    for ex in examples:
        groups[ex.category] = groups.get(ex.category, 0) + 1
    where, n = min(((f"category {c!r}" if c else "the file", k) for c, k in groups.items()),
                   key=lambda item: item[1])
    too_many = [s for s in cfg.shots if s > n - 1]
    if too_many:
        raise DataError(
            f"{cfg.dataset_uri}: task {cfg.label!r} asks for {max(too_many)} few-shot examples, "
            f"but {where} has {n} example{'s' if n != 1 else ''} ({n - 1} besides the one asked); "
            f"lower num_fewshot to at most {n - 1} or use a larger file")
    return examples


def generation_length(cfg: ICLTaskConfig, tokenizer: Any, examples: list[Example]) -> int:
    """Tokens a generation task generates: ``max_new_tokens``, else LLM Foundry's rule over
    the whole file (:func:`foundryx.eval.encode.max_answer_tokens`)."""
    task_type = registry.icl_tasks.get(cfg.icl_task_type)(cfg)
    if cfg.max_new_tokens:
        return cfg.max_new_tokens
    responses = [task_type.answer_text(ex.data, a) for ex in examples
                 for a in (ex.data["answer"], *ex.data.get("aliases", []))]
    return max_answer_tokens(tokenizer, responses, cot=bool(cfg.cot_delimiter))


def prepare_task(cfg: ICLTaskConfig, tokenizer: Any, max_seq_len: int,
                 max_examples: int | None = None, model_max_len: int | None = None,
                 examples: list[Example] | None = None) -> list[PreparedTask]:
    """The task at each of its few-shot counts (the file is read once, or ``examples`` given
    by :func:`read_task`). Few-shot examples are drawn from the whole file, then the first
    ``max_examples`` are kept. Rows get the task's ``max_seq_len`` tokens, else
    ``max_seq_len``, and never more than ``model_max_len``."""
    task_type = registry.icl_tasks.get(cfg.icl_task_type)(cfg)
    every = examples if examples is not None else read_task(cfg)
    categories = list(dict.fromkeys(ex.category for ex in every[:max_examples]))
    max_len = min(cfg.max_seq_len or max_seq_len, model_max_len or math.inf)
    new_tokens = 0
    if isinstance(task_type, GenerationWithAnswers):
        new_tokens = generation_length(cfg, tokenizer, every)
    draw = render_lm_eval if cfg.scoring == "lm_eval" else render
    prepared = []
    for shots in cfg.shots:
        rendered = draw(task_type, every, shots)[:max_examples]
        rows = _encode(task_type, rendered, tokenizer, max_len, new_tokens, cfg.dataset_uri)
        truncated = sum(1 for r in rows if any(e.truncated for e in r))
        if truncated:
            log.info("%s: %d of %d examples were cut on the left to fit max_seq_len %d",
                     cfg.key(shots), truncated, len(rows), max_len)
        items = [ICLExample(r, e, categories.index(r.category)) for r, e in zip(rendered, rows)]
        metric = cfg.metric or (LM_EVAL_METRIC if cfg.scoring == "lm_eval" else task_type.metric)
        prepared.append(PreparedTask(cfg, shots, task_type, items, categories, metric, new_tokens))
    return prepared


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
