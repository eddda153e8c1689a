"""ICL tasks read, rendered and tokenized: :func:`prepare_task` gives a task at each of its
few-shot counts as token rows (:class:`PreparedTask`), ready to batch
(:mod:`foundryx.eval.data`). No torch: a one-process eval prepares its tasks in a child
process while it imports torch (:mod:`foundryx.eval.ahead`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foundryx import registry
from foundryx.errors import DataError
from foundryx.eval.config import LoadedEvalConfig
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


def read_tasks(loaded: LoadedEvalConfig) -> dict[str, list[Example]]:
    """Every task's examples by label, read and checked before any model loads (a bad row or
    too many few-shot examples fails here, with nothing evaluated or written); tasks whose
    file is absent are left out with ``skip_missing_data``."""
    out = {}
    for task_cfg in loaded.tasks:
        if loaded.cfg.skip_missing_data and not Path(task_cfg.dataset_uri).is_file():
            continue
        out[task_cfg.label] = read_task(task_cfg)
    return out
