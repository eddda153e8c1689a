"""Few-shot prompts: the draw of in-context examples and the rendered rows of each example.

The draw is LLM Foundry's: one ``random.Random(fewshot_random_seed)`` per category (or per
task), consumed in file order, ``num_fewshot`` distinct examples that never include the
example itself. So a task file gives the same prompts here as there, on every rank.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from foundryx.eval.examples import Example
from foundryx.eval.task_types import ICLTaskType


@dataclass(frozen=True)
class Rendered:
    index: int  # the example's id: its position among the task's examples
    line: int
    category: str
    queries: tuple[tuple[str, str], ...]  # (context, continuation) per scored row
    gold: int
    answers: tuple[str, ...]  # generation tasks


def fewshot_indices(n: int, k: int, idx: int, rng: random.Random) -> list[int]:
    """``min(k, n - 1)`` distinct indices in ``range(n)``, never ``idx``."""
    k = min(n - 1, k)
    if k <= 0:
        return []
    picked = set(rng.sample(range(n), k))
    if idx in picked:
        picked.remove(idx)
        if len(picked) < n - 1:
            extra = rng.choice(range(n))
            while extra in picked or extra == idx:
                extra = rng.choice(range(n))
            picked.add(extra)
    return list(picked)


def render(task_type: ICLTaskType, examples: list[Example], num_fewshot: int) -> list[Rendered]:
    """Every example with its prompt string and few-shot examples, in file order."""
    cfg = task_type.cfg
    groups: dict[str, list[int]] = {}
    for i, ex in enumerate(examples):
        groups.setdefault(ex.category, []).append(i)
    out: list[Rendered | None] = [None] * len(examples)
    for members in groups.values():
        rng = random.Random(cfg.fewshot_random_seed)
        for pos, i in enumerate(members):
            prompt = cfg.prompt_string
            for j in fewshot_indices(len(members), num_fewshot, pos, rng):
                prompt += task_type.solved(examples[members[j]].data, first=not prompt)
            ex = examples[i]
            queries = tuple(
                (prompt + context, continuation)
                for context, continuation in task_type.queries(ex.data, first=not prompt)
            )
            out[i] = Rendered(i, ex.line, ex.category, queries, task_type.gold(ex.data),
                              task_type.answers(ex.data))
    return out  # type: ignore[return-value]
